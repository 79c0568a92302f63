"""Train an MLP on the handwritten digits with DDP: the axonhpc main job.

    axonhpc launch -n 2 -- examples/train_digits.py --epochs 20
    axonhpc launch -n 2 -- examples/train_digits.py --epochs 30 --resume   # continues from the last checkpoint

The data is scikit-learn's bundled digits set (1,797 8x8 images, offline).
Each rank trains on its own shard of every epoch (DistributedSampler), DDP
averages the gradients, and rank 0 shows a progress bar. After each epoch
the mean training loss and the held-out accuracy are reduced across ranks,
and a checkpoint (model, optimizer, epoch) is written by rank 0; --resume
continues from the newest one and gives, bit for bit, the same parameters as
an uninterrupted run.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import axonhpc as ax
from axonhpc import checkpoint, nn, optim
from axonhpc.data import DataLoader, DistributedSampler


def load_digits(seed=0, test_fraction=0.2):
    """(x_train, y_train, x_test, y_test), features scaled to [0, 1], a fixed split."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        sys.exit("train_digits needs scikit-learn for its bundled data set: pip install 'axonhpc[examples]'")
    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def build_model(seed):
    return nn.Sequential(nn.Linear(64, 128, seed=seed), nn.ReLU(),
                         nn.Linear(128, 64, seed=seed + 1), nn.ReLU(),
                         nn.Linear(64, 10, seed=seed + 2))


def progress(iterable, enabled, desc):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, leave=False, file=sys.stdout, dynamic_ncols=True)


def evaluate(model, x, y, world):
    """Accuracy over the whole held-out set: each rank scores rows r, r+n, ..., counts are summed."""
    mine = np.arange(world.rank, len(x), world.world_size)
    model.eval()
    predictions = model(x[mine]).argmax(axis=1)
    model.train()
    counts = np.array([(predictions == y[mine]).sum(), len(mine)], dtype=np.int64)
    ax.all_reduce(counts)
    return counts[0] / counts[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints/digits")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 if the final held-out accuracy is lower")
    parser.add_argument("--metrics", default=None, help="append one JSON line per epoch to this file (rank 0)")
    args = parser.parse_args(argv)

    world = ax.init()
    main_rank = world.rank == 0
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    model = build_model(args.seed)
    ddp = ax.DDP(model)
    opt = optim.Adam(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(len(x_train), world.world_size, world.rank, shuffle=True, seed=args.seed)
    loader = DataLoader((x_train, y_train), args.batch_size, sampler=sampler)

    start_epoch = 0
    last = checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if last is not None:
        state = checkpoint.load(last)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = int(state["epoch"])
        if main_rank:
            print(f"resuming from {last} (epoch {start_epoch})", flush=True)
    if main_rank:
        print(f"training on {world.world_size} rank(s): {len(x_train)} train / {len(x_test)} test images, "
              f"{sum(p.size for p in ddp.parameters())} parameters, {len(ddp.bucket_plan)} gradient bucket(s)",
              flush=True)

    accuracy = evaluate(model, x_test, y_test, world)
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        started = time.perf_counter()
        totals = np.zeros(2)  # loss summed over samples, samples
        for xb, yb in progress(loader, main_rank, f"epoch {epoch + 1}/{args.epochs}"):
            opt.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            ddp.backward(loss_fn.backward())
            opt.step()
            totals += (loss * len(yb), len(yb))
        ax.all_reduce(totals)
        accuracy = evaluate(model, x_test, y_test, world)
        os.makedirs(args.checkpoint_dir, exist_ok=True) if main_rank else None
        path = os.path.join(args.checkpoint_dir, f"ckpt-{epoch + 1:04d}.npz")
        checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1})
        if main_rank:
            record = {"epoch": epoch + 1, "loss": totals[0] / totals[1], "test_accuracy": accuracy,
                      "seconds": time.perf_counter() - started}
            print(f"epoch {epoch + 1:3d}  loss {record['loss']:.4f}  test accuracy {accuracy:.4f}  "
                  f"({record['seconds']:.2f} s)", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as f:
                    f.write(json.dumps(record) + "\n")
    if main_rank:
        print(f"final test accuracy {accuracy:.4f} on {world.world_size} rank(s)", flush=True)
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        if main_rank:
            print(f"accuracy {accuracy:.4f} is below the required {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
