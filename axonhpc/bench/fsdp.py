"""``axonhpc bench fsdp``: step time, per-rank memory and communication of NO_SHARD, SHARD_GRAD_OP, FULL_SHARD.

Run it *without* mpiexec: one worker job per rank count (``--ranks 2,4``), BLAS pinned to one
thread per rank, ``--repeats`` times.

[Note: what one worker job measures]
The job trains one MLP (float32, Adam) under ``ax.DDP`` (the baseline) and FSDP with each strategy,
in rotating rounds; a step's time is the maximum over ranks after an untimed barrier, and the job
reports the median. Each configuration then reports its persistent bytes per rank (parameters,
gradients, optimizer state), the peak ``fsdp.memory_stats`` saw in one more step, and the bytes each
rank sends per step by a bandwidth-optimal algorithm for the collectives issued (DDP:
``2 (N - 1) / N`` of the gradients). The ZeRO paper's figures are 1x DDP for stage 2, 1.5x for stage 3.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Dict, List, Optional

import numpy as np

from .ddp import parameter_count, parse_sizes
from .jobs import check_counts, drive, run_worker_job, write_result
from .timing import median_times, pin_blas_threads

DEFAULT_SIZES = "256,1024,1024,1024,10"
CONFIGS = ("ddp", "no_shard", "shard_grad_op", "full_shard")
THEORY = {"ddp": 1.0, "no_shard": 1.0, "shard_grad_op": 1.0, "full_shard": 1.5}


def _worker(args) -> Optional[dict]:
    from .. import nn, optim
    from ..backends import ReduceOp
    from ..collectives import all_reduce, barrier
    from ..groups import init
    from ..parallel import DDP, FSDP

    _limiter = pin_blas_threads(1)  # noqa: F841 - kept alive for the job
    world = init()
    n, r = world.world_size, world.rank
    sizes = parse_sizes(args.sizes)
    rng = np.random.default_rng(r)
    x = rng.standard_normal((args.batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], args.batch)

    def mlp():
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b, seed=i))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    wrapped, optimizers = {}, {}
    for config in CONFIGS:
        model = mlp()
        wrapped[config] = DDP(model) if config == "ddp" else FSDP(model, sharding_strategy=config)
        optimizers[config] = optim.Adam(wrapped[config].parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def step(config: str) -> None:
        opt = optimizers[config]
        opt.zero_grad()
        loss_fn(wrapped[config](x), y)
        wrapped[config].backward(loss_fn.backward(), input_grad=False)
        opt.step()

    def slowest(elapsed: float) -> float:
        barrier()
        value = np.array([elapsed])
        all_reduce(value, ReduceOp.MAX)
        return float(value[0])

    for config in CONFIGS:
        for _ in range(args.warmup):
            step(config)
    times = median_times({c: (lambda c=c: step(c)) for c in CONFIGS}, iters=1, rounds=args.steps, sync=slowest)
    result = {"world_size": n, "configs": {}}
    for config in CONFIGS:
        w, opt = wrapped[config], optimizers[config]
        opt_bytes = sum(int(v.nbytes) for s in opt.state for v in s.values() if hasattr(v, "nbytes"))
        if config == "ddp":
            grads = sum(p.data.nbytes for p in w.parameters())
            persistent = 2 * grads + opt_bytes
            peak = persistent
            sent = 2.0 * grads * (n - 1) / n
        else:
            w.comm.reset()
            w.reset_peak_memory_stats()
            step(config)
            stats = w.memory_stats(opt)
            persistent = stats["params"] + stats["grads"] + stats["optimizer"]
            peak = stats["peak"]
            sent = w.comm.total_sent()
        result["configs"][config] = {"ms": times[config] * 1e3, "persistent": persistent, "peak": peak,
                                     "sent": sent}
    return result if r == 0 else None


def summarize(jobs: Dict[int, List[dict]]) -> List[dict]:
    """One row per (ranks, config): medians over repeats; ratios against DDP within each repeat."""
    rows = []
    for n, results in sorted(jobs.items()):
        for config in CONFIGS:
            per = [res["configs"][config] for res in results]
            ddp = [res["configs"]["ddp"] for res in results]
            rows.append({
                "ranks": n, "config": config,
                "ms": statistics.median(p["ms"] for p in per),
                "vs_ddp": statistics.median(p["ms"] / d["ms"] for p, d in zip(per, ddp)),
                "persistent_mib": per[-1]["persistent"] / 2**20,
                "peak_mib": per[-1]["peak"] / 2**20,
                "sent_mib": per[-1]["sent"] / 2**20,
                "comm_vs_ddp": per[-1]["sent"] / ddp[-1]["sent"] if ddp[-1]["sent"] else float("nan"),
            })
    return rows


def format_table(rows: List[dict], sizes: List[int], args) -> str:
    """The table the driver prints."""
    params = parameter_count(sizes)
    lines = [f"# FSDP: MLP {'-'.join(map(str, sizes))} ({params:,} float32 parameters), Adam, batch {args.batch} "
             f"per rank, 1 BLAS thread per rank",
             f"# ms/step: median over {args.steps} steps (a step ends when its slowest rank does), median of "
             f"{args.repeats} repeat(s); vs ddp = the same ratio within each repeat",
             "# memory per rank from the arrays held: persistent = params + grads + optimizer state; peak "
             "includes gathered units",
             "# comm = MiB each rank sends per step (bandwidth-optimal algorithms, for the collectives issued); "
             "theory = ZeRO paper's ratio to DDP",
             f"{'ranks':>5} {'config':<14} {'ms/step':>9} {'vs ddp':>7} {'persist MiB':>12} {'peak MiB':>9} "
             f"{'comm MiB':>9} {'comm/ddp':>9} {'theory':>7}"]
    for row in rows:
        lines.append(f"{row['ranks']:>5} {row['config']:<14} {row['ms']:>9.2f} {row['vs_ddp']:>7.2f} "
                     f"{row['persistent_mib']:>12.2f} {row['peak_mib']:>9.2f} {row['sent_mib']:>9.2f} "
                     f"{row['comm_vs_ddp']:>9.3f} {THEORY[row['config']]:>7.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonhpc bench fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"MLP layer widths (default {DEFAULT_SIZES})")
    parser.add_argument("--ranks", default="2,4", help="rank counts to run, comma-separated (default 2,4)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration per job")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per rank count; medians are reported")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one worker job may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
        ranks = [int(v) for v in args.ranks.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if any(n < 2 for n in ranks):
        parser.error(f"--ranks must all be at least 2 (sharding over one rank shards nothing), got {args.ranks}")
    check_counts(parser, args, ("batch", "steps", "repeats"))
    if args.worker:
        result = _worker(args)
        if result is not None:
            write_result(result, args.out)
        return 0
    worker_args = ["--worker", "--sizes", args.sizes, "--batch", str(args.batch), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]

    def run_jobs(mpiexec: str) -> Dict[int, List[dict]]:
        jobs: Dict[int, List[dict]] = {n: [] for n in ranks}
        for rep in range(args.repeats):
            for n in (ranks if rep % 2 == 0 else ranks[::-1]):
                jobs[n].append(run_worker_job(mpiexec, n, "axonhpc.bench.fsdp", worker_args, f"{n}-rank job",
                                              args.timeout))
        return jobs

    return drive("fsdp", run_jobs, lambda jobs: format_table(summarize(jobs), sizes, args))


if __name__ == "__main__":
    sys.exit(main())
