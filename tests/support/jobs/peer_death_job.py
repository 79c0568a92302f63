"""A job in which one rank SIGKILLs itself; the survivors must raise PeerFailedError naming it (tests/backends/test_faults.py).

    python peer_death_job.py MODE VICTIM [SHM]

MODE is the call the survivors are in when the victim dies: all_reduce (a loop of
small all-reduces, carried with their check), large (1 MiB all-reduces), broadcast,
barrier, async (an asynchronous all-reduce waited for), recv (every survivor waits
for a message from the victim), irecv_poll and irecv_wait (the same through irecv, its Work polled with
is_completed or waited for), subgroup (rank 1 waits for a message from the victim,
the others for rank 1 in an all-reduce of the group without the victim: through shared
memory, where only the victim's failure, not rank 1's absence, can end their wait), pair (the others
all-reduce small arrays on their own group, thousands a second, until the victim's death ends the call
they are in; seq-rank<R>.txt: that call's number, which the error must name). SHM is "auto" or "off" (the default). Each rank
writes its verdict to verdict-rank<R>.txt: "PeerFailedError <lost ranks> <seconds from the
kill>" or "done" or another error's name and text; a rank that raised PeerFailedError writes to
revoked-rank<R>.txt whether the world's communicator is revoked (1 or 0).
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
    elif mode == "pair":  # the others all-reduce small arrays on their own group until the victim's death ends it
        if world.rank != victim and k == 3:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ax.all_reduce(np.ones(4), group=SUBGROUP[0])
    elif mode in ("recv", "irecv_poll", "irecv_wait"):
        if world.rank != victim:
            if mode == "recv":
                ax.recv(np.empty(4), src=victim)
            else:  # an asynchronous receive, polled (is_completed) or waited for
                work = ax.irecv(np.empty(4), src=victim)
                if mode == "irecv_wait":
                    work.wait()
                while not work.is_completed():
                    time.sleep(0.001)
        elif k < 3:  # it sends on the first steps, then dies before the next message
            for r in range(world.world_size):
                if r != victim:
                    ax.send(np.ones(4), dst=r)


SUBGROUP = [None]  # "subgroup" mode: the ranks but the victim


def main():
    mode, victim = sys.argv[1], int(sys.argv[2])
    ax.settings.shm_collectives = sys.argv[3] if len(sys.argv) > 3 else "off"
    world = ax.init()
    if mode in ("subgroup", "pair"):
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
        if SUBGROUP[0] is not None:  # the number of the group's call that raised
            with open(f"seq-rank{world.rank}.txt", "w") as f:
                f.write(str(SUBGROUP[0].seq - 1))
        with open(f"revoked-rank{world.rank}.txt", "w") as f:  # the world's communicator, revoked for the others
            f.write(str(int(world.backend.comm.Is_revoked())))
    except ax.errors.AxonError as exc:
        verdict = f"{type(exc).__name__}: {exc}"
    with open(f"verdict-rank{world.rank}.txt", "w") as f:
        f.write(verdict)
    print(f"rank {world.rank}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
