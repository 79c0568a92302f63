"""A training job for the kill tests: DDP through the trainer, a checkpoint every two steps.

The model is wide on purpose (about 2M float64 parameters, ~50 MB of state
per rank with Adam's moments), so a checkpoint takes long enough to be
killed in the middle of.

    mpiexec -n 2 python tests/support/jobs/kill_job.py --checkpoint-dir DIR [--resume]
"""
import argparse
import sys

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    ax.init()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 512))
    y = rng.integers(0, 10, 64)
    model = nn.Sequential(nn.Linear(512, args.width, dtype=np.float64, seed=1), nn.Tanh(),
                          nn.Linear(args.width, 10, dtype=np.float64, seed=2))
    trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=1e-3), nn.CrossEntropyLoss(),
                                    strategy="ddp", seed=0, verbose=False)
    trainer.fit((x, y), args.epochs, batch_size=8, checkpoint_dir=args.checkpoint_dir, checkpoint_every=2,
                resume=args.resume)
    if ax.get_rank() == 0:
        print(f"finished at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
