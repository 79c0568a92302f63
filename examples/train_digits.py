"""Train an MLP on the handwritten digits with DistributedTrainer (DDP): the axonhpc main job.

    axonhpc launch -n 2 -- examples/train_digits.py --epochs 20
    axonhpc launch -n 2 -- examples/train_digits.py --epochs 30 --resume   # continues from the last checkpoint
    axonhpc launch -n 2 -- examples/train_digits.py --device cuda          # on the GPU(s), with cupy
    axonhpc launch --fault-tolerant -n 4 -- examples/train_digits.py --elastic --batch-size 12 --simulate-failure 2:30
        # Open MPI with ULFM: rank 2 dies after 30 steps, the other three go on (--spares 1: one replaces it);
        # the global batch, 4 x 12 = 48, must split evenly over the ranks left (the default 4 x 32 does not)

The data is scikit-learn's bundled digits set (1,797 8x8 images, offline).
``ax.DistributedTrainer`` gives each rank its shard of every epoch
(DistributedSampler), DDP averages the gradients, rank 0 shows a progress
bar, the loss and the held-out accuracy are reduced across ranks after each
epoch, and a checkpoint directory is written after each epoch; --resume
continues from the newest one and gives, bit for bit, the same parameters as
an uninterrupted run. Without --resume the checkpoint directory must hold no
earlier run's checkpoints (the trainer refuses to mix two runs; scripts/demo.sh
empties its own first). SIGTERM or SIGUSR1 (what SLURM sends before a time
limit or a preemption) stops every rank after the same step, writes a
checkpoint and exits with status 75, so a requeued job resumes.

``--device cuda`` moves the model (``model.to("cuda")``) and the data (cupy
arrays) to each rank's GPU, the one ``ax.init`` bound it to; the gradients
then travel over NCCL when every rank has a GPU of its own, and staged
through host memory over MPI otherwise (two ranks on one GPU). The reported
metrics are host numbers either way. Without cupy and a CUDA device it stops
at once, saying what is missing.

``--elastic`` trains with ``fault_tolerance="shrink"`` (docs/fault-tolerance.md):
a rank that dies does not end the run; the survivors shrink the world, rebuild
and redo the step with the same global batch, and rank 0 prints a
``recovered: ...`` line. ``--simulate-failure R:K`` makes rank R SIGKILL
itself once K steps are done; ``--spares N`` keeps N ranks waiting to take
the place of lost ones, and ``--respawn`` starts a replacement for each rank
lost once no spare is left.
"""
import argparse
import json
import sys

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.elastic import is_replacement


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


def device_module(device):
    """cupy for --device cuda (exits with the reason when it cannot work here), None for cpu."""
    if device == "cpu":
        return None
    from axonhpc.backends.devices import device_facts

    facts = device_facts()
    if facts.cupy is None or facts.devices < 1:
        why = "; ".join(facts.problems) or "cupy sees no CUDA device"
        sys.exit(f"train_digits --device cuda needs cupy and a CUDA device: {why}")
    import cupy

    return cupy


def build_model(seed, dtype=np.float32):
    return nn.Sequential(nn.Linear(64, 128, seed=seed, dtype=dtype), nn.ReLU(),
                         nn.Linear(128, 64, seed=seed + 1, dtype=dtype), nn.ReLU(),
                         nn.Linear(64, 10, seed=seed + 2, dtype=dtype))


def _device_line(world):
    """Where device arrays go and which GPU rank 0 uses, from what init decided."""
    facts = ax.info()
    return f"device {facts.get('device')}, device arrays over {world.backend.name}"


def exit_status(accuracy, min_accuracy, main_rank):
    """0, or 1 (said on rank 0) when ``min_accuracy`` is given and ``accuracy`` falls below it."""
    if min_accuracy is not None and accuracy < min_accuracy:
        if main_rank:
            print(f"accuracy {accuracy:.4f} is below the required {min_accuracy}", file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints/digits")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="also checkpoint every N steps (besides after every epoch)")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 if the final held-out accuracy is lower")
    parser.add_argument("--metrics", default=None, help="append one JSON line per epoch to this file (rank 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: numpy arrays (default); cuda: the model and the data on each rank's GPU (cupy)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--elastic", action="store_true",
                        help="go on when ranks die (axonhpc launch --fault-tolerant: Open MPI with ULFM)")
    parser.add_argument("--simulate-failure", default=None, metavar="R:K[:WHERE]",
                        help="with --elastic: rank R SIGKILLs itself once K steps are done (WHERE: forward, "
                             "backward, optimizer, save, spare; in a recovery: shrink, agree, split, restore)")
    parser.add_argument("--spares", type=int, default=0, metavar="N",
                        help="with --elastic: N of the ranks wait, and one takes the place of each rank lost")
    parser.add_argument("--respawn", action="store_true",
                        help="with --elastic: start a replacement for each rank lost once no spare is left")
    args = parser.parse_args(argv)
    if (args.simulate_failure or args.spares or args.respawn) and not args.elastic:
        sys.exit("train_digits: --simulate-failure, --spares and --respawn need --elastic")
    if args.elastic and args.device != "cpu":
        sys.exit("train_digits: --elastic keeps its copies in host memory; it has not run with --device cuda")

    cupy = device_module(args.device)  # before init: a missing cupy stops every rank alike, with the reason
    world = ax.init(fault_tolerant=True) if args.elastic else ax.init()
    main_rank = world.rank == 0
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    x_train, x_test = x_train.astype(args.dtype), x_test.astype(args.dtype)
    model = build_model(args.seed, np.dtype(args.dtype))
    if cupy is not None:
        model.to("cuda")  # before the optimizer and DDP see the parameters
        x_train, y_train, x_test, y_test = (cupy.asarray(a) for a in (x_train, y_train, x_test, y_test))

    def report(trainer, record):
        if trainer.rank != 0:  # after a lost rank 0, the lowest survivor reports
            return
        print(f"epoch {record['epoch']:3d}  loss {record['loss']:.4f}  test accuracy {record['eval_accuracy']:.4f}  "
              f"({record['seconds']:.2f} s)", flush=True)
        if args.metrics:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"epoch": record["epoch"], "loss": record["loss"],
                                    "test_accuracy": record["eval_accuracy"], "seconds": record["seconds"]}) + "\n")

    elastic = dict(fault_tolerance="shrink", simulate_failure=args.simulate_failure, spares=args.spares,
                   respawn=args.respawn)
    trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=args.lr), nn.CrossEntropyLoss(),
                                    strategy=args.strategy, seed=args.seed, on_epoch=report, verbose=False,
                                    **(elastic if args.elastic else {}))
    if main_rank and not is_replacement():  # a replacement's world is itself until it joins
        where = "" if cupy is None else f" ({_device_line(world)})"
        print(f"training on {world.world_size} rank(s){where}: {len(x_train)} train / {len(x_test)} test images, "
              f"{sum(p.size for p in model.parameters())} parameters", flush=True)
    trainer.fit((x_train, y_train), args.epochs, eval_arrays=(x_test, y_test), batch_size=args.batch_size,
                checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume)
    if not trainer.active:
        return 0  # a spare no rank's loss needed: the run has ended
    world = ax.current_world()  # after a lost rank: the survivors' world
    scores = trainer.evaluate((x_test, y_test))
    if world.rank == 0:
        print(f"final test accuracy {scores['accuracy']:.4f} on {world.world_size} rank(s)", flush=True)
        print(f"final test loss {float(scores['loss'])!r}", flush=True)
    return exit_status(scores["accuracy"], args.min_accuracy, world.rank == 0)


if __name__ == "__main__":
    sys.exit(main())
