"""Train the digits MLP with a parameter server: the last rank serves, the other ranks are async workers.

    axonhpc launch -n 4 -- examples/train_digits_ps.py                       # 1 server + 3 async workers
    axonhpc launch -n 4 -- examples/train_digits_ps.py --max-staleness 0     # async, but one worker at a time
    axonhpc launch -n 4 -- examples/train_digits_ps.py --mode sync           # the same numbers as DDP on 3 ranks
    axonhpc launch -n 5 -- examples/train_digits_ps.py --num-servers 2

The data is scikit-learn's bundled digits set (1,797 8x8 images, offline),
split as in train_digits.py. Each worker trains on its own shard of every
epoch (DistributedSampler over the workers): it pulls the parameters,
computes a gradient on one batch and pushes it; the server owns the Adam
state and applies each gradient (scaled by 1/workers) as it arrives, never
more than --max-staleness updates after the pull it was computed on. When
every worker is done, every rank holds the final parameters; each worker
scores them on the held-out images, and worker 0 prints the result and the
server's staleness counters.
"""
import argparse
import os
import sys
import time

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.data import DataLoader, DistributedSampler
from axonhpc.parallel.parameter_server import ParameterServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import build_model, load_digits  # noqa: E402 - the same data split and MLP as the main job


def accuracy(model, x, y):
    """Fraction of ``x`` that ``model`` classifies correctly."""
    model.eval()
    predictions = model(x).argmax(axis=1)
    model.train()
    return float((predictions == y).mean())


def parse_args(argv=None):
    """The command line (defaults: async, 1 server, max staleness 2, 20 epochs of Adam at 1e-3)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("sync", "async"), default="async")
    parser.add_argument("--num-servers", type=int, default=1)
    parser.add_argument("--max-staleness", type=int, default=2, help="async only (sync always uses 0)")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 if the final held-out accuracy is lower")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    return parser.parse_args(argv)


def train(world, args):
    """Run the job on this rank of ``world``; every rank of the world calls it.

    Returns:
        dict: ``role``, ``stats`` (this rank's ParameterServer counters) and,
        on workers, ``accuracy`` of the final parameters on the held-out set.
    """
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    model = build_model(args.seed)
    ps = ParameterServer(model, num_servers=args.num_servers, mode=args.mode,
                         max_staleness=args.max_staleness if args.mode == "async" else 0,
                         optimizer_class=optim.Adam, lr=args.lr)
    talk = ps.worker_index == 0 and not args.quiet
    if talk:
        print(f"{ps.num_servers} server(s) + {ps.num_workers} worker(s), mode {ps.mode}"
              + (f", max staleness {ps.max_staleness}" if ps.mode == "async" else "")
              + f": {len(x_train)} train / {len(x_test)} test images", flush=True)
    result = {"role": "server" if ps.is_server else "worker"}
    with ps:  # a worker's exception stops the servers and the other workers instead of hanging them
        if ps.is_server:
            result["stats"] = ps.serve()
        else:
            loss_fn = nn.CrossEntropyLoss()
            sampler = DistributedSampler(len(x_train), ps.num_workers, ps.worker_index, shuffle=True,
                                         seed=args.seed)
            loader = DataLoader((x_train, y_train), args.batch_size, sampler=sampler)
            ps.pull()
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                started, total, seen = time.perf_counter(), 0.0, 0
                for xb, yb in loader:
                    ps.zero_grad()
                    loss = loss_fn(model(xb), yb)
                    model.backward(loss_fn.backward())
                    ps.step()  # push this gradient, pull what the server holds now
                    total, seen = total + loss * len(yb), seen + len(yb)
                if talk:
                    print(f"epoch {epoch + 1:3d}  worker 0 loss {total / seen:.4f}  test accuracy "
                          f"{accuracy(model, x_test, y_test):.4f} (worker 0's parameters)  "
                          f"({time.perf_counter() - started:.2f} s)", flush=True)
            ps.finish()  # waits for the other workers, then loads the final parameters
            result["stats"] = ps.stats()
    if ps.is_worker:
        result["accuracy"] = accuracy(model, x_test, y_test)
        if talk:
            print(f"final test accuracy {result['accuracy']:.4f}", flush=True)
    elif ps.server_index == 0 and not args.quiet:
        stats = result["stats"]
        print(f"server 0: {stats['version']} updates, staleness histogram {stats['staleness_histogram']}, "
              f"max {stats['max_staleness_observed']}, {stats['deferred_pulls']} pulls waited", flush=True)
    return result


def main(argv=None):
    """Entry point under ``axonhpc launch``: 0 on success, 1 below ``--min-accuracy``."""
    args = parse_args(argv)
    world = ax.init()
    result = train(world, args)
    if result["role"] == "worker" and args.min_accuracy is not None and result["accuracy"] < args.min_accuracy:
        print(f"accuracy {result['accuracy']:.4f} is below the required {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
