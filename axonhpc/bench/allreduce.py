"""``axonhpc bench allreduce``: OSU-style all-reduce table against raw mpi4py.

Run under MPI (``mpiexec -n 2 axonhpc bench allreduce``). For each size (float32, in place) it times
``ax.all_reduce`` ("ours", through the node's shared memory when the ranks share a node; "MPI path"
with ``shm_collectives="off"``) and mpi4py's ``Allreduce(MPI.IN_PLACE, x)`` in interleaved rounds,
and prints medians, algorithm and bus bandwidth (algbw * 2(n-1)/n), the ratio raw/ours, and numpy
``copyto`` with every rank copying at once as the memory bound: a rank must read its message and
write its result, 2 x the message size, which is what one ``copyto`` moves, so "of bound" is the
``copyto`` time over ours. A second table compares 100 gradients of 1 KiB one by one with one fused
bucket (``GradientSynchronizer``).

- ``--collectives``: all-gather (size: the result), reduce-scatter (size: the input) and broadcast
  against raw mpi4py, both into buffers made once.
- ``--device gpu``: cupy arrays (``bench.allreduce_gpu``); exit status 2 without a CUDA device.
- ``--check-cost``: what the always-on agreement check adds, on the shared-memory and the MPI path.
- ``--straggler-cost``: the same for the straggler comparison.
- ``--algorithms native,ring,rhd,hierarchical``: each algorithm's median and ratio raw/algorithm.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends import ReduceOp
from ..collectives import all_reduce
from ..errors import InvalidArgumentError
from ..groups import init
from ..settings import ALGORITHMS, settings
from .jobs import check_counts, parse_counts
from .timing import empty_aligned_like, human_bytes, median_times, pin_blas_threads

DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def _iters_for(nbytes: int) -> int:
    return int(max(3, min(200, (64 << 20) // max(nbytes, 1) // 4)))


def _raw_world() -> Tuple[Any, Callable[[float], float]]:
    """``init()``, a private duplicate of COMM_WORLD for the raw mpi4py calls, and the job's time of one
    rank's elapsed time (the maximum over the ranks, after a barrier: every rank reports alike)."""
    from mpi4py import MPI

    init()
    raw = MPI.COMM_WORLD.Dup()

    def job_time(elapsed: float) -> float:
        raw.Barrier()
        return raw.allreduce(elapsed, op=MPI.MAX)

    return raw, job_time


def run_sizes(sizes: List[int], rounds: int, algorithms: Sequence[str] = ()) -> List[dict]:
    """Rows of the bandwidth table (every rank runs it; rank 0's rows are the job's).

    ``algorithms``: all-reduce algorithms timed as well (``row["algorithms"][name]``: median, us).
    """
    from mpi4py import MPI

    raw, job_time = _raw_world()
    n = raw.Get_size()
    rows = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        dst = empty_aligned_like(x)  # the bound: a copy glibc makes at full speed
        iters = _iters_for(nbytes)
        candidates = {
            "ours": lambda: all_reduce(x),
            "mpi_path": lambda: _with_settings(lambda: all_reduce(x), shm_collectives="off"),
            "raw": lambda: raw.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT]),
            "copy": lambda: np.copyto(dst, x),
        }
        for name in algorithms:
            candidates[f"algorithm:{name}"] = lambda name=name: all_reduce(x, algorithm=name)
        for _ in range(2):  # warm-up: first-touch pages, MPI's internal buffers (and the algorithms' channels)
            for name in ("ours", "mpi_path", "raw", *(f"algorithm:{a}" for a in algorithms)):
                candidates[name]()
        t = median_times(candidates, iters, rounds, sync=job_time)
        bus = 2 * (n - 1) / n if n > 1 else 1.0
        rows.append(dict(
            bytes=nbytes, iters=iters,
            ours_us=t["ours"] * 1e6, raw_us=t["raw"] * 1e6,
            ours_algbw=nbytes / t["ours"] / 1e9, raw_algbw=nbytes / t["raw"] / 1e9,
            ours_busbw=nbytes / t["ours"] / 1e9 * bus, raw_busbw=nbytes / t["raw"] / 1e9 * bus,
            ratio=t["raw"] / t["ours"], copy_gbs=nbytes / t["copy"] / 1e9,
            mpi_path_us=t["mpi_path"] * 1e6, of_bound=t["copy"] / t["ours"],
            algorithms={name: t[f"algorithm:{name}"] * 1e6 for name in algorithms},
        ))
    raw.Free()
    return rows


