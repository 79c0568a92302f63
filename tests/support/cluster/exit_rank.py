"""Ranks that end with an error status while others may wait: ``exit_rank.py one`` (the last rank exits with
status 4, as an argparse error would, while the others wait in an all-reduce) or ``exit_rank.py every`` (every
rank leaves with the trainer's preemption exit, 75, together)."""
import sys

import numpy as np

import axonhpc as ax
from axonhpc.trainer import PreemptedExit

world = ax.init()
ax.barrier()
if sys.argv[1] == "every":
    raise PreemptedExit()
if world.rank == world.world_size - 1:
    print(f"rank {world.rank} exits with status 4", flush=True)
    sys.exit(4)
ax.all_reduce(np.ones(10))  # never completes: the job must end, not hang
