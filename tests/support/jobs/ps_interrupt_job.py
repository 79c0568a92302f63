"""A parameter-server job whose last server gets a real SIGINT (a Ctrl-C) while it serves.

    python ps_interrupt_job.py NUM_SERVERS MODE

The workers train (a short pause after each step, so that the servers mostly wait in their loop) until the run
stops. Once every worker has stepped a few times, a timer thread of the last rank sends SIGINT to its own process
and writes when (interrupted-at.txt); Python raises KeyboardInterrupt in the serving thread. That server catches
it and, like every other rank, writes verdict-rank<R>.txt: the seconds from the interrupt until it got out (first
line), then its error's type, text and notes, one a line. The time limit (20 s) is what a worker left waiting would
meet instead.
"""
import glob
import os
import signal
import sys
import threading
import time

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.parallel.parameter_server import ParameterServer

LIMIT = 20.0
STEPPED = 3  # steps each worker takes before the interrupt


def _interrupt_once_every_worker_stepped(workers):
    deadline = time.monotonic() + 60
    while len(glob.glob("stepped-rank*.txt")) < workers and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    with open("interrupted-at.txt", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGINT)


def main():
    num_servers, mode = int(sys.argv[1]), sys.argv[2]
    world = ax.init()
    ax.settings.timeout = LIMIT
    model = nn.Sequential(nn.Linear(6, 8, dtype=np.float64, seed=0), nn.Tanh(),
                          nn.Linear(8, 3, dtype=np.float64, seed=1))
    ps = ParameterServer(model, num_servers=num_servers, mode=mode, max_staleness=0 if mode == "sync" else None,
                         optimizer_class=optim.SGD, lr=0.05)
    if world.rank == world.world_size - 1:
        threading.Thread(target=_interrupt_once_every_worker_stepped, args=(ps.num_workers,), daemon=True).start()
    verdict = "done"
    try:
        with ps:
            if ps.is_worker:
                rng = np.random.default_rng(world.rank)
                loss_fn = nn.CrossEntropyLoss()
                ps.pull()
                for step in range(int(LIMIT / 0.01)):
                    ps.zero_grad()
                    loss_fn(model(rng.standard_normal((8, 6))), rng.integers(0, 3, 8))
                    model.backward(loss_fn.backward())
                    ps.step()
                    if step + 1 == STEPPED:
                        open(f"stepped-rank{world.rank}.txt", "w").close()
                    time.sleep(0.01)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - every rank writes what it raised
        verdict = "\n".join([type(exc).__name__, str(exc), *getattr(exc, "__notes__", [])])
    at = "interrupted-at.txt"
    seconds = time.time() - float(open(at).read()) if os.path.exists(at) else -1.0
    with open(f"verdict-rank{world.rank}.txt", "w") as f:
        f.write(f"{seconds:.3f}\n{verdict}")
    print(f"rank {world.rank}: {verdict.splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
