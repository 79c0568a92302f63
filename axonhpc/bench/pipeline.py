"""``axonhpc bench pipeline``: pipeline schedules on 2 and 4 ranks, measured bubble beside the formula.

Run it *without* mpiexec: the driver launches ``mpiexec -n 2`` and ``-n 4`` workers with BLAS and
OpenMP pinned to one thread per rank.

[Note: what one worker job measures]
One job runs ``P * layers_per_rank`` blocks of ``Linear + Tanh`` under GPipe and 1F1B (one stage
per rank) and, where ``m % P == 0`` and ``layers_per_rank`` is even, interleaved 1F1B with v = 2.
Every stage costs the same, as the formulas assume: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1). A
step's time is the maximum over ranks after an untimed barrier; its measured bubble is idle over
total rank-time in the gathered timelines (``timeline_bubble``), which also counts message latency
and Python overhead, so it sits above the formula. A job reports medians.

[Note: the pipeline's baselines]
Two baselines run in the same job, timed the same way (maximum over ranks, median over steps):
- ``raw``: GPipe written directly on mpi4py, the least a pipeline can do: the same stage modules
  (one per rank), blocking ``Send``/``Recv`` of each micro-batch's activation and gradient, every
  forward and then every backward, no schedule tables, no checks. ``ours/raw`` is what the
  ``Pipeline`` machinery costs on top (1F1B and interleaved are compared with it too: same work).
- ``one_rank``: the whole model (every stage in turn) on rank 0 alone, over the same m micro-batches,
  while the others wait: what the pipeline should beat. ``one_rank/ours`` is the speedup, at most P.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import List, Optional, Sequence

import numpy as np

from .jobs import check_counts, drive, parse_counts, run_worker_job, write_result
from .timing import pin_blas_threads

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved"}
COLUMNS = ("schedule", "ranks", "m", "v", "step_ms", "bubble", "formula", "ours/raw", "speedup")


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of equal stages: (p-1)/(v*m+p-1) (v = 1: GPipe and 1F1B)."""
    return (p - 1) / (v * m + p - 1)


def configurations(p: int, m: int, layers_per_rank: int) -> List[tuple]:
    """(schedule, v) pairs that apply to ``p`` ranks: interleaving needs m % p == 0 and an even layer count."""
    configs = [("gpipe", 1), ("1f1b", 1)]
    if m % p == 0 and layers_per_rank % 2 == 0:
        configs.append(("interleaved_1f1b", 2))
    return configs


def parse_ranks(text: str) -> List[int]:
    """"2,4" -> [2, 4] (each at least 2)."""
    return parse_counts(text, "--ranks", "rank counts", least=2)


# -- worker (runs under mpiexec) ---------------------------------------------------------------
def _blocks(width: int, count: int, first_seed: int) -> list:
    """``count`` blocks of Linear(width, width) + Tanh, float64, seeded from ``first_seed`` on."""
    from ..nn import Linear, Tanh

    return [layer for k in range(count)
            for layer in (Linear(width, width, dtype=np.float64, seed=first_seed + k), Tanh())]


def _raw_gpipe_step(comm, stage, loss_fn, xs: list, ys: list) -> None:
    """One GPipe step on raw mpi4py: every forward (Recv, stage, Send), then every backward in reverse.

    The baseline's whole pipeline ([Note: the pipeline's baselines]): ``stage`` is this rank's module,
    the last rank takes the loss's gradient at once, each micro-batch's activations are stashed.
    """
    rank, p, m = comm.Get_rank(), comm.Get_size(), len(xs)
    stash = []
    for i in range(m):
        x = xs[i]
        if rank > 0:
            x = np.empty_like(xs[i])
            comm.Recv(x, source=rank - 1, tag=i)
        out = stage(x)
        seed = None
        if rank == p - 1:
            loss_fn(out, ys[i])
            seed = loss_fn.backward(1.0 / m)
        else:
            comm.Send(out, dest=rank + 1, tag=i)
        stash.append((stage.stash_activations(), seed))
    for i in reversed(range(m)):
        caches, grad = stash.pop()
        if grad is None:
            grad = np.empty_like(xs[i])
            comm.Recv(grad, source=rank + 1, tag=m + i)
        stage.restore_activations(caches)
        grad_in = stage.backward(grad, input_grad=rank > 0)
        if rank > 0:
            comm.Send(np.ascontiguousarray(grad_in), dest=rank - 1, tag=m + i)


def _one_rank_step(model, loss_fn, xs: list, ys: list) -> None:
    """The whole model over every micro-batch on one rank: forward, loss, backward (gradients accumulate)."""
    for x, y in zip(xs, ys):
        loss_fn(model(x), y)
        model.backward(loss_fn.backward(1.0 / len(xs)), input_grad=False)


def _timed_steps(comm, step, args) -> float:
    """Median over ``args.steps`` (after ``args.warmup``) of one call of ``step``, the slowest rank's time."""
    from mpi4py import MPI

    times = []
    for k in range(args.warmup + args.steps):
        comm.Barrier()
        start = MPI.Wtime()
        step()
        took = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
        if k >= args.warmup:
            times.append(took)
    return statistics.median(times)


