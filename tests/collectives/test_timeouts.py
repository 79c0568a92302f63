"""No silent hangs under MPI: a rank late or absent from a timed collective is named, and the job ends.

Each test starts its own mpiexec job (serial suite) with AXONHPC_ABORT_ON_EXCEPTION=1, as under
``axonhpc launch``: the waiting ranks raise CollectiveTimeoutError naming the missing rank, print it and
abort the job long before the misbehaving rank would have caught up.
"""
import os
import subprocess
import sys
import time

import pytest

from support.paths import JOBS

JOB = os.path.join(JOBS, "timeout_job.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _run(mode, n=3, **extra):
    env = dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1", OMP_NUM_THREADS="1", **extra)
    start = time.monotonic()
    out = subprocess.run(["timeout", "-k", "5", "60", MPIEXEC, "-n", str(n), sys.executable, JOB, mode],
                         capture_output=True, text=True, env=env)
    return out, time.monotonic() - start


def _failed_within(mode, seconds=15, **extra):
    """Run ``mode``: the job must end by the error (not by the outer ``timeout``) within ``seconds``; its output."""
    out, elapsed = _run(mode, **extra)
    text = out.stdout + out.stderr
    assert out.returncode not in (0, 124), text[-3000:]
    assert elapsed < seconds, (elapsed, text[-3000:])
    return text


@pytest.mark.timeout(120)
def test_a_sleeping_rank_is_named_and_the_job_ends():
    text = _failed_within("sleep")  # the sleeper would need 20 s
    assert "all_reduce #1 on group world" in text and "timed out after 1.5 s" in text, text[-3000:]
    assert "missing ranks: [2]" in text and "arrived ranks: [0, 1]" in text, text[-3000:]
    assert "finished" not in text


@pytest.mark.timeout(120)
def test_a_rank_without_a_timeout_is_not_named_missing():
    # Rank 1 has no timeout, so it sends no arrival notices: whether it arrived cannot be told. It was named
    # among the missing ranks beside the sleeping rank 2, though it waited in the all-reduce like rank 0.
    # Shared memory off: the engine counts arrivals itself. 30 s: one wait of 5 s for rank 1's notices, then 1.5 s.
    text = _failed_within("silent", seconds=30, AXONHPC_SHM_COLLECTIVES="off")
    assert "all_reduce #1 on group world" in text and "timed out after 1.5 s" in text, text[-3000:]
    assert "arrived ranks: [0]; missing ranks: [2]; not known: [1]" in text, text[-3000:]
    assert "finished" not in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_wait_on_an_asynchronous_call_takes_the_groups_timeout(shm):
    # Work.wait() with no timeout used to wait forever on the MPI path, whatever the group's timeout.
    text = _failed_within("async", AXONHPC_SHM_COLLECTIVES=shm)
    assert "all_reduce #1 on group world" in text and "timed out after 1.5 s" in text, text[-3000:]
    assert "missing ranks: [2]" in text and "finished" not in text, text[-3000:]


@pytest.mark.timeout(120)
def test_wait_on_an_irecv_takes_the_groups_timeout():
    text = _failed_within("irecv")
    assert "irecv with group rank 2 (tag 0) on group world timed out after 1.5 s" in text, text[-3000:]


@pytest.mark.timeout(120)
def test_making_a_group_takes_the_groups_timeout():
    # The check of new_group's arguments across the world waited forever (a raw MPI all-gather) for a rank
    # that never came, and the watchdog did not see it.
    text = _failed_within("group")
    assert "the check of a call's arguments across group world [0, 1, 2]" in text, text[-3000:]
    assert "timed out after 1.5 s" in text and "finished" not in text, text[-3000:]


@pytest.mark.timeout(120)
def test_a_rank_in_another_collective_is_named_with_where_it_is():
    out, elapsed = _run("skip")
    text = out.stdout + out.stderr
    assert out.returncode not in (0, 124) and elapsed < 15, (out.returncode, elapsed, text[-3000:])
    # The ranks' calls meet in the agreement check that comes before every collective
    # (collectives.agreement), so the wrong call is named at once, on every rank, without
    # waiting for the timeout.
    assert "CollectiveMismatchError" in text and "rank 2 called barrier" in text, text[-3000:]
    assert "rank 0 called all_reduce float64 (4,) op=SUM" in text, text[-3000:]


def test_no_timeout_means_no_notices():
    """Without a timeout a collective sends nothing extra (the Arrivals side channel stays unused)."""
    import axonhpc as ax
    from axonhpc.collectives import core

    calls = []
    world = ax.World.mock()

    class Recorder:
        def announce(self, seq, op):
            calls.append((seq, op))

    assert world.default_group.effective_timeout() is None
    fake = type("G", (), {"effective_timeout": lambda self: None, "backend": Recorder()})()
    assert core.run_call(fake, core.CallLabel("all_reduce", 0, world.default_group),
                     lambda nonblocking: ax.backends.base.CompletedWork(), False, carried=True) is None
    assert calls == []


@pytest.mark.timeout(120)
def test_debug_mode_reports_a_stall_once_and_keeps_waiting():
    out, _ = _run("stall")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for rank in (0, 1):  # each waiting rank's watchdog reports once, naming the call it waits in
        assert text.count(f"rank {rank} has waited") == 1, text[-3000:]
    assert "debug fingerprint exchange" in text, text[-3000:]
    assert text.count("finished") == 3


@pytest.mark.timeout(120)
def test_point_to_point_under_a_timeout_just_works():
    out, _ = _run("p2p")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.count("finished") == 3
