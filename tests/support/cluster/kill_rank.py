"""Run on simulated hosts: the last rank kills itself while the others wait in an all-reduce."""
import os
import signal
import time

import numpy as np

import axonhpc as ax

world = ax.init()
ax.barrier()
if world.rank == world.world_size - 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
ax.all_reduce(np.ones(10))  # never completes: the job must end, not hang