def run_collectives(sizes: List[int], rounds: int) -> List[dict]:
    """All-gather, reduce-scatter and broadcast of float32, ``ax`` against raw mpi4py (medians, us)."""
    from mpi4py import MPI

    from ..collectives import all_gather, broadcast, reduce_scatter

    raw, job_time = _raw_world()
    n = raw.Get_size()
    rows = []
    for nbytes in sizes:
        part = max(1, nbytes // 4 // n)
        piece = np.ones(part, dtype=np.float32)           # all-gather input: a 1/n part of the result
        gathered = np.empty(part * n, dtype=np.float32)   # both sides gather into a buffer made once
        ours = np.empty((n, part), dtype=np.float32)
        whole = np.ones(part * n, dtype=np.float32)       # reduce-scatter input, broadcast buffer
        block = np.empty(part, dtype=np.float32)
        candidates = {
            "all_gather": lambda: all_gather(piece, out=ours),
            "raw_all_gather": lambda: raw.Allgather([piece, MPI.FLOAT], [gathered, MPI.FLOAT]),
            "reduce_scatter": lambda: reduce_scatter(whole, out=block),
            "raw_reduce_scatter": lambda: raw.Reduce_scatter_block([whole, MPI.FLOAT], [block, MPI.FLOAT], MPI.SUM),
            "broadcast": lambda: broadcast(whole, 0),
            "raw_broadcast": lambda: raw.Bcast([whole, MPI.FLOAT], 0),
        }
        for fn in candidates.values():  # warm-up
            fn()
        t = median_times(candidates, _iters_for(nbytes), rounds, sync=job_time)
        rows.append(dict(bytes=part * n * 4, **{name: t[name] * 1e6 for name in candidates}))
    raw.Free()
    return rows


def format_collectives_table(rows: List[dict], n: int) -> str:
    """Each collective's median beside raw mpi4py's, with the ratio raw time / our time."""
    names = ("all_gather", "reduce_scatter", "broadcast")
    head = f"{'size':>10}" + "".join(f" {name + ' us':>17} {'raw us':>9} {'ratio':>6}" for name in names)
    lines = [f"# all_gather (size = result), reduce_scatter (size = input), broadcast; float32, {n} ranks, "
             f"medians (ratio = raw time / our time)", head]
    for r in rows:
        lines.append(f"{human_bytes(r['bytes']):>10}" + "".join(
            f" {r[name]:>17.1f} {r['raw_' + name]:>9.1f} {r['raw_' + name] / r[name]:>6.2f}" for name in names))
    return "\n".join(lines)


def _with_settings(call, **values):
    """``call()`` with the named settings fields changed for its length."""
    saved = {name: getattr(settings, name) for name in values}
    for name, value in values.items():
        setattr(settings, name, value)
    try:
        return call()
    finally:
        for name, value in saved.items():
            setattr(settings, name, value)


def run_setting_cost(sizes: List[int], rounds: int, name: str, off: Any, on: Any) -> List[dict]:
    """All-reduce with setting ``name`` at ``on`` and at ``off``, on the shared-memory and the MPI path (medians, us).

    A candidate changes the settings only when the one before it left others (a change makes the next
    call choose its route again); every rank runs them in the same order, so all change at the same call.
    """
    from mpi4py import MPI

    raw, job_time = _raw_world()
    saved = (settings.shm_collectives, getattr(settings, name))

    def configured(shm: str, value: Any):
        def call():
            if (settings.shm_collectives, getattr(settings, name)) != (shm, value):
                settings.shm_collectives = shm
                setattr(settings, name, value)
            all_reduce(x)
        return call

    rows = []
    try:
        for nbytes in sizes:
            x = np.ones(nbytes // 4, dtype=np.float32)
            candidates = {f"{path}_{state}": configured(shm, value)
                          for path, shm in (("shm", "auto"), ("mpi", "off"))
                          for state, value in (("off", off), ("on", on))}
            candidates["raw"] = lambda: raw.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT])
            for _ in range(2):
                for fn in candidates.values():
                    fn()
            t = median_times(candidates, _iters_for(nbytes), rounds, sync=job_time)
            rows.append(dict(bytes=nbytes, **{key: t[key] * 1e6 for key in candidates}))
    finally:
        settings.shm_collectives = saved[0]
        setattr(settings, name, saved[1])
    raw.Free()
    return rows


