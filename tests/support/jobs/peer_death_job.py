"""A job in which one rank SIGKILLs itself; the survivors must raise PeerFailedError naming it (tests/backends/test_faults.py).

    python peer_death_job.py MODE VICTIM [SHM]

MODE is the call the survivors are in when the victim dies: all_reduce (a loop of
small all-reduces, carried with their check), large (1 MiB all-reduces), broadcast,
barrier, async (an asynchronous all-reduce waited for), recv (every survivor waits
for a message from the victim), subgroup (rank 1 waits for a message from the victim,
the others for rank 1 in an all-reduce of the group without the victim: through shared
memory, where only the victim's failure, not rank 1's absence, can end their wait). SHM is "auto" or "off" (the default). Each rank
writes its verdict to verdict-rank<R>.txt: "PeerFailedError <lost ranks> <seconds from the
kill>" or "done" or another error's name and text.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import axonhpc as ax


def step(mode, world, victim, k):
    if mode == "all_reduce":
        x = np.ones(4)
        ax.all_reduce(x)
    elif mode == "large":
        x = np.ones(1 << 17)
        ax.all_reduce(x)
    elif mode == "broadcast":
        x = np.arange(8.0)
        ax.broadcast(x, src=0 if victim != 0 else 1)
    elif mode == "barrier":
        ax.barrier()
    elif mode == "async":
        x = np.ones(16)
        ax.all_reduce(x, async_op=True).wait()
    elif mode == "subgroup":  # a node group without the victim waits for a member stuck on the victim
        if world.rank != victim:
            if world.rank == 1:
                ax.recv(np.empty(4), src=victim)
            x = np.ones(1 << 12)
            ax.all_reduce(x, group=SUBGROUP[0])
        elif k < 3:
            ax.send(np.ones(4), dst=1)
    elif mode == "recv":
        if world.rank != victim:
            ax.recv(np.empty(4), src=victim)
        elif k < 3:  # it sends on the first steps, then dies before the next message
            for r in range(world.world_size):
                if r != victim:
                    ax.send(np.ones(4), dst=r)


SUBGROUP = [None]  # "subgroup" mode: the ranks but the victim


def main():
    mode, victim = sys.argv[1], int(sys.argv[2])
    ax.settings.shm_collectives = sys.argv[3] if len(sys.argv) > 3 else "off"
    world = ax.init()
    if mode == "subgroup":
        SUBGROUP[0] = world.new_group([r for r in range(world.world_size) if r != victim])
    died_at = os.path.join(os.getcwd(), "killed-at.txt")
    verdict = "done"
    try:
        for k in range(40):
            if k == 3 and world.rank == victim:
                with open(died_at, "w") as f:
                    f.write(f"{time.time()!r} {os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL)
            step(mode, world, victim, k)
    except ax.errors.PeerFailedError as exc:
        elapsed = time.time() - float(open(died_at).read().split()[0])
        verdict = f"PeerFailedError {json.dumps(exc.lost)} {elapsed:.3f} {exc}"
    except ax.errors.AxonError as exc:
        verdict = f"{type(exc).__name__}: {exc}"
    with open(f"verdict-rank{world.rank}.txt", "w") as f:
        f.write(verdict)
    print(f"rank {world.rank}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
