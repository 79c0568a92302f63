"""What the IEEE float MIN over MPI costs: MPI's built-in MIN, the old np.minimum user op, and the op used now.

    axonhpc launch -n 2 benchmarks/minmax_op.py [--sizes 4096,16777216] [--rounds 9] [--dtype float32]

Each round times, in an order that rotates from round to round, one block of blocking
``MPI_Allreduce`` calls (in place, on ``MPI.COMM_WORLD``, as the MPI backend makes them) with each of

- ``built-in``: ``MPI.MIN`` (its NaN and zero handling left to the library; the integers' op);
- ``np.minimum``: the user op float MIN used to be (a NaN wins, but of two zeros the second);
- ``IEEE``: ``axonhpc.backends.mpi_work.mpi_op`` now, the engine's kernel (a NaN wins, -0.0 below +0.0).

A call's time is its block's over the calls, the slowest rank's. Printed per size: the median over
the rounds of each, and the two user ops against the built-in op and against each other.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy loads its BLAS

import numpy as np  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,16777216", help="message sizes in bytes, comma separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--op", default="min", choices=["min", "max"])
    args = parser.parse_args()

    from mpi4py import MPI

    from axonhpc.backends.base import ReduceOp
    from axonhpc.backends.mpi_work import mpi_datatype, mpi_op

    comm = MPI.COMM_WORLD
    dtype = np.dtype(args.dtype)
    op = ReduceOp.MIN if args.op == "min" else ReduceOp.MAX
    ufunc = np.minimum if op is ReduceOp.MIN else np.maximum

    def numpy_op(inbuf, inoutbuf, datatype):
        acc = np.frombuffer(inoutbuf, dtype)
        ufunc(np.frombuffer(inbuf, dtype), acc, out=acc)

    ops = {"built-in": MPI.MIN if op is ReduceOp.MIN else MPI.MAX,
           "np." + ufunc.__name__: MPI.Op.Create(numpy_op, commute=True),
           "IEEE": mpi_op(op, dtype)}
    names = list(ops)
    rng = np.random.default_rng(comm.rank)
    if comm.rank == 0:
        print(f"# {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# MPI_Allreduce {op.name} of {dtype}, {comm.size} ranks, medians of {args.rounds} interleaved rounds")
        print(f"{'bytes':>10} " + " ".join(f"{n:>12}" for n in names) + f" {'np/built-in':>12} {'IEEE/built-in':>14}"
              f" {'IEEE/np':>8}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        n = nbytes // dtype.itemsize
        data = rng.standard_normal(n).astype(dtype)
        buf = data.copy()
        spec = [buf, mpi_datatype(dtype)]
        calls = max(3, min(2000, (1 << 24) // max(nbytes, 1)))  # about 16 MiB moved per block
        samples = {name: [] for name in names}

        def block(name: str) -> float:
            mop = ops[name]
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                comm.Allreduce(MPI.IN_PLACE, spec, mop)
            return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)

        for name in names:  # warm up: first-touch pages, the ops' first calls
            block(name)
        for k in range(args.rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                buf[...] = data
                samples[name].append(block(name))
        if comm.rank == 0:
            med = {name: statistics.median(v) for name, v in samples.items()}
            unit, scale = ("us", 1e6) if med["built-in"] < 1e-3 else ("ms", 1e3)
            np_name = names[1]
            print(f"{nbytes:>10} " + " ".join(f"{med[name] * scale:>9.2f} {unit}" for name in names)
                  + f" {med[np_name] / med['built-in']:>12.2f} {med['IEEE'] / med['built-in']:>14.2f}"
                  f" {med['IEEE'] / med[np_name]:>8.2f}")
            sys.stdout.flush()
    for name in names[1:2]:
        ops[name].Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
