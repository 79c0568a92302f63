"""ParameterServer under Open MPI with ULFM: a server's second failure is a worker that dies (a real SIGKILL).

The job (``tests/support/jobs/ps_death_job.py``, started as a user would: ``axonhpc launch --fault-tolerant``
with .venv-openmpi, an outer timeout): the last server's optimizer raises on its first update, worker 0 hears
it and raises, and worker 1 SIGKILLs itself while the servers still wait for it. Every survivor must get out
within seconds of the kill, and nothing may be lost on the way: the failed server raises its optimizer's error
noting the dead worker, the other server a ``PeerFailedError`` that names both, worker 0 the failed server.
"""
import os
import subprocess

import pytest

from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi
from support.paths import JOBS, timed_verdicts

JOB = os.path.join(JOBS, "ps_death_job.py")
GUARD = 120  # seconds: the outer timeout of every job
VICTIM = 1


def _job(tmp_path, n, num_servers):
    """``axonhpc launch --fault-tolerant -n n -- ps_death_job.py num_servers``: (the job's output, rank -> verdict)."""
    cmd = ["timeout", "-k", "5", str(GUARD), OPENMPI_PYTHON, "-m", "axonhpc", "launch", "--fault-tolerant", "-n",
           str(n), "--", JOB, str(num_servers)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=job_env(tmp_path),
                         stdin=subprocess.DEVNULL, timeout=GUARD + 20, errors="replace")
    return out.stdout[-3000:] + out.stderr[-3000:], timed_verdicts(tmp_path, n)


@needs_openmpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n,num_servers", [(3, 1), (4, 2)])
def test_a_worker_dying_after_a_server_failed_loses_nothing(tmp_path, n, num_servers):
    out, verdicts = _job(tmp_path, n, num_servers)
    last = n - 1
    assert sorted(verdicts) == [r for r in range(n) if r != VICTIM], out
    server = f"parameter server {num_servers - 1} (global rank {last})"
    boom = f"{server} failed: Boom: optimizer exploded on rank {last}"
    dead = f"rank {VICTIM} of the job failed"
    worker_seconds, worker = verdicts[0]
    assert worker.startswith("PeerFailedError\n") and f"{server} stopped the run: {boom}" in worker, worker
    for rank in range(n - num_servers, n):
        seconds, verdict = verdicts[rank]
        assert 0 <= seconds < 10, (rank, seconds, verdict)  # measured: well under a second; no time limit is set
        if rank == last:  # its own error first, then the dead worker, as a note
            assert verdict.startswith("Boom\noptimizer exploded"), (rank, verdict)
        else:
            assert verdict.startswith("PeerFailedError\n"), (rank, verdict)
        assert boom in verdict and dead in verdict, (rank, verdict)
