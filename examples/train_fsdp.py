"""Train an MLP on the handwritten digits with FSDP (HYBRID_SHARD by default) through DistributedTrainer.

    axonhpc launch -n 4 -- examples/train_fsdp.py --ranks-per-node 2          # 2 "nodes" of 2 ranks on one machine
    axonhpc launch -n 4 -- examples/train_fsdp.py --ranks-per-node 2 --resume # continues from the last checkpoint
    axonhpc slurm render fsdp-hybrid --nodes 4 --tasks-per-node 8 --requeue -- examples/train_fsdp.py > fsdp.sbatch

HYBRID_SHARD shards every flat parameter over the ranks of one node and
replicates the shards across nodes: the reduce-scatter and all-gather of a
step stay inside a node, and only the shards' gradients are averaged across
nodes. The node groups come from MPI's shared-memory split (one node: one
replica, sharded over all ranks); ``--ranks-per-node K`` instead treats each
block of K consecutive ranks as a node, which shows the layout of several
nodes on one machine. ``--sharding-strategy`` picks another strategy
(full_shard, shard_grad_op, no_shard).

The data is scikit-learn's bundled digits set; each rank trains on its shard
of every epoch, the loss and held-out accuracy are reduced across ranks, a
checkpoint directory is written after each epoch (``--checkpoint-dir``), and
``--resume`` continues from the newest one (bit for bit the uninterrupted
run); without it the directory must hold no earlier run's checkpoints (the
trainer refuses to mix two runs). ``--min-accuracy`` makes the exit status say
whether it learned.
"""
import argparse
import sys


import axonhpc as ax
from axonhpc import nn, optim
from train_digits import exit_status, load_digits  # the same data split and accuracy gate as the main job


def build_model(seed):
    return nn.Sequential(nn.Linear(64, 128, seed=seed), nn.ReLU(),
                         nn.Linear(128, 64, seed=seed + 1), nn.ReLU(),
                         nn.Linear(64, 10, seed=seed + 2))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharding-strategy", default="hybrid_shard",
                        choices=("hybrid_shard", "full_shard", "shard_grad_op", "no_shard"))
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="hybrid_shard: shard over blocks of this many consecutive ranks (default: the real nodes)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints/digits-fsdp")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 if the final held-out accuracy is lower")
    args = parser.parse_args(argv)

    world = ax.init()
    main_rank = world.rank == 0
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    model = build_model(args.seed)
    options = {"sharding_strategy": args.sharding_strategy}
    if args.ranks_per_node is not None:
        options["ranks_per_node"] = args.ranks_per_node

    def report(trainer, record):
        if main_rank:
            print(f"epoch {record['epoch']:3d}  loss {record['loss']:.4f}  test accuracy "
                  f"{record['eval_accuracy']:.4f}", flush=True)

    trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=args.lr), nn.CrossEntropyLoss(),
                                    strategy="fsdp", seed=args.seed, on_epoch=report, verbose=False, **options)
    trainer.fit((x_train, y_train), args.epochs, eval_arrays=(x_test, y_test), batch_size=args.batch_size,
                checkpoint_dir=args.checkpoint_dir, resume=args.resume)
    accuracy = trainer.evaluate((x_test, y_test))["accuracy"]
    fsdp = trainer.setup.wrapper  # the FullyShardedDataParallel the trainer built
    replicas = 1 if fsdp.replicate_group is None else fsdp.replicate_group.size
    if main_rank:
        print(f"FSDP {args.sharding_strategy} on {world.world_size} rank(s): each parameter sharded over "
              f"{fsdp.shard_world_size} rank(s), {replicas} replica(s); final test accuracy {accuracy:.4f}",
              flush=True)
    return exit_status(accuracy, args.min_accuracy, main_rank)


if __name__ == "__main__":
    sys.exit(main())
