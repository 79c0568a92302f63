"""Rank 1 raises, rank 0 waits in a collective: the job for tests/groups/test_abort.py.

    mpiexec -n 2 python tests/support/jobs/abort_job.py

With the default ``abort_on_exception`` the uncaught exception on rank 1
aborts the whole job at once; with ``AXONHPC_ABORT_ON_EXCEPTION=0`` rank 0
waits in its all-reduce forever (the test's outer timeout ends it).
"""
import numpy as np

import axonhpc as ax


def main():
    world = ax.init()
    if world.rank == 1:
        raise RuntimeError("rank 1 fails on purpose before the all-reduce")
    x = np.ones(4)
    ax.all_reduce(x)  # rank 0 waits here for rank 1, which never comes
    print(f"rank {world.rank}: all-reduce returned {x.tolist()}", flush=True)


if __name__ == "__main__":
    main()
