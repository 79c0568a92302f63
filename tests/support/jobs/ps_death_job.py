"""A parameter-server job in which a server fails and then, while it still serves, a worker dies (a real SIGKILL).

    python ps_death_job.py NUM_SERVERS

Async mode, workers 0 and 1, the last NUM_SERVERS ranks servers. The last server's optimizer raises on its
first update (worker 0's gradient, sent once worker 1's first pull was answered), so it answers ABORT from then
on; worker 0 hears it in its next pull and raises. Worker 1, which pulled once and then computes, SIGKILLs itself
once worker 0 has raised: the servers, still waiting for it, meet its death in their loop (under ULFM:
``PeerFailedError``). Each survivor writes verdict-rank<R>.txt: its error's type, its text and its notes, one a
line; and how many seconds after the kill it got out (a first line "<seconds>").
"""
import os
import signal
import sys
import time

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.parallel.parameter_server import ParameterServer

VICTIM = 1


class Boom(Exception):
    pass


def main():
    num_servers = int(sys.argv[1])
    world = ax.init()
    last = world.world_size - 1

    class Exploding(optim.SGD):
        def step(self):
            if world.rank == last:
                raise Boom(f"optimizer exploded on rank {world.rank}")
            return super().step()

    model = nn.Sequential(nn.Linear(6, 8, dtype=np.float64, seed=0), nn.Tanh(),
                          nn.Linear(8, 3, dtype=np.float64, seed=1))
    ps = ParameterServer(model, num_servers=num_servers, mode="async", max_staleness=None, optimizer_class=Exploding,
                         lr=0.05)
    told, died_at = os.path.join(os.getcwd(), "worker0-raised.txt"), os.path.join(os.getcwd(), "killed-at.txt")
    verdict = "done"
    try:
        with ps:
            if ps.is_worker:
                ps.pull()
                pulled = os.path.join(os.getcwd(), "worker1-pulled.txt")
                if world.rank == VICTIM:
                    open(pulled, "w").close()
                    deadline = time.monotonic() + 60
                    while not os.path.exists(told) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    with open(died_at, "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                deadline = time.monotonic() + 60
                while not os.path.exists(pulled) and time.monotonic() < deadline:
                    time.sleep(0.01)  # worker 1's first pull is answered before the server fails on this gradient
                rng = np.random.default_rng(0)
                loss_fn = nn.CrossEntropyLoss()
                loss_fn(model(rng.standard_normal((8, 6))), rng.integers(0, 3, 8))
                model.backward(loss_fn.backward())
                ps.push()  # the last server's optimizer raises on it
                ps.pull()  # ABORT from the last server
    except Exception as exc:  # noqa: BLE001 - every survivor writes what it raised
        verdict = "\n".join([type(exc).__name__, str(exc), *getattr(exc, "__notes__", [])])
    seconds = time.time() - float(open(died_at).read()) if os.path.exists(died_at) else -1.0
    with open(f"verdict-rank{world.rank}.txt", "w") as f:
        f.write(f"{seconds:.3f}\n{verdict}")
    if world.rank == 0:
        with open(told, "w") as f:
            f.write("1")
    print(f"rank {world.rank}: {verdict.splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
