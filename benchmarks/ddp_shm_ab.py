"""DDP steps with the node's shared memory against the same steps through MPI, in one job.

    mpiexec -n 2 python benchmarks/ddp_shm_ab.py [--sizes 512,2048,2048,10] [--steps 30] [--rounds 5]

Two DDP copies of one MLP are built in the same job: one while shared memory
is on (its gradient buckets live in the window when they add up to at least
1 MiB, and every collective goes through shared memory), one while it is off
(private buckets, every collective through MPI). Rounds alternate between
them, and a third config, the same model without DDP, gives the compute time
of a step. Each step starts after a barrier and lasts until its slowest rank
ends. Printed: medians of the step, the backward and (SYNCHRONOUS) the
all-reduce pass, and the communication share of the step, (step - compute) /
step. Running both in one job, interleaved, keeps the noisy neighbours of a
shared machine from landing on one side only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,2048,2048,10", help="MLP layer widths")
    parser.add_argument("--batch", type=int, default=128, help="samples per rank")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per config per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    import axonhpc as ax
    from axonhpc.bench.ddp import make_mlp, parse_sizes
    from axonhpc.bench.timing import pin_blas_threads
    from axonhpc.bucketing import GradSyncStrategy
    from axonhpc.nn import CrossEntropyLoss
    from axonhpc.optim import SGD

    limiter = pin_blas_threads(1)  # noqa: F841 - keeps the limit in force
    world = ax.init()
    comm = MPI.COMM_WORLD
    sizes = parse_sizes(args.sizes)

    def build(mode: str):
        ax.settings.shm_collectives = mode
        return ax.DDP(make_mlp(sizes), strategy=GradSyncStrategy.SYNCHRONOUS, bucket_size_mb=25)

    models = {"shared memory": build("auto"), "MPI": build("off"), "compute": make_mlp(sizes)}
    modes = {"shared memory": "auto", "MPI": "off", "compute": "off"}
    opts = {name: SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    loss_fn = CrossEntropyLoss()
    rng = np.random.default_rng(1234 + world.rank)
    x = rng.standard_normal((args.batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], args.batch)
    samples: Dict[str, Dict[str, List[float]]] = {name: {"step": [], "backward": [], "sync": []} for name in models}

    def step(name: str, record: bool) -> None:
        model, opt = models[name], opts[name]
        comm.Barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if record:
            samples[name]["step"].append(elapsed)
            if name != "compute":
                samples[name]["backward"].append(model.last_step["backward_s"])
                samples[name]["sync"].append(model.last_step["final_wait_s"])

    names = list(models)
    for name in names:
        ax.settings.shm_collectives = modes[name]
        for _ in range(5):
            step(name, False)
    for k in range(args.rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            ax.settings.shm_collectives = modes[name]
            for _ in range(args.steps):
                step(name, True)
    if world.rank == 0:
        ms = {name: {key: statistics.median(v) * 1e3 for key, v in s.items() if v} for name, s in samples.items()}
        compute = ms["compute"]["step"]
        grads = sum(int(p.data.nbytes) for p in models["compute"].parameters())
        print(f"# DDP SYNCHRONOUS, MLP {args.sizes} ({grads / 2**20:.1f} MiB of float32 gradients), "
              f"batch {args.batch} per rank, {world.world_size} ranks; medians of {args.rounds} interleaved "
              f"rounds x {args.steps} steps")
        print(f"{'config':<15} {'step ms':>8} {'backward ms':>12} {'all-reduce pass ms':>19} {'comm share':>11}")
        print(f"{'compute':<15} {compute:>8.2f}")
        for name in ("MPI", "shared memory"):
            m = ms[name]
            print(f"{name:<15} {m['step']:>8.2f} {m['backward']:>12.2f} {m['sync']:>19.2f} "
                  f"{(m['step'] - compute) / m['step']:>10.1%}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
