"""An uncaught error raised alike on every rank: the job for tests/groups/test_abort.py's "told once" tests.

    mpiexec -n 3 python tests/support/jobs/uncaught_mismatch_job.py mismatch|refusal|timeout

mismatch: rank 0 all-reduces 4 elements, the others 5 (CollectiveMismatchError on every rank);
refusal: rank 0 reduce-scatters 4 elements over 3 ranks, the others 6 (rank 0 ShapeError, the others
CollectiveRefusedError); timeout: rank 2 sleeps past the others' 2-second timeout.
"""
import sys
import time

import numpy as np

import axonhpc as ax


def main():
    mode = sys.argv[1]
    world = ax.init(timeout=2 if mode == "timeout" else None)
    if mode == "mismatch":
        ax.all_reduce(np.ones(4 if world.rank == 0 else 5))
    elif mode == "refusal":
        ax.reduce_scatter(np.ones(4 if world.rank == 0 else 6))
    else:
        if world.rank == 2:
            time.sleep(30)
        ax.all_reduce(np.ones(4))


if __name__ == "__main__":
    main()
