"""An MPI job whose last rank misbehaves in a collective with a timeout (run by tests/collectives/test_timeouts.py).

    timeout_job.py sleep    the last rank sleeps past the timeout before the all_reduce
    timeout_job.py skip     the last rank skips the all_reduce and goes on to a barrier
    timeout_job.py stall    debug mode, a long timeout: the last rank is 1 s late; the others report the stall
    timeout_job.py mismatch debug mode: the last rank calls a barrier where the others all-reduce
    timeout_job.py usr1     a few collectives, "ready", then a pause in which the test sends SIGUSR1
    timeout_job.py p2p      nothing goes wrong: blocking and non-blocking point to point under a timeout
    timeout_job.py async    the last rank sleeps past the timeout; the others wait() on an asynchronous all_reduce
    timeout_job.py irecv    rank 0 wait()s on an irecv from the last rank, which sleeps past the timeout
    timeout_job.py group    the last rank sleeps past the timeout where the others make a new group
    timeout_job.py silent   as sleep, but rank 1 has no timeout, so it sends no arrival notices
"""
import sys
import time

import numpy as np

import axonhpc as ax

world = ax.init()
ax.settings.timeout = 30 if sys.argv[1] in ("stall", "p2p") else 1.5
if sys.argv[1] == "silent" and world.rank == 1:
    ax.settings.timeout = None
ax.settings.debug = sys.argv[1] in ("stall", "mismatch")
ax.settings.stall_report = 0.3
ax.barrier()
x = np.ones(4)
last = world.rank == world.world_size - 1
if sys.argv[1] == "stall":
    if last:
        time.sleep(1.0)
    ax.all_reduce(x)
    assert x[0] == world.world_size
elif sys.argv[1] == "p2p":
    n, r = world.world_size, world.rank
    ring = np.empty(4)
    works = [ax.irecv(ring, (r - 1) % n, tag=3), ax.isend(x * r, (r + 1) % n, tag=3)]
    for w in works:
        w.wait(5)
    assert ring[0] == (r - 1) % n
    if r % 2 == 0 and r + 1 < n:
        ax.send(x, r + 1)
    elif r % 2 == 1:
        ax.recv(ring, r - 1)
elif sys.argv[1] == "usr1":
    for _ in range(3):
        ax.all_reduce(x)
    ax.barrier()
    sys.stdout.write(f"ready {world.rank}\n")  # one write: the two ranks' lines cannot interleave
    sys.stdout.flush()
    time.sleep(3)
    ax.barrier()
elif sys.argv[1] in ("sleep", "async", "silent"):
    if last:
        time.sleep(20)
    if sys.argv[1] == "async":
        ax.all_reduce(x, async_op=True).wait()  # no timeout given: the group's
    else:
        ax.all_reduce(x)
elif sys.argv[1] == "group":
    if last:
        time.sleep(20)
    world.new_group(list(range(world.world_size - 1)))
elif sys.argv[1] == "irecv":
    if world.rank == 0:
        ax.irecv(x, world.world_size - 1).wait()
    elif last:
        time.sleep(20)
        ax.send(x, 0)
elif last:
    ax.barrier()
else:
    ax.all_reduce(x)
print(f"rank {world.rank} finished", flush=True)
