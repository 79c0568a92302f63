"""Ranks that wait in collectives their peers never join: the job for tests/collectives/test_watchdog.py.

    mpiexec -n 2 python tests/support/jobs/stall_job.py MODE

deadlock: rank 0 all-reduces on the world and then on a subgroup of the same ranks, rank 1 the other way round;
twins: two unnamed groups of the same ranks, entered in opposite orders by blocking all-reduces;
missing: rank 1 sleeps in Python (it is computing, as far as anyone can tell) while rank 0 all-reduces;
only_rank0: an evaluation that calls a collective inside ``if rank == 0:`` while rank 1 goes on training;
slow: rank 1 is late, then joins (the report, and no error).
Each rank prints one line ``rank R: <ErrorClass>: <message>`` or ``rank R: done``.
"""
import os
import sys
import time

import numpy as np

import axonhpc as ax


def evaluate(world):
    x = np.ones(3)
    ax.all_reduce(x)  # a collective every rank must call
    return x


def train_on(seconds):
    time.sleep(seconds)


def main():
    mode = sys.argv[1]
    world = ax.init()
    with open(f"pid-rank{world.rank}", "w") as f:  # in the working directory: the test signals a rank
        f.write(str(os.getpid()))
    sub = world.new_group(list(range(world.world_size)), name="sub")
    try:
        if mode == "deadlock":
            first, second = (world.default_group, sub) if world.rank == 0 else (sub, world.default_group)
            ax.all_reduce(np.ones(4), group=first)
            ax.all_reduce(np.ones(4), group=second)
        elif mode == "twins":
            a, b = world.new_group([0, 1]), world.new_group([0, 1])  # "group[0, 1]" and "group[0, 1] #2"
            first, second = (a, b) if world.rank == 0 else (b, a)
            ax.all_reduce(np.ones(4), group=first)
            ax.all_reduce(np.ones(4), group=second)
        elif mode == "missing":
            if world.rank == 1:
                time.sleep(float(sys.argv[2]))
            ax.all_reduce(np.ones(4))
        elif mode == "only_rank0":
            if world.rank == 0:
                evaluate(world)
            else:
                train_on(float(sys.argv[2]))  # the other ranks went on training
        elif mode == "slow":
            if world.rank == 1:
                time.sleep(float(sys.argv[2]))
            ax.all_reduce(np.ones(4))
        verdict = "done"
    except ax.errors.AxonError as exc:
        verdict = f"{type(exc).__name__}: {exc}"
    print(f"rank {world.rank}: {verdict}", flush=True)
    # Also in a file of its own: mpiexec merges the ranks' output in chunks, which can split a line.
    with open(f"verdict-rank{world.rank}.txt", "w") as f:
        f.write(verdict)


if __name__ == "__main__":
    main()