def format_cost_table(rows: List[dict], n: int, what: str) -> str:
    """A setting's cost: each path's time with it on and off, and the fraction it adds."""
    lines = [f"# all_reduce with {what} on and off, float32, in place, {n} ranks, medians "
             f"(added = on / off - 1)",
             f"{'size':>10} {'shm on us':>10} {'shm off us':>11} {'added':>7} {'MPI on us':>10} {'MPI off us':>11} "
             f"{'added':>7} {'raw us':>8}"]
    for r in rows:
        lines.append(f"{human_bytes(r['bytes']):>10} {r['shm_on']:>10.2f} {r['shm_off']:>11.2f} "
                     f"{r['shm_on'] / r['shm_off'] - 1:>7.1%} {r['mpi_on']:>10.2f} {r['mpi_off']:>11.2f} "
                     f"{r['mpi_on'] / r['mpi_off'] - 1:>7.1%} {r['raw']:>8.2f}")
    return "\n".join(lines)


def run_fusion(count: int, nbytes: int, rounds: int) -> dict:
    """100 small gradients: one all-reduce each, against one fused bucket."""
    from mpi4py import MPI

    from ..bucketing import GradientSynchronizer, GradSyncStrategy

    raw, job_time = _raw_world()
    world = init()
    grads = [np.full(nbytes // 4, world.rank + 1.0, dtype=np.float32) for _ in range(count)]
    sync = GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, bucket_size=25_000_000, group=world.default_group)

    def one_by_one():
        for g in grads:
            all_reduce(g, ReduceOp.AVG)

    def raw_one_by_one():
        for g in grads:
            raw.Allreduce(MPI.IN_PLACE, [g, MPI.FLOAT])

    for _ in range(3):
        one_by_one()
        sync.synchronize(grads)
    t = median_times({"one_by_one": one_by_one, "raw_one_by_one": raw_one_by_one,
                      "bucketed": lambda: sync.synchronize(grads)}, 20, rounds, sync=job_time)
    raw.Free()
    return dict(count=count, bytes=nbytes, one_by_one_us=t["one_by_one"] * 1e6,
                raw_one_by_one_us=t["raw_one_by_one"] * 1e6, bucketed_us=t["bucketed"] * 1e6,
                speedup=t["one_by_one"] / t["bucketed"])


def format_table(rows: List[dict], n: int) -> str:
    lines = [f"# all_reduce, float32, in place, {n} ranks, medians (ratio = raw time / our time; of bound = "
             f"copyto time / our time)",
             f"{'size':>10} {'ours us':>10} {'raw us':>10} {'MPI path us':>12} {'ours algbw':>13} {'raw algbw':>12} "
             f"{'ours busbw':>13} {'raw busbw':>12} {'ratio':>6} {'copyto GB/s':>12} {'of bound':>9}"]
    for r in rows:
        lines.append(f"{human_bytes(r['bytes']):>10} {r['ours_us']:>10.1f} {r['raw_us']:>10.1f} "
                     f"{r['mpi_path_us']:>12.1f} {r['ours_algbw']:>8.2f} GB/s {r['raw_algbw']:>7.2f} GB/s "
                     f"{r['ours_busbw']:>8.2f} GB/s {r['raw_busbw']:>7.2f} GB/s {r['ratio']:>6.2f} "
                     f"{r['copy_gbs']:>12.2f} {r['of_bound']:>8.0%}")
    return "\n".join(lines)


def format_algorithm_table(rows: List[dict], n: int) -> str:
    """Each algorithm's median time beside raw mpi4py, with the ratio raw time / algorithm time."""
    names: List[str] = list(rows[0]["algorithms"]) if rows else []
    head = f"{'size':>10} {'raw us':>10}" + "".join(f" {name + ' us':>16} {'x raw':>6}" for name in names)
    lines = [f"# all_reduce algorithms, float32, in place, {n} ranks, medians (x raw = raw time / its time)", head]
    for r in rows:
        times: Dict[str, float] = r["algorithms"]
        lines.append(f"{human_bytes(r['bytes']):>10} {r['raw_us']:>10.1f}"
                     + "".join(f" {times[name]:>16.1f} {r['raw_us'] / times[name]:>6.2f}" for name in names))
    return "\n".join(lines)


def parse_algorithms(text: Optional[str]) -> List[str]:
    """The names of ``--algorithms``, checked against the known algorithms.

    Raises:
        ValueError: an unknown or repeated name.
    """
    if not text:
        return []
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALGORITHMS]
    if unknown:
        raise InvalidArgumentError(f"unknown all-reduce algorithm(s) {unknown}; use some of {', '.join(ALGORITHMS)}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"--algorithms repeats a name: {names}")
    return names


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="axonhpc bench allreduce", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None,
                        help="comma-separated sizes in bytes (default 4 KiB .. 256 MiB in steps of 4x)")
    parser.add_argument("--max-size", type=int, default=None, help="drop default sizes above this many bytes")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    parser.add_argument("--no-fusion", action="store_true", help="skip the 100 x 1 KiB fusion table")
    parser.add_argument("--collectives", action="store_true",
                        help="also time all-gather, reduce-scatter and broadcast against raw mpi4py")
    parser.add_argument("--check-cost", action="store_true",
                        help="also time the all-reduce with the agreement check on and off (shared memory and MPI)")
    parser.add_argument("--straggler-cost", action="store_true",
                        help="also time the all-reduce with the straggler comparison (straggler_every) on and off")
    parser.add_argument("--algorithms", default=None,
                        help=f"comma-separated all-reduce algorithms to time beside raw mpi4py, e.g. "
                             f"native,ring,rhd,hierarchical (known: {', '.join(ALGORITHMS)})")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: numpy arrays against raw mpi4py (default); gpu: cupy arrays, NCCL against "
                             "CUDA-aware and staged MPI (needs a CUDA device)")
    args = parser.parse_args(argv)
    check_counts(parser, args, ("rounds", "max_size") if args.max_size is not None else ("rounds",), ())
    try:
        algorithms = parse_algorithms(args.algorithms)
        sizes = parse_counts(args.sizes, "--sizes", "sizes in bytes") if args.sizes else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "gpu" and algorithms:
        parser.error("--algorithms times numpy arrays; it does not combine with --device gpu")
    from . import allreduce_gpu

    sizes = sizes or list(allreduce_gpu.DEFAULT_SIZES if args.device == "gpu" else DEFAULT_SIZES)
    if args.max_size:
        kept = [s for s in sizes if s <= args.max_size]
        if not kept:
            parser.error(f"--max-size {args.max_size} drops every size ({', '.join(map(str, sizes))})")
        sizes = kept
    limiter = pin_blas_threads(1)  # noqa: F841 - keeps the limit in force
    if args.device == "gpu":
        return allreduce_gpu.main(sizes, args.rounds)
    world = init()
    rows = run_sizes(sizes, args.rounds, algorithms)
    fusion = None if args.no_fusion else run_fusion(100, 1024, args.rounds)
    others = run_collectives(sizes, args.rounds) if args.collectives else None
    checks = run_setting_cost(sizes, args.rounds, "check_collectives", False, True) if args.check_cost else None
    every = settings.straggler_every or 1000
    arrivals = (run_setting_cost(sizes, args.rounds, "straggler_every", 0, every) if args.straggler_cost
                else None)
    if world.rank == 0:
        print(format_table(rows, world.world_size))
        if others:
            print()
            print(format_collectives_table(others, world.world_size))
        if checks:
            print()
            print(format_cost_table(checks, world.world_size, "the agreement check"))
        if arrivals:
            print()
            print(format_cost_table(arrivals, world.world_size, f"the straggler comparison (straggler_every={every})"))
        if algorithms:
            print()
            print(format_algorithm_table(rows, world.world_size))
        if fusion:
            print(f"\n# {fusion['count']} gradients of {human_bytes(fusion['bytes'])}, averaged, medians")
            print(f"one by one (ax.all_reduce):      {fusion['one_by_one_us']:9.1f} us")
            print(f"one by one (raw mpi4py):         {fusion['raw_one_by_one_us']:9.1f} us")
            print(f"GradientSynchronizer (1 bucket): {fusion['bucketed_us']:9.1f} us")
            print(f"speed-up of bucketing over one by one: {fusion['speedup']:.1f}x")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
