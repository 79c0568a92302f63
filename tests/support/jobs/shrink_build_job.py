"""A ``DistributedTrainer(fault_tolerance="shrink")`` job whose rank may SIGKILL itself while the trainer is built.

    axonhpc launch --fault-tolerant -n 3 -- shrink_build_job.py --strategy fsdp --kill 1:broadcast

``--kill R:WHERE`` makes job rank R kill itself for real (SIGKILL) as the strategy is being built, the other
ranks then waiting in that collective: ``compare`` as the wrapper's model comparison starts (an all-gather),
``broadcast`` as the wrapper's broadcast of rank 0's parameters starts (after the comparison). Rank 0 prints
``final loss <repr>`` and the recoveries; with ``--checkpoint-dir`` a checkpoint is written each epoch and a
second run resumes from it (``--epochs`` then counts from the start).
"""
import argparse
import contextlib
import os
import signal
import sys
import time

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim

POINTS = ("compare", "broadcast")


def _arm(rank: int, where: str) -> None:
    """Make this rank SIGKILL itself at ``where`` inside the DDP and FSDP wrappers' construction."""
    from axonhpc.parallel.ddp import wrapper as ddp_wrapper
    from axonhpc.parallel.fsdp import wrapper as fsdp_wrapper

    if ax.get_rank() != rank:
        return

    def die() -> None:
        print(f"killed at {time.time()!r}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    for module in (ddp_wrapper, fsdp_wrapper):
        if where == "compare":
            @contextlib.contextmanager
            def compared_model(*args, **kwargs):
                die()
                yield  # never reached

            module.compared_model = compared_model
        else:
            def broadcast_arrays(*args, **kwargs):
                die()

            module.broadcast_arrays = broadcast_arrays


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--kill", default="", help="R:WHERE (WHERE: compare or broadcast)")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--simulate-failure", default=None)
    parser.add_argument("--seed-by-rank", action="store_true", help="each rank builds another initial model")
    args = parser.parse_args()
    ax.init(fault_tolerant=True)
    if args.kill:
        rank, where = args.kill.split(":")
        if where not in POINTS:
            raise SystemExit(f"--kill {args.kill!r}: WHERE must be one of {POINTS}")
        _arm(int(rank), where)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 8))
    y = x @ rng.standard_normal((8, 1))
    # With --seed-by-rank each rank builds its own initial model: the run starts from rank 0's (broadcast).
    seed = 10 * ax.get_rank() if args.seed_by_rank else 0
    model = nn.Sequential(nn.Linear(8, 32, dtype=np.float64, seed=seed + 1), nn.ReLU(),
                          nn.Linear(32, 1, dtype=np.float64, seed=seed + 2))
    trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=1e-2), nn.MSELoss(),
                                    strategy=args.strategy, progress=False, verbose=False,
                                    fault_tolerance="shrink", simulate_failure=args.simulate_failure)
    trainer.fit((x, y), epochs=args.epochs, batch_size=args.batch_size, checkpoint_dir=args.checkpoint_dir)
    if trainer.active and trainer.rank == 0:
        for record in trainer.recoveries:
            print(f"recovery {record.lost} {record.step} {record.ranks} {record.seconds:.3f} {record.caught!r}")
        print(f"epochs run {len(trainer.history)}")
        print(f"final loss {trainer.history[-1]['loss']!r} at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
