"""How long a checkpoint stalls training: a synchronous save against one written in the background.

    python benchmarks/checkpoint_stall.py [--sizes 1024,2048,2048,1024] [--batch 64] [--rounds 7] [--dir DIR]
    mpiexec -n 2 python benchmarks/checkpoint_stall.py

A DDP-wrapped float32 MLP trained with Adam (the default: 8.4 M parameters,
about 100 MiB of parameters and Adam moments per rank) runs rounds of
ordinary steps, one step followed by a synchronous ``save_per_rank`` of the
model's and the optimizer's ``state_dict()``, and one step followed by
``AsyncCheckpointer.save_per_rank`` of the same (what
``DistributedTrainer(async_checkpoints=True)`` does), after which training
goes on with a ``poll`` after every step until the background save is in
place. Rounds alternate which save comes first. Each step is timed on every
rank and counted as its slowest rank's time. BLAS is pinned to one thread,
so the writer thread competes for the cores as it would beside a real job.

Printed: the medians of an ordinary step, of the step with each save, the
stall (save step minus ordinary step) and the ratio of the stalls, the steps
taken while the background save was written (and their median time: the
writer thread competes for the cores), any time the final ``wait`` still had
to block, the ``state_dict()`` copies alone (the floor of any save's stall),
and the whole time a background save costs the run (its stall, the slower
steps beside the writer, the wait).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy loads its BLAS

import numpy as np  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,2048,1024", help="MLP layer widths")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--gap", type=int, default=6, help="ordinary steps between saves")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (one sync and one async save each)")
    parser.add_argument("--max-steps-while-writing", type=int, default=200,
                        help="steps to train while a background save is written before waiting for it")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a fresh directory in /tmp)")
    parser.add_argument("--json", action="store_true", help="print one JSON line of the medians too")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    import axonhpc as ax
    from axonhpc.bench.ddp import make_mlp, parse_sizes
    from axonhpc.bench.timing import pin_blas_threads
    from axonhpc.checkpoint import save_per_rank
    from axonhpc.checkpoint.background import AsyncCheckpointer
    from axonhpc.nn import CrossEntropyLoss
    from axonhpc.optim import Adam

    limiter = pin_blas_threads(1)  # noqa: F841 - keeps the limit in force
    world = ax.init()
    comm = MPI.COMM_WORLD
    sizes = parse_sizes(args.sizes)
    model = ax.DDP(make_mlp(sizes))
    opt = Adam(model.parameters(), lr=1e-4)
    loss_fn = CrossEntropyLoss()
    rng = np.random.default_rng(1234 + world.rank)
    x = rng.standard_normal((args.batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], args.batch)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()

    def state() -> dict:
        return {"model": model.module.state_dict(), "optimizer": opt.state_dict()}

    made = args.dir is None
    root = comm.bcast(tempfile.mkdtemp(prefix="axonhpc-stall-") if world.rank == 0 and made else args.dir, root=0)
    saver = AsyncCheckpointer()
    counter = [0]

    def next_path() -> str:
        counter[0] += 1
        return os.path.join(root, f"ckpt-{counter[0]:06d}")

    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)  # the job waits for its slowest rank

    samples: Dict[str, List[float]] = {"ordinary": [], "sync": [], "async": [], "while writing": [], "wait": [],
                                       "copy": []}
    steps_while_writing: List[int] = []

    def ordinary(n: int) -> None:
        for _ in range(n):
            samples["ordinary"].append(timed(step))

    def sync_save() -> None:
        path = next_path()
        samples["sync"].append(timed(lambda: (step(), save_per_rank(path, state(), extra={"step": counter[0]}))))

    def async_save() -> None:
        path = next_path()
        samples["async"].append(timed(lambda: (step(), saver.save_per_rank(path, state(), extra={"step": counter[0]},
                                                                           copy=False))))
        taken = 0
        while saver.pending is not None and taken < args.max_steps_while_writing:
            samples["while writing"].append(timed(lambda: (step(), saver.poll())))
            taken += 1
        steps_while_writing.append(taken)
        samples["wait"].append(timed(saver.wait))

    for _ in range(3):
        step()  # warm up: first touches, BLAS setup
    sync_save()  # and one save of each kind, not counted
    async_save()
    for key in samples:
        samples[key].clear()
    steps_while_writing.clear()
    for k in range(args.rounds):
        saves = [sync_save, async_save] if k % 2 == 0 else [async_save, sync_save]
        for save in saves:
            ordinary(args.gap)
            save()
        samples["copy"].append(timed(state))  # the state_dict() copies alone, which every save makes
        comm.barrier()
        if world.rank == 0:  # keep the disk from filling; outside every timed section
            for name in sorted(os.listdir(root)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        comm.barrier()
    saver.close()
    if world.rank == 0 and made:
        shutil.rmtree(root, ignore_errors=True)

    if world.rank == 0:
        report(samples, steps_while_writing, world.world_size, model, opt, args)
    return 0


def report(samples: Dict[str, List[float]], steps_while_writing: List[int], ranks: int, model, opt, args) -> None:
    med = {k: statistics.median(v) if v else float("nan") for k, v in samples.items()}
    numel = sum(p.data.size for p in model.parameters())
    state_bytes = numel * 4 + sum(v.nbytes for entry in opt.state for v in entry.values() if hasattr(v, "nbytes"))
    stall_sync, stall_async = med["sync"] - med["ordinary"], med["async"] - med["ordinary"]
    ms = lambda s: f"{s * 1e3:8.1f} ms"  # noqa: E731
    print(f"checkpoint stall: {ranks} rank(s), MLP {args.sizes} ({numel / 1e6:.1f} M parameters, "
          f"{state_bytes / 2**20:.0f} MiB with the Adam moments per rank), batch {args.batch}, BLAS 1 thread, "
          f"{args.rounds} saves of each kind")
    print(f"  ordinary step                   {ms(med['ordinary'])}")
    print(f"  step + synchronous save         {ms(med['sync'])}   stall {ms(stall_sync)}")
    print(f"  step + background save started  {ms(med['async'])}   stall {ms(stall_async)}")
    print(f"  steps while it was written      {ms(med['while writing'])}   median of "
          f"{statistics.median(steps_while_writing) if steps_while_writing else 0:g} steps per save")
    print(f"  wait left at the end            {ms(med['wait'])}")
    print(f"  state_dict() copies alone       {ms(med['copy'])}")
    ratio = stall_sync / stall_async if stall_async > 0 else float("inf")
    print(f"  stall ratio sync / background   {ratio:8.1f} x")
    steps = statistics.median(steps_while_writing) if steps_while_writing else 0
    lost = stall_async + steps * (med["while writing"] - med["ordinary"]) + med["wait"]
    print(f"  time lost per background save   {ms(lost)}   (the stall, the slower steps beside the writer, "
          f"the wait), against {ms(stall_sync)} for a synchronous one")
    if args.json:
        print(json.dumps({"ranks": ranks, "ordinary_ms": med["ordinary"] * 1e3, "sync_ms": med["sync"] * 1e3,
                          "async_ms": med["async"] * 1e3, "while_writing_ms": med["while writing"] * 1e3,
                          "steps_while_writing": statistics.median(steps_while_writing) if steps_while_writing else 0,
                          "wait_ms": med["wait"] * 1e3, "copy_ms": med["copy"] * 1e3, "stall_ratio": ratio,
                          "lost_async_ms": lost * 1e3, "state_mib": state_bytes / 2**20}))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
