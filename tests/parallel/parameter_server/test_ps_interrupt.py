"""ParameterServer under MPICH: a real Ctrl-C (SIGINT) on a serving server reaches every rank.

The job (``tests/support/jobs/ps_interrupt_job.py``, a plain ``mpiexec`` with an outer timeout): the workers train
until the last server's process sends itself SIGINT from a timer while it serves. That server must raise
``KeyboardInterrupt`` itself, and every other rank ``PeerFailedError`` naming it, within seconds of the signal
(before: the server left without a word and the workers waited for their time limit, 20 s). And the hold that
keeps a Ctrl-C from landing inside a server's reply (``interrupts.HeldInterrupt``), on this process's main thread.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from axonhpc.parallel.parameter_server.interrupts import HeldInterrupt
from support.paths import JOBS, timed_verdicts

JOB = os.path.join(JOBS, "ps_interrupt_job.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
GUARD = 90  # seconds: the outer timeout of every job


def _job(tmp_path, n, num_servers, mode):
    """``mpiexec -n n ps_interrupt_job.py num_servers mode``: (the job's output, rank -> (seconds, verdict))."""
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONHPC_FLIGHT_DIR=str(tmp_path / "flight"))
    cmd = ["timeout", "-k", "5", str(GUARD), MPIEXEC, "-n", str(n), sys.executable, JOB, str(num_servers), mode]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         timeout=GUARD + 20, errors="replace")
    return out.stdout[-3000:] + out.stderr[-3000:], timed_verdicts(tmp_path, n)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,num_servers,mode", [(2, 1, "sync"), (3, 1, "async"), (4, 2, "sync"), (4, 2, "async")])
def test_a_ctrl_c_on_a_server_reaches_every_rank(tmp_path, n, num_servers, mode):
    out, verdicts = _job(tmp_path, n, num_servers, mode)
    last = n - 1
    assert sorted(verdicts) == list(range(n)), out
    cause = f"parameter server {num_servers - 1} (global rank {last}) left: KeyboardInterrupt"
    for rank, (seconds, verdict) in verdicts.items():
        assert 0 <= seconds < 10, (rank, seconds, verdict, out)  # measured: well under a second; the limit is 20 s
        if rank == last:
            assert verdict.startswith("KeyboardInterrupt\n"), (rank, verdict)
        else:
            assert verdict.startswith("PeerFailedError\n") and cause in verdict, (rank, verdict)


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs the handler at the next line it executes: here, at the latest


@pytest.mark.timeout(30)
def test_a_held_ctrl_c_raises_at_the_check_a_second_at_once():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a handler of its own in this process: HeldInterrupt leaves it alone")
    try:
        with HeldInterrupt() as held:
            _ctrl_c()  # held: nothing raised here
            assert held.held
            with pytest.raises(KeyboardInterrupt):
                held.check()
            held.check()  # delivered once
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C was not held")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt():
            _ctrl_c()
            _ctrl_c()  # a second one raises at once
            pytest.fail("the second Ctrl-C was held too")
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt():
            _ctrl_c()  # after the last check: raised as the block ends, not lost
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    off_main = []
    thread = threading.Thread(target=lambda: off_main.append(HeldInterrupt().__enter__()._previous))
    thread.start()
    thread.join()
    assert off_main == [None]  # a thread other than the main one changes nothing (signal.signal would refuse)