def _baselines(world, args, x, y) -> dict:
    """The raw mpi4py GPipe and the one-rank run of the same model, in ms ([Note: the pipeline's baselines])."""
    from mpi4py import MPI

    from ..nn import MSELoss, Sequential

    p, rank, m = world.world_size, world.rank, args.microbatches
    comm = MPI.COMM_WORLD.Dup()
    try:
        xs, ys = np.split(x, m), np.split(y, m)
        blocks = args.layers_per_rank
        stage = Sequential(*_blocks(args.width, blocks, rank * blocks))
        raw = _timed_steps(comm, lambda: _raw_gpipe_step(comm, stage, MSELoss(), xs, ys), args)
        whole = Sequential(*_blocks(args.width, p * blocks, 0))
        one_rank = _timed_steps(comm, lambda: _one_rank_step(whole, MSELoss(), xs, ys) if rank == 0 else None, args)
    finally:
        comm.Free()
    return {"raw_ms": raw * 1e3, "one_rank_ms": one_rank * 1e3}


def _worker(args) -> Optional[dict]:
    from ..backends import ReduceOp
    from ..collectives import all_reduce, barrier
    from ..groups import init
    from ..nn import MSELoss, Sequential
    from ..parallel import Pipeline, gather_timelines, timeline_bubble

    limiter = pin_blas_threads(1)  # noqa: F841 - keeps the limit in force
    world = init()
    p, rank = world.world_size, world.rank
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((args.batch, args.width))
    y = rng.standard_normal((args.batch, args.width))
    result = {"world_size": p, "configs": []}
    for schedule, v in configurations(p, args.microbatches, args.layers_per_rank):
        blocks = args.layers_per_rank // v
        stages = [Sequential(*_blocks(args.width, blocks, s * blocks)) for s in range(p * v)]
        pipe = Pipeline.from_modules(stages, num_microbatches=args.microbatches, schedule=schedule,
                                     loss_fn=MSELoss(), stages_per_rank=v)
        times: List[float] = []
        bubbles: List[float] = []
        for k in range(args.warmup + args.steps):
            barrier()
            pipe.train_step(x, y)  # gradients accumulate: harmless, nothing is updated
            step = np.array([pipe.last_step_stats["step_time"]], dtype=np.float64)
            all_reduce(step, ReduceOp.MAX)
            gathered = gather_timelines(pipe)
            if k >= args.warmup:
                times.append(float(step[0]))
                if gathered is not None:
                    bubbles.append(timeline_bubble(gathered))
        if rank == 0:
            result["configs"].append({
                "schedule": schedule, "v": v, "m": args.microbatches,
                "step_ms": statistics.median(times) * 1e3, "bubble": statistics.median(bubbles),
                "formula": bubble_formula(p, args.microbatches, v),
            })
    result.update(_baselines(world, args, x, y))
    return result if rank == 0 else None


def _run_worker(args) -> int:
    result = _worker(args)
    if result is not None:
        write_result(result, args.out)
    return 0


# -- driver ----------------------------------------------------------------------------------
def run_job(mpiexec: str, n: int, args, timeout: float) -> dict:
    """Run one worker job on ``n`` ranks and return rank 0's result.

    Raises:
        BenchError: the job failed, timed out or wrote no result.
    """
    worker_args = ["--worker", "--width", str(args.width), "--batch", str(args.batch),
                   "--microbatches", str(args.microbatches), "--layers-per-rank", str(args.layers_per_rank),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return run_worker_job(mpiexec, n, "axonhpc.bench.pipeline", worker_args, "job", timeout)


def format_table(jobs: Sequence[dict], args) -> str:
    """The table the driver prints: one row per (rank count, schedule)."""
    lines = [f"# pipeline schedules: {args.layers_per_rank} x (Linear({args.width},{args.width}) + Tanh) per rank, "
             f"float64, batch {args.batch}, m={args.microbatches} micro-batches, 1 BLAS thread per rank",
             f"# step_ms: median over {args.steps} steps after {args.warmup} warm-up (a step ends when its slowest "
             f"rank does); bubble: measured idle / total rank-time within the step (median);",
             "# formula: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1)",
             "# ours/raw: step_ms over GPipe written directly on mpi4py (same stages, blocking Send/Recv) in the same "
             "job; speedup: the same model on one rank over step_ms (at most the rank count)"]
    for job in jobs:
        lines.append(f"# {job['world_size']} ranks: raw mpi4py GPipe {job['raw_ms']:.3f} ms, one rank "
                     f"{job['one_rank_ms']:.3f} ms")
    lines.append(f"{'schedule':<12} {'ranks':>5} {'m':>4} {'v':>3} {'step_ms':>10} {'bubble':>8} {'formula':>8} "
                 f"{'ours/raw':>9} {'speedup':>8}")
    for job in jobs:
        for c in job["configs"]:
            lines.append(f"{LABELS[c['schedule']]:<12} {job['world_size']:>5} {c['m']:>4} {c['v']:>3} "
                         f"{c['step_ms']:>10.3f} {c['bubble']:>8.3f} {c['formula']:>8.3f} "
                         f"{c['step_ms'] / job['raw_ms']:>9.2f} {job['one_rank_ms'] / c['step_ms']:>8.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonhpc bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts, one mpiexec job each (default 2,4)")
    parser.add_argument("--width", type=int, default=256, help="width of every Linear layer (default 256)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches m per step (default 8)")
    parser.add_argument("--layers-per-rank", type=int, default=2,
                        help="Linear+Tanh blocks per rank (even: interleaved v=2 splits them in two; default 2)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule first")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one worker job may take")
    parser.add_argument("--json", default=None, help="also write every job's result to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as exc:
        parser.error(str(exc))
    check_counts(parser, args, ("width", "batch", "microbatches", "layers_per_rank", "steps"))
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    if args.worker:
        if not args.out:
            parser.error("--worker needs --out")
        return _run_worker(args)
    return drive("pipeline", lambda mpiexec: [run_job(mpiexec, n, args, args.timeout) for n in ranks],
                 lambda jobs: format_table(jobs, args), args.json)


if __name__ == "__main__":
    sys.exit(main())
