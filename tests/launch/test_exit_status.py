"""A fault-tolerant job whose rank fails never exits 0 ([Note: the job's exit status under --fault-tolerant] in
axonhpc/launched.py).

Under ``mpiexec --with-ft ulfm`` prterun exited 0 when a rank was SIGKILLed and the others finished, and a rank's
``MPI_Abort`` (an uncaught exception) left the others waiting for ever at exit with 4 ranks. Each job here is
started as a user would (``axonhpc launch --fault-tolerant``, .venv-openmpi) under an outer guard.
"""
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi

GUARD = 60  # seconds: the outer timeout of every job (each ends within 15 s)

SCRIPT = """
import os, signal, sys, time
import numpy as np
import axonhpc as ax

how, wait = sys.argv[1], sys.argv[2] == "wait"
world = ax.init()
if world.rank == 1:
    if how == "raise":
        raise ValueError("a bug on rank 1")
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
if wait:
    ax.all_reduce(np.ones(4))  # the others wait for rank 1 here
else:
    time.sleep(1)
print(f"rank {world.rank} finished", flush=True)
"""


def _launch(tmp_path, n, *args, **extra):
    """The launcher's exit status, its output, and whether the guard had to kill it."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [OPENMPI_PYTHON, "-m", "axonhpc", "launch", "--fault-tolerant", "-n", str(n), "--", str(script), *args]
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                env=job_env(tmp_path, **extra), start_new_session=True)
        deadline = time.monotonic() + GUARD
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, (tmp_path / "out.txt").read_text(errors="replace"), killed


@needs_openmpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n,how,wait,shm,status", [
    (4, "raise", "wait", "off", 1),     # before: the survivors waited for ever in the all-reduce (MPI_Abort)
    (4, "raise", "nowait", "auto", 1),  # before: the survivors waited for ever at exit, in a window's free
    (3, "exit", "wait", "auto", 3),     # before: for ever; now the rank's own status, not the survivors' 1
    (3, "kill", "nowait", "auto", 1),   # before: 0, prterun's verdict on a job whose survivors finished
])
def test_a_failed_rank_fails_the_fault_tolerant_job(tmp_path, n, how, wait, shm, status):
    code, out, killed = _launch(tmp_path, n, how, wait, AXONHPC_SHM_COLLECTIVES=shm)
    assert not killed, f"the job did not end within {GUARD} s\n{out}"
    assert code == status, out
    if how == "kill" and wait == "nowait":
        assert "rank 1 of the job ended without exiting" in out, out


def _write(folder, rank, text):
    (folder / f"rank{rank}").write_text(text + "\n")


def _started(folder, *ranks):
    for rank in ranks:  # what launched.py leaves as a rank that can see the folder starts
        (folder / f"start{rank}").write_text("")


def _verdict(folder, n):
    from axonhpc import job_status

    return job_status.verdict(job_status.read_records(str(folder)), n)


def test_the_ranks_verdict(tmp_path):
    _started(tmp_path, 0, 1, 2)
    for r in range(3):
        _write(tmp_path, r, "0 ")
    assert _verdict(tmp_path, 3) == (0, "")
    os.remove(tmp_path / "rank2")  # killed: a failure unless a survivor recovered from it
    status, why = _verdict(tmp_path, 3)
    assert status == 1 and "rank 2 of the job ended without exiting" in why, why
    _write(tmp_path, 0, "0 2")  # axonhpc.elastic recovered from rank 2's loss
    assert _verdict(tmp_path, 3) == (0, "")
    # A rank's own status comes before a survivor's PeerFailedError, whatever their order
    _write(tmp_path, 0, "1  peer")
    _write(tmp_path, 1, "3  ")
    status, why = _verdict(tmp_path, 3)
    assert status == 3 and why.startswith("rank 1 of the job exited with status 3"), why


def test_a_replacements_record_counts_and_a_record_being_written_does_not(tmp_path):
    from axonhpc import job_status

    _started(tmp_path, 0, 1, 2)
    _write(tmp_path, 0, "0 1")
    _write(tmp_path, 2, "0 1")
    (tmp_path / "rank1.tmp").write_text("5 \n")  # not complete: never read
    assert _verdict(tmp_path, 3) == (0, "")
    _write(tmp_path, 3, "4 ")  # the replacement given job rank 3 failed on its own
    status, why = _verdict(tmp_path, 3)
    assert status == 4 and why == "replacement rank 3 exited with status 4 (its own error, not a peer's failure)", why
    assert job_status.all_accounted(job_status.read_records(str(tmp_path)), 3)


def test_the_job_ends_once_every_rank_left_its_script_or_was_recovered_from(tmp_path):
    from axonhpc import job_status

    def accounted():
        return job_status.all_accounted(job_status.read_records(str(tmp_path)), 3)

    assert not accounted()
    _write(tmp_path, 0, "0 ")
    _write(tmp_path, 1, "0 ")
    assert not accounted()  # rank 2 may still be training
    _write(tmp_path, 0, "0 2")  # rank 0 recovered from rank 2's loss (its replacement may linger in MPI_Finalize)
    assert accounted()
    assert job_status.read_records(str(tmp_path / "absent")) == {}


def test_ranks_on_other_hosts_are_left_to_mpiexec(tmp_path):
    # Ranks 2 and 3 run on another host (an allocation of two nodes): they cannot see the launcher's folder, so
    # they leave neither a start nor a record, and their silence is not taken for a kill.
    from axonhpc import job_status

    _started(tmp_path, 0, 1)
    _write(tmp_path, 0, "0 ")
    _write(tmp_path, 1, "0 ")
    records = job_status.read_records(str(tmp_path))
    assert records.started == {0, 1} and job_status.verdict(records, 4) == (0, "")
    assert not job_status.all_accounted(records, 4)  # the others may still be training: never ended early
    os.remove(tmp_path / "rank1")  # a rank that started here and left no record: killed
    status, why = job_status.verdict(job_status.read_records(str(tmp_path)), 4)
    assert status == 1 and why.startswith("rank 1 of the job ended without exiting"), why


def test_only_a_rank_that_sees_the_folder_says_it_started(tmp_path, monkeypatch):
    from axonhpc import launched

    monkeypatch.setenv("AXONHPC_LAUNCH_RANKS", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("AXONHPC_LAUNCH_STATUS_DIR", str(tmp_path / "on-another-host"))
    launched._started_here()
    launched._record(0)  # silently nothing: the folder is not on this host
    assert not (tmp_path / "on-another-host").exists()
    monkeypatch.setenv("AXONHPC_LAUNCH_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")  # a replacement: a job of its own, of fewer ranks
    launched._started_here()
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    launched._started_here()
    assert [p.name for p in tmp_path.iterdir()] == ["start2"]


def test_a_dead_replacement_that_was_recovered_from_does_not_fail_the_job(tmp_path, capsys):
    from axonhpc import job_status
    from axonhpc.cli import _job_verdict

    _started(tmp_path, 0, 1, 2)
    for r in range(3):
        _write(tmp_path, r, "0 1,3" if r != 1 else "0 ")
    os.remove(tmp_path / "rank1")
    records = job_status.read_records(str(tmp_path))
    # prterun's 137 for the killed replacement 3: every rank finished or was recovered from
    assert _job_verdict(137, records, 3) == 0
    assert "mpiexec exited with 137, but every rank of the job finished or was recovered from (lost: 1, 3)" in \
        capsys.readouterr().err
    assert _job_verdict(0, records, 3) == 0
    # a rank this host cannot see (another host's) might have failed on its own: prterun's status stands
    assert _job_verdict(137, job_status.Records({0: (0, {3}, False), 1: (0, {3}, False)}, {0, 1}), 3) == 137
    # without a recovery prterun's own status stands (a launch that failed, a signal from outside)
    assert _job_verdict(143, job_status.Records({0: (0, set(), False), 1: (0, set(), False)}, {0, 1}), 2) == 143
    # a rank killed with nobody recovering: prterun's 0 becomes 1
    assert _job_verdict(0, job_status.Records({0: (0, set(), False)}, {0, 1}), 2) == 1


def test_a_lost_process_outside_comm_world_is_named_by_its_world_rank(monkeypatch):
    # A replacement (elastic respawn) is in a COMM_WORLD of its own: MPI translates it to MPI.UNDEFINED, which
    # an error once printed as "rank -32766".
    from axonhpc.backends import failures

    undefined = -32766

    class Group:
        def Free(self):
            pass

        @staticmethod
        def Translate_ranks(group, ranks, other):
            return [undefined if r == 3 else r for r in ranks]

    comm = types.SimpleNamespace(Get_group=Group)
    mpi = types.SimpleNamespace(UNDEFINED=undefined, Group=Group, COMM_WORLD=types.SimpleNamespace(Get_group=Group))
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=mpi))
    world = types.SimpleNamespace(backend=types.SimpleNamespace(comm=comm))
    inside, outside = failures._job_ranks(world, [1, 3])
    assert (inside, outside) == ([1], [3])
    error = failures.node_peer_failed(inside, "all_reduce #7", outside)
    assert "-32766" not in str(error) and error.lost == [1], error
    assert str(error).startswith("rank 1 of the job and world rank 3 (a process spawned apart"), error
    alone = failures.node_peer_failed([], "all_reduce #7", [3])
    assert str(alone).startswith("world rank 3 (") and alone.lost == [], alone
