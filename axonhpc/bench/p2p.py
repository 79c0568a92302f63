"""``axonhpc bench p2p``: OSU-style ping-pong latency of ``ax.send``/``ax.recv`` against raw mpi4py.

Run under MPI (``mpiexec -n 2 axonhpc bench p2p``). Ranks 0 and 1 bounce a float64 message of each size
(the others wait at a barrier) and each round trip counts as two messages. Four candidates run in
interleaved rounds: blocking ``send``/``recv`` (their fast path, [Note: the fast path of send and recv]),
``isend``/``irecv`` waited at once (the general path), and mpi4py's ``Send``/``Recv`` and ``Isend``/``Irecv``
on a private duplicate of COMM_WORLD. Medians, microseconds per message; ratio = raw time / our time.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..collectives import irecv, isend, recv, send
from .allreduce import _raw_world
from .jobs import check_counts, parse_counts
from .timing import human_bytes, median_times, pin_blas_threads

DEFAULT_SIZES = [8, 1 << 10, 16 << 10, 256 << 10, 4 << 20]


def _iters_for(nbytes: int) -> int:
    return int(max(5, min(2000, (64 << 20) // max(nbytes, 1) // 16)))


def round_trips(rank: int, raw: Any, x: np.ndarray, y: np.ndarray) -> Dict[str, Callable[[], None]]:
    """One round trip of each candidate, as rank 0 and rank 1 make it (nothing on the other ranks)."""
    from mpi4py import MPI

    T = MPI.DOUBLE
    if rank > 1:
        return {name: (lambda: None) for name in ("send_recv", "isend_irecv", "raw_send_recv", "raw_isend_irecv")}
    peer = 1 - rank

    def ours(send_first: bool):
        def go():
            if send_first:
                send(x, peer)
                recv(y, peer)
            else:
                recv(y, peer)
                send(x, peer)
        return go

    def ours_async(send_first: bool):
        def go():
            if send_first:
                isend(x, peer).wait()
                irecv(y, peer).wait()
            else:
                irecv(y, peer).wait()
                isend(x, peer).wait()
        return go

    def raw_blocking(send_first: bool):
        def go():
            if send_first:
                raw.Send([x, T], peer, 0)
                raw.Recv([y, T], peer, 0)
            else:
                raw.Recv([y, T], peer, 0)
                raw.Send([x, T], peer, 0)
        return go

    def raw_async(send_first: bool):
        def go():
            if send_first:
                raw.Isend([x, T], peer, 0).Wait()
                raw.Irecv([y, T], peer, 0).Wait()
            else:
                raw.Irecv([y, T], peer, 0).Wait()
                raw.Isend([x, T], peer, 0).Wait()
        return go

    first = rank == 0
    return {"send_recv": ours(first), "isend_irecv": ours_async(first),
            "raw_send_recv": raw_blocking(first), "raw_isend_irecv": raw_async(first)}


def run_sizes(sizes: List[int], rounds: int) -> List[dict]:
    """Rows of the latency table (every rank runs it; rank 0's rows are the job's): us per message."""
    raw, job_time = _raw_world()
    rank = raw.Get_rank()
    rows = []
    for nbytes in sizes:
        x = np.full(max(1, nbytes // 8), float(rank))
        y = np.empty_like(x)
        candidates = round_trips(rank, raw, x, y)
        for fn in candidates.values():  # warm-up
            fn()
        t = median_times(candidates, _iters_for(nbytes), rounds, sync=job_time)
        rows.append(dict(bytes=x.nbytes, **{name: t[name] * 1e6 / 2 for name in candidates}))  # 2 per trip
    raw.Free()
    return rows


def format_table(rows: List[dict]) -> str:
    """Each path's median beside raw mpi4py's, with the ratio raw time / our time."""
    lines = ["# ping-pong between ranks 0 and 1, float64, us per message (half a round trip), medians "
             "(ratio = raw time / our time)",
             f"{'size':>10} {'send/recv':>10} {'raw':>7} {'ratio':>6} {'isend/irecv':>12} {'raw':>7} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{human_bytes(r['bytes']):>10} {r['send_recv']:>10.1f} {r['raw_send_recv']:>7.1f} "
                     f"{r['raw_send_recv'] / r['send_recv']:>6.2f} {r['isend_irecv']:>12.1f} "
                     f"{r['raw_isend_irecv']:>7.1f} {r['raw_isend_irecv'] / r['isend_irecv']:>6.2f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="axonhpc bench p2p", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated sizes in bytes (default 8 B .. 4 MiB)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    args = parser.parse_args(argv)
    check_counts(parser, args, ("rounds",), ())
    try:
        sizes = parse_counts(args.sizes, "--sizes", "sizes in bytes") if args.sizes else list(DEFAULT_SIZES)
    except ValueError as exc:
        parser.error(str(exc))
    limiter = pin_blas_threads(1)  # noqa: F841 - keeps the limit in force
    from ..groups import init

    world = init()
    if world.world_size < 2:
        print("axonhpc bench p2p needs 2 ranks or more: mpiexec -n 2 axonhpc bench p2p", file=sys.stderr)
        return 2
    rows = run_sizes(sizes, args.rounds)
    if world.rank == 0:
        print(format_table(rows))
        sys.stdout.flush()
    return 0


__all__ = ["run_sizes", "format_table", "round_trips", "main"]


if __name__ == "__main__":
    sys.exit(main())
