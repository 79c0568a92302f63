"""Run on simulated hosts: after "ready", the test cuts host2's link; the timed all-reduce must name host2's ranks."""
import time

import numpy as np

import axonhpc as ax

world = ax.init()
ax.settings.timeout = 3.0
ax.barrier()
if world.rank == 0:
    print("ready", flush=True)
time.sleep(2.0)  # the link goes down in this window
ax.all_reduce(np.ones(1 << 16))
print(f"rank {world.rank} finished", flush=True)
