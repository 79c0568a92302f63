"""A rank that dies (a real SIGKILL) under Open MPI with ULFM: every survivor raises PeerFailedError naming it.

Each job is started as a user would (``axonhpc launch --fault-tolerant``) from
the Open MPI environment (.venv-openmpi, which scripts/test.sh sets up), with
an outer timeout; the ranks write their verdicts to files of their own. Under
MPICH, and under Open MPI without fault tolerance, ``ax.init(fault_tolerant=True)``
and the launcher refuse, naming the MPI they found.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from axonhpc.backends.failures import ulfm_problem
from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi
from support.paths import JOBS, ROOT

JOB = os.path.join(JOBS, "peer_death_job.py")
GUARD = 120  # seconds: the outer timeout of every job
EXIT_GRACE = 20  # seconds a job has to end once every survivor has written its verdict


def _job(tmp_path, n, *args, python=OPENMPI_PYTHON, launch=("--fault-tolerant",), expect=(), **extra):
    """Run the job; returns (its completed process, rank -> verdict, whether it had to be killed at the end).

    ``expect``: the ranks whose verdicts end the job's work; once they are all written, the job gets
    ``EXIT_GRACE`` seconds to end before its process group is killed.
    """
    cmd = [python, "-m", "axonhpc", "launch", *launch, "-n", str(n), "--", JOB, *args]
    out_path, err_path = tmp_path / "job.out", tmp_path / "job.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                env=job_env(tmp_path, **extra), start_new_session=True)
        deadline = time.monotonic() + GUARD
        while proc.poll() is None and time.monotonic() < deadline:
            if expect and all((tmp_path / f"verdict-rank{r}.txt").exists() for r in expect):
                deadline = min(deadline, time.monotonic() + EXIT_GRACE)
            time.sleep(0.1)
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    verdicts = {}
    for rank in range(n):
        path = tmp_path / f"verdict-rank{rank}.txt"
        if path.exists():
            verdicts[rank] = path.read_text()
    done = subprocess.CompletedProcess(cmd, proc.returncode, out_path.read_text(), err_path.read_text())
    return done, verdicts, killed


@needs_openmpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n,victim,mode,shm", [
    (3, 2, "all_reduce", "off"),
    (4, 1, "all_reduce", "off"),
    (4, 3, "large", "off"),
    (3, 0, "broadcast", "off"),
    (4, 2, "barrier", "off"),
    (3, 1, "async", "off"),
    (3, 2, "recv", "off"),
    (3, 1, "irecv_poll", "off"),  # is_completed's look for another dtype's message (Iprobe) met the failure raw
    (3, 1, "irecv_wait", "off"),
    # The node's shared-memory engine: the watchdog sees the process gone
    (3, 2, "all_reduce", "auto"),
    (4, 0, "broadcast", "auto"),
    (3, 1, "large", "auto"),
    (3, 2, "subgroup", "auto"),  # a peer of the wait stuck on the victim: ULFM's failed set ends it
    (4, 3, "subgroup", "auto"),
    # The watchdog's verdict names the call it ends, not one of the thousands before it (ULFM is slow to ask)
    (3, 1, "pair", "auto"),
])
def test_every_survivor_raises_peer_failed_naming_the_dead_rank(tmp_path, n, victim, mode, shm):
    survivors = [r for r in range(n) if r != victim]
    out, verdicts, killed = _job(tmp_path, n, mode, str(victim), shm, expect=survivors)
    text = out.stdout + out.stderr
    assert victim not in verdicts, text
    assert sorted(verdicts) == survivors, text
    # Survivors once waited for ever in MPI_Finalize's fence; the launcher now leaves it out (docs/fault-tolerance.md)
    assert not killed, f"the {mode} job did not end within {EXIT_GRACE} s after every survivor had raised\n{text}"
    for rank in survivors:
        verdict = verdicts[rank]
        assert verdict.startswith("PeerFailedError "), f"rank {rank}: {verdict}\n{text}"
        _, lost, seconds, message = verdict.split(" ", 3)
        assert json.loads(lost) == [victim], verdict
        assert float(seconds) < 10, verdict  # measured: 0.01-0.1 s; bounded well below any timeout
        assert f"rank {victim} of the job failed" in message, verdict
        if mode == "pair":
            seq = (tmp_path / f"seq-rank{rank}.txt").read_text()
            assert f"all_reduce #{seq} " in message, f"rank {rank} raised in all_reduce #{seq}: {message}"
        if mode in ("recv", "irecv_poll", "irecv_wait"):  # docs/fault-tolerance.md: the communicator is revoked
            assert (tmp_path / f"revoked-rank{rank}.txt").read_text() == "1", f"rank {rank}: world not revoked"


@needs_openmpi
@pytest.mark.timeout(200)
def test_fault_tolerance_is_refused_where_a_dead_rank_ends_the_job(tmp_path):
    # Open MPI started without --with-ft: init refuses on every rank, saying how to start it.
    out, verdicts, killed = _job(tmp_path, 2, "all_reduce", "1", launch=(), AXONHPC_FAULT_TOLERANT="1")
    assert out.returncode != 0 and not verdicts and not killed
    assert "not started with fault tolerance on" in out.stderr and "--fault-tolerant" in out.stderr, out.stderr
    # MPICH's launcher cannot: axonhpc launch refuses before starting anything.
    mpich = subprocess.run([sys.executable, "-m", "axonhpc", "launch", "--fault-tolerant", "-n", "2", "--", JOB,
                            "all_reduce", "1"], capture_output=True, text=True, timeout=GUARD, cwd=tmp_path,
                           env=job_env(tmp_path))
    assert mpich.returncode == 2 and "MPICH" in mpich.stderr and "ends the whole job" in mpich.stderr, mpich.stderr


@pytest.mark.timeout(200)
def test_under_mpich_a_dead_rank_ends_the_job_at_once(tmp_path):
    # MPICH's hydra cannot keep the survivors: the job ends within seconds, saying a process was killed.
    out, verdicts, killed = _job(tmp_path, 3, "all_reduce", "2", python=sys.executable, launch=())
    assert out.returncode != 0 and not verdicts and not killed, out.stdout + out.stderr
    assert "BAD TERMINATION" in out.stdout and "Killed (signal 9)" in out.stdout, out.stdout + out.stderr


def test_init_refuses_fault_tolerance_on_mpich_and_on_one_local_rank():
    code = ("import axonhpc as ax\n"
            "for backend in ('mpi', 'local'):\n"
            "    try:\n"
            "        ax.init(backend=backend, fault_tolerant=True)\n"
            "    except ax.errors.ConfigurationError as exc:\n"
            "        print(backend, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    mpi_line, local_line = out.stdout.strip().splitlines()
    assert mpi_line.startswith("mpi fault_tolerant") and "MPICH" in mpi_line and "Open MPI 5" in mpi_line, mpi_line
    assert local_line.startswith("local fault_tolerant needs MPI ranks"), local_line


def test_the_fault_tolerant_launch_turns_ulfm_on_and_the_finalize_fence_off():
    from axonhpc.mpiexec import FAULT_TOLERANT_ARGS, launch_command

    cmd = launch_command("mpiexec", "openmpi", 3, "train.py", [], is_root=True, fault_tolerant=True)
    assert cmd[:3] == ["mpiexec", "--allow-run-as-root", "--oversubscribe"]
    assert cmd[3:3 + len(FAULT_TOLERANT_ARGS)] == ["--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1"]
    assert "--with-ft" not in launch_command("mpiexec", "openmpi", 3, "train.py", [], fault_tolerant=False)


def test_ulfm_problem_reads_the_library_and_the_launch():
    class OpenMPI:
        class Comm:
            Revoke = None

        @staticmethod
        def Get_library_version():
            return "Open MPI v5.0.11, package: Open MPI\n"

    assert ulfm_problem(OpenMPI, {"OMPI_MCA_mpi_ft_enable": "1"}) is None
    assert "not started with fault tolerance on" in ulfm_problem(OpenMPI, {})

    class MPICH(OpenMPI):
        @staticmethod
        def Get_library_version():
            return "MPICH Version:      5.0.2\n"

    assert "MPICH Version:      5.0.2" in ulfm_problem(MPICH, {"OMPI_MCA_mpi_ft_enable": "1"})


def test_init_rejects_a_fault_tolerant_flag_that_is_not_a_bool():
    import axonhpc as ax

    with pytest.raises(ax.errors.ArgumentTypeError, match="fault_tolerant='yes'"):
        ax.init(fault_tolerant="yes")
