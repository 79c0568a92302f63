"""Nothing hangs silently by default (issue 42): the watchdog's stall report, stall timeout, deadlock proof and
SIGUSR1 dump while a rank is blocked, with real 2-rank jobs (``tests/support/jobs/stall_job.py``), shared memory on and off.

The thresholds are lowered through the environment so the jobs take seconds; no time is asserted beyond the
outer hang guard and the one second a dump may take.
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from support.paths import JOBS

JOB = os.path.join(JOBS, "stall_job.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
HANG_GUARD = 120
pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in this environment")


def _env(tmp_path, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONHPC_FLIGHT_DIR=str(tmp_path / "flight"),
               AXONHPC_STALL_REPORT="2", AXONHPC_STALL_TIMEOUT="8")
    env.update(extra)
    for name in ("AXONHPC_TIMEOUT", "AXONHPC_DEBUG", "AXONHPC_WATCHDOG"):
        env.pop(name, None)
    return env


def _run(tmp_path, *args, **extra):
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, JOB, *args], capture_output=True, text=True,
                         timeout=HANG_GUARD, cwd=tmp_path, env=_env(tmp_path, **extra))
    text = out.stdout + out.stderr
    for rank in (0, 1):
        verdict = tmp_path / f"verdict-rank{rank}.txt"
        if verdict.exists():
            text += f"\nrank {rank}: {verdict.read_text()}"
    return out, text


def _rank_line(text, rank):
    """Rank ``rank``'s verdict, from its own file (the job's merged output can split lines)."""
    found = re.findall(rf"^rank {rank}: (.*)$", text, re.M)
    return found[-1] if found else None


@pytest.mark.timeout(180)
def test_two_groups_entered_in_different_orders_raise_deadlock_error_on_every_rank(tmp_path):
    out, text = _run(tmp_path, "deadlock", AXONHPC_STALL_TIMEOUT="30")  # the proof comes long before
    assert out.returncode == 0, text
    for rank in (0, 1):
        line = _rank_line(text, rank)
        assert line and line.startswith("DeadlockError: deadlock: "), text
        assert "on group world [0, 1]" in line and "on group sub [0, 1]" in line  # both groups and calls
        assert "which rank 1 has not entered" in line and "which rank 0 has not entered" in line
    assert re.search(r"has waited \d+ s in all_reduce #0", text)  # the stall report came first


@pytest.mark.timeout(180)
def test_two_groups_of_one_name_and_the_same_ranks_are_told_apart_in_a_deadlock(tmp_path):
    # Two unnamed groups of ranks [0, 1] were both "group[0, 1]": the proof saw one group whose call #0 both ranks
    # had entered, found no deadlock, and the job only warned until it was killed.
    out, text = _run(tmp_path, "twins", AXONHPC_STALL_TIMEOUT="30")
    assert out.returncode == 0, text
    for rank in (0, 1):
        line = _rank_line(text, rank)
        assert line and line.startswith("DeadlockError: deadlock: "), text
        assert "on group group[0, 1] [0, 1]" in line and "on group group[0, 1] #2 [0, 1]" in line, line


@pytest.mark.timeout(180)
def test_a_deadlock_inside_mpi_ends_the_job_with_the_error_on_every_rank(tmp_path):
    out, text = _run(tmp_path, "deadlock", AXONHPC_SHM_COLLECTIVES="off", AXONHPC_STALL_TIMEOUT="30")
    assert out.returncode != 0, text  # blocked in MPI, which cannot be interrupted: the job is aborted
    for rank in (0, 1):
        assert re.search(rf"rank {rank}/2\].*ERROR axonhpc\.watchdog: DeadlockError on rank {rank}: deadlock:", text), text
    assert "aborting the job" in text


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_a_collective_called_on_one_rank_only_is_reported_with_where_each_rank_is(tmp_path, shm):
    out, text = _run(tmp_path, "only_rank0", "12", AXONHPC_SHM_COLLECTIVES=shm)
    report = re.search(r"still waits after \d+ s; (who is where: .*)$", text, re.M)
    assert report, text
    assert "rank 0 waits in all_reduce #0 float64 (3,) on group world [0, 1]" in report.group(1)
    assert "at stall_job.py:" in report.group(1) and "in evaluate" in report.group(1)
    assert re.search(r"rank 1 is not in a collective, at stall_job\.py:\d+ in train_on", report.group(1)), report
    assert "inside `if rank == 0:`" in report.group(1)
    if shm == "auto":  # the engine gives up: rank 0 raises the stall error, with the report
        assert out.returncode == 0, text
        assert _rank_line(text, 0).startswith("CollectiveStallError: rank 0 waited 8 s in all_reduce #0"), text
    else:  # blocked inside MPI: the job ends with the error
        assert out.returncode != 0 and "CollectiveStallError on rank 0" in text, text


@pytest.mark.timeout(180)
def test_a_late_rank_gets_a_report_and_no_error(tmp_path):
    out, text = _run(tmp_path, "slow", "4")
    assert out.returncode == 0, text
    assert _rank_line(text, 0) == "done" and _rank_line(text, 1) == "done", text
    assert re.search(r"rank 0 has waited \d+ s in all_reduce #0", text), text


@pytest.mark.timeout(180)
def test_sigusr1_dumps_within_a_second_while_the_rank_is_blocked(tmp_path):
    job = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, JOB, "missing", "6"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                           env=_env(tmp_path, AXONHPC_STALL_REPORT="60", AXONHPC_STALL_TIMEOUT="0"))
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp_path / "pid-rank0") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # rank 0 now waits inside the all-reduce; rank 1 sleeps
        os.kill(int((tmp_path / "pid-rank0").read_text()), signal.SIGUSR1)
        time.sleep(1.0)
        dumps = glob.glob(str(tmp_path / "flight" / "flight-*-rank00000.json"))  # flight-<run>-rank<r>.json
        out, _ = job.communicate(timeout=HANG_GUARD)
    finally:
        if job.poll() is None:
            job.kill()
    assert dumps, out  # written within a second, while the rank was still blocked
    assert "SIGUSR1: wrote the flight recorder to" in out and out.count("SIGUSR1: wrote") == 1, out
    assert "rank 0: done" in out and "rank 1: done" in out


@pytest.mark.timeout(180)
def test_two_jobs_sharing_a_flight_folder_never_answer_each_others_stall_requests(tmp_path):
    # Job B deadlocks and stays blocked (it never reports itself); job A, started from another folder with the
    # same flight folder, stalls with rank 1 elsewhere. Before run-named requests B's ranks answered A's
    # request and A's report showed B's calls (and could prove a deadlock A did not have).
    flight_dir = tmp_path / "flight"
    job_a, job_b = tmp_path / "a", tmp_path / "b"
    job_a.mkdir()
    job_b.mkdir()
    other = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, JOB, "deadlock"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=job_b,
                             env=_env(job_b, AXONHPC_FLIGHT_DIR=str(flight_dir), AXONHPC_STALL_REPORT="600",
                                      AXONHPC_STALL_TIMEOUT="0"))
    try:
        deadline = time.monotonic() + 60
        while not (job_b / "pid-rank1").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # both of B's ranks now wait in their first all-reduce
        out, text = _run(job_a, "only_rank0", "12", AXONHPC_FLIGHT_DIR=str(flight_dir))
    finally:
        other.kill()
        other.communicate(timeout=HANG_GUARD)
    report = re.search(r"still waits after \d+ s; (who is where: .*)$", text, re.M)
    assert report, text
    assert "rank 0 waits in all_reduce #0 float64 (3,) on group world [0, 1]" in report.group(1), report.group(1)
    assert re.search(r"rank 1 is not in a collective, at stall_job\.py:\d+ in train_on", report.group(1)), report
    assert "(4,)" not in report.group(1) and "group sub" not in report.group(1)  # nothing of job B
    assert out.returncode == 0, text
    assert _rank_line(text, 0).startswith("CollectiveStallError: rank 0 waited 8 s in all_reduce #0"), text


def test_a_failed_peer_found_while_a_call_waits_inside_mpi_revokes_in_a_fault_tolerant_job(monkeypatch):
    """The decision alone, with a stand-in communicator (the race it settles is rare in a real job: test_elastic hit
    it once in three full runs, when ULFM had not yet failed a survivor's MPI call): in a fault-tolerant job the
    watchdog revokes the call's communicator, so that the call raises PeerFailedError itself, where it used to abort
    the whole job; outside one, or for another error, it still aborts."""
    import types

    from axonhpc.collectives import watchdog
    from axonhpc.errors import DeadlockError, PeerFailedError
    from axonhpc.settings import settings

    calls = []
    comm = types.SimpleNamespace(Revoke=lambda: calls.append("revoke"))
    world = types.SimpleNamespace(rank=1, abort=lambda code: calls.append(f"abort {code}"))
    pg = types.SimpleNamespace(backend=types.SimpleNamespace(comm=comm, name="mpi"), world=world)
    monkeypatch.setattr(watchdog, "cached_engine", lambda backend: None)
    monkeypatch.setattr(watchdog.time, "sleep", lambda s: None)
    monkeypatch.setattr(watchdog.time, "monotonic", iter(range(0, 10**6, 10)).__next__)  # the grace passes at once
    dog = watchdog._Watchdog()
    key = -12345  # a thread that stays blocked inside MPI
    seen = (pg, None, "all_gather")
    monkeypatch.setitem(watchdog._blocked, key, seen)
    lost = PeerFailedError("rank 0 of the job failed", [0])
    for tolerant, error, want in ((True, lost, ["revoke"]), (False, lost, ["abort 1"]),
                                  (True, DeadlockError("deadlock"), ["abort 1"])):
        calls.clear()
        monkeypatch.setattr(settings, "fault_tolerant", tolerant)
        dog._end(key, seen, error)
        assert calls == want, (tolerant, error)


class _Engine:
    """A stand-in for the node's engine: records what the watchdog abandons it with."""

    def __init__(self):
        self.abandoned = []

    def abandon(self, error):
        self.abandoned.append(error)


def _moving_thread(monkeypatch, tolerant):
    """A watchdog, a group on a stand-in engine and a thread key whose call the test replaces mid-look."""
    import types

    from axonhpc.collectives import watchdog
    from axonhpc.settings import settings

    calls = []
    world = types.SimpleNamespace(rank=0, world_size=3, run_id="5eed", abort=lambda code: calls.append(f"abort {code}"))
    pg = types.SimpleNamespace(backend=types.SimpleNamespace(name="mpi"), world=world, name="pair", ranks=(0, 2))
    engine = _Engine()
    monkeypatch.setattr(watchdog, "cached_engine", lambda backend: engine)
    monkeypatch.setattr(settings, "fault_tolerant", tolerant)
    running = watchdog._dog
    if running is not None:  # the process's own watchdog (an earlier test's init) would look at these notes too
        monkeypatch.setattr(running, "_look", lambda: None)
    monkeypatch.setattr(watchdog, "_dog", watchdog._Watchdog())
    return watchdog, pg, engine, calls


def _note(watchdog, pg, seq):
    """The note a call of seq ``seq`` leaves in ``_blocked`` (a flight entry as ``flight.record`` makes it)."""
    from axonhpc.collectives import flight

    entry = [None] * len(flight.FIELDS)
    entry[flight.FIELDS.index("op")], entry[flight.FIELDS.index("seq")] = "all_reduce", seq
    return (pg, entry, None)


def test_a_peer_failure_found_during_one_call_names_the_call_it_ends(monkeypatch):
    """F4: ULFM's failed set takes a while to read; the thread finished thousands of small all-reduces meanwhile, and
    the error named the call the look had seen (#28520) in the call it ended (#31108). The look now gives no
    verdict to a call that has ended; the next look ends the call then waiting, named as it is."""
    watchdog, pg, engine, _ = _moving_thread(monkeypatch, tolerant=True)
    key = -23456
    first, later = _note(watchdog, pg, 28520), _note(watchdog, pg, 31108)
    monkeypatch.setitem(watchdog._blocked, key, first)

    def slow_look(world, ranks):  # the thread moves on to a later call while ULFM is asked
        watchdog._blocked[key] = later
        return [1], []  # job rank 1 is lost; no process outside COMM_WORLD

    monkeypatch.setattr(watchdog, "lost_while_waiting", slow_look)
    dog = watchdog._dog
    dog._look()
    assert engine.abandoned == [] and watchdog.verdict(key) is None
    dog._look()  # the thread still waits in the later call
    assert len(engine.abandoned) == 1, engine.abandoned
    text = str(engine.abandoned[0])
    assert "all_reduce #31108" in text and "#28520" not in text, text
    assert watchdog.verdict(key) is engine.abandoned[0]


def test_a_stall_verdict_never_ends_a_later_healthy_call(monkeypatch):
    """A stall whose call completes while the watchdog reads the other ranks' states: the verdict must reach neither
    the thread's next call (the engine, a polling wait) nor end the job while that next call waits in MPI."""
    from axonhpc.settings import settings

    watchdog, pg, engine, calls = _moving_thread(monkeypatch, tolerant=False)
    monkeypatch.setattr(settings, "stall_report", 1000.0)
    monkeypatch.setattr(settings, "stall_timeout", 5.0)
    key = -34567
    stalled, healthy = _note(watchdog, pg, 7), _note(watchdog, pg, 8)
    monkeypatch.setitem(watchdog._blocked, key, stalled)
    dog = watchdog._dog
    clock = iter(range(0, 10**6, 10))
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(watchdog.time, "sleep", lambda s: None)
    dog._look()  # first sight of the call
    report = dog._report

    def report_then_complete(*args, **kwargs):  # the stalled call returns; the thread enters the next one
        watchdog._blocked[key] = healthy
        return report(*args, **kwargs)

    monkeypatch.setattr(dog, "_report", report_then_complete)
    dog._look()  # past stall_timeout: the verdict is made for the call that has just ended
    assert engine.abandoned == [] and calls == [], (engine.abandoned, calls)
    assert watchdog.verdict(key) is None


def test_a_verdict_answers_only_the_call_it_was_made_for(monkeypatch):
    from axonhpc.errors import CollectiveStallError

    watchdog, pg, engine, calls = _moving_thread(monkeypatch, tolerant=False)
    key = -45678
    stalled, healthy = _note(watchdog, pg, 3), _note(watchdog, pg, 4)
    monkeypatch.setitem(watchdog._blocked, key, stalled)
    monkeypatch.setattr(watchdog.time, "sleep", lambda s: watchdog._blocked.__setitem__(key, healthy))
    error = CollectiveStallError("stalled")
    watchdog._dog._end(key, stalled, error)  # the call returns during the grace; the next one starts
    assert engine.abandoned == [error] and calls == []  # no abort: the thread waits in another call
    assert watchdog.verdict(key) is None  # a polling wait of the next call does not raise it
