"""``axonhpc bench allreduce --device gpu``: NCCL against CUDA-aware MPI against staged MPI on cupy arrays.

UNTESTED ON A GPU: no device was available where this was written. Without a CUDA device the command
refuses ("no CUDA device: ...") with exit status 2, which is tested.

For each size (float32, in place, one GPU per rank) it times in interleaved rounds:

- ``nccl``: ``NCCLBackend.all_reduce``;
- ``mpi-direct``: mpi4py's ``Allreduce`` on the device buffer, only when MPI is CUDA-aware (a device
  pointer would crash one that is not: n/a then);
- ``mpi-staged``: the whole array through pinned host buffers;
- ``pipelined``: ``ax.all_reduce`` when the world stages cupy arrays (``AXONHPC_BACKEND=mpi`` on a
  machine with NCCL), chunked above ``settings.staging_chunk_bytes``;

and the pipeline's stages alone: ``d2h``, ``host`` (``ax.all_reduce`` of a numpy array of that size)
and ``h2d``. The bound is the slowest stage (perfect overlap); bound / pipelined should stay at 0.8 or
above from 64 MiB. It prints medians, bus bandwidth (algbw * 2(n-1)/n) and staged/NCCL.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional

import numpy as np

from ..backends.devices import DeviceFacts, device_facts
from .timing import human_bytes, median_times

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
PATHS = ("nccl", "mpi-direct", "mpi-staged", "pipelined")
STAGES = ("d2h", "host", "h2d")  # the pipeline's stages, timed alone


def refusal(facts: DeviceFacts) -> Optional[str]:
    """Why this benchmark cannot run here ("no CUDA device: ..."), or None."""
    if facts.cupy is None or facts.devices < 1:
        why = "; ".join(facts.problems) or "cupy sees no CUDA device"
        return f"no CUDA device: {why}"
    return None


def bus_factor(n: int) -> float:
    """Bus bandwidth per algorithm bandwidth of an all-reduce on n ranks: 2(n-1)/n (1 on one rank)."""
    return 2 * (n - 1) / n if n > 1 else 1.0


def row(nbytes: int, n: int, seconds: Dict[str, Optional[float]]) -> dict:
    """One table row: median microseconds and bus GB/s per path (None for a path that did not run)."""
    out: dict = {"bytes": nbytes}
    for path in PATHS:
        t = seconds.get(path)
        out[f"{path}_us"] = None if t is None else t * 1e6
        out[f"{path}_busbw"] = None if t is None else nbytes / t / 1e9 * bus_factor(n)
    t_nccl, t_staged = seconds.get("nccl"), seconds.get("mpi-staged")
    out["staged_over_nccl"] = None if not (t_nccl and t_staged) else t_staged / t_nccl
    stages = [seconds.get(k) for k in STAGES]
    known = all(t is not None for t in stages)
    out["bound_us"] = max(stages) * 1e6 if known else None
    out["serial_us"] = sum(stages) * 1e6 if known else None
    t_pipe = seconds.get("pipelined")
    out["bound_over_pipelined"] = None if not (known and t_pipe) else max(stages) / t_pipe
    return out


def format_table(rows: List[dict], n: int, notes: List[str]) -> str:
    """The table `main` prints (n/a where a path did not run)."""
    def cell(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    head = (f"{'size':>10}" + "".join(f" {p + ' us':>15} {p + ' busbw':>17}" for p in PATHS)
            + f" {'staged/nccl':>12} {'bound us':>10} {'serial us':>10} {'bound/pipelined':>16}")
    lines = [f"# all_reduce on cupy arrays, float32, in place, {n} ranks, medians; busbw in GB/s",
             "# bound: the slowest of the pipeline's stages (copy to host, host all-reduce, copy back) timed alone;"
             " serial: their sum", *notes, head]
    for r in rows:
        lines.append(f"{human_bytes(r['bytes']):>10}" + "".join(
            f" {cell(r[p + '_us'], '.1f'):>15} {cell(r[p + '_busbw'], '.2f'):>17}" for p in PATHS)
            + f" {cell(r['staged_over_nccl'], '.2f'):>12} {cell(r['bound_us'], '.1f'):>10}"
            + f" {cell(r['serial_us'], '.1f'):>10} {cell(r['bound_over_pipelined'], '.2f'):>16}")
    return "\n".join(lines)


def run(sizes: List[int], rounds: int) -> tuple:
    """Rows of the table and notes on the paths that did not run (every rank runs it)."""
    import cupy
    from mpi4py import MPI

    from ..backends.base import ReduceOp
    from ..backends.cuda_aware import cuda_aware_mpi
    from ..backends.mpi import MPIBackend
    from ..backends.staging import cupy_staging, host_view, run_staged
    from ..collectives import all_reduce
    from ..groups import init

    world = init()
    n = world.world_size
    raw = MPI.COMM_WORLD.Dup()
    host = MPIBackend(MPI.COMM_WORLD)
    notes: List[str] = []
    nccl = None
    try:
        from ..backends.nccl import NCCLBackend

        nccl = NCCLBackend(MPIBackend(MPI.COMM_WORLD))
    except Exception as exc:  # noqa: BLE001 - that column reads n/a
        notes.append(f"# nccl: n/a ({type(exc).__name__}: {exc})")
    aware = cuda_aware_mpi()
    if not aware.aware:
        notes.append(f"# mpi-direct: n/a (MPI is not CUDA-aware: {aware.how})")
    staging = cupy_staging()
    group = world.default_group
    probe = cupy.ones(1, dtype=cupy.float32)
    pipelines = group.backend.stages(probe)
    if not pipelines:
        notes.append(f"# pipelined: n/a (the world's group does not stage cupy arrays: backend "
                     f"{group.backend.name}; run with AXONHPC_BACKEND=mpi where MPI is not CUDA-aware)")

    def job_time(elapsed: float) -> float:
        raw.Barrier()
        return raw.allreduce(elapsed, op=MPI.MAX)

    rows = []
    for nbytes in sizes:
        x = cupy.ones(nbytes // 4, dtype=cupy.float32)
        candidates: Dict[str, Callable[[], None]] = {
            "mpi-staged": lambda: run_staged(lambda *h: host.all_reduce(*h), (x, ReduceOp.SUM, False), (0,), (0,),
                                             staging).wait(),
        }
        if nccl is not None:
            def through_nccl():
                nccl.all_reduce(x, ReduceOp.SUM, False)  # orders this stream after it; the host waits here
                cupy.cuda.get_current_stream().synchronize()

            candidates["nccl"] = through_nccl
        raw_host = staging.buffers.lease(nbytes)
        pinned = host_view(raw_host, x.shape, x.dtype)
        plain = np.ones(x.shape, dtype=np.float32)

        def h2d():
            x.set(pinned)
            cupy.cuda.get_current_stream().synchronize()

        candidates.update({
            "d2h": lambda: x.get(out=pinned),
            "host": lambda: all_reduce(plain, group=group),
            "h2d": h2d,
        })
        if pipelines:
            candidates["pipelined"] = lambda: all_reduce(x, group=group)
        if aware.aware:
            def direct():
                cupy.cuda.get_current_stream().synchronize()
                raw.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

            candidates["mpi-direct"] = direct
        for fn in candidates.values():  # warm-up: communicators, pinned buffers
            fn()
        iters = int(max(3, min(100, (64 << 20) // max(nbytes, 1) // 4)))
        t = median_times(candidates, iters, rounds, sync=job_time)
        staging.buffers.release(raw_host)
        rows.append(row(nbytes, n, t))
    raw.Free()
    return rows, notes


def main(sizes: Optional[List[int]] = None, rounds: int = 7, facts: Optional[DeviceFacts] = None) -> int:
    """Run the GPU table (``axonhpc bench allreduce --device gpu``); 2 with a message when there is no device.

    ``facts``: the device facts (looked up when None).
    """
    why = refusal(device_facts() if facts is None else facts)
    if why is not None:
        print(f"axonhpc bench allreduce --device gpu: {why}", file=sys.stderr)
        return 2
    from ..groups import init

    world = init()
    rows, notes = run(list(sizes or DEFAULT_SIZES), rounds)
    if world.rank == 0:
        print(format_table(rows, world.world_size, notes))
        sys.stdout.flush()
    return 0


__all__ = ["main", "refusal", "row", "format_table", "bus_factor", "PATHS", "STAGES", "DEFAULT_SIZES"]
