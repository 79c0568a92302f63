"""Shared fixtures. Multi-rank tests are marked ``mpi`` and run under mpiexec (scripts/test.sh).

The test files sit in folders like the package's (``tests/collectives/``, ``tests/parallel/ddp/``, ...), with
names unique across the tree (pytest's default "prepend" import mode imports each by its bare name). What they
share lives in the package ``tests/support/``, imported as ``support.<module>`` since this folder is put on
``sys.path`` here.
"""
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Flight-recorder dumps of tests that time out on purpose go to a scratch directory, never into the
# working tree; set before axonhpc reads its settings, and inherited by the jobs the tests start.
os.environ.setdefault("AXONHPC_FLIGHT_DIR", os.path.join(tempfile.gettempdir(), f"axonhpc-flight-tests-{os.getuid()}"))


@pytest.fixture(autouse=True)
def _settings_restored():
    """No test may leak a change of ax.settings into the next one."""
    from axonhpc.settings import settings

    before = settings.as_dict()
    yield
    for name, value in before.items():
        setattr(settings, name, value)


@pytest.fixture(scope="session")
def mpi_world():
    """The real MPI world (only under --with-mpi)."""
    import axonhpc as ax

    return ax.init()


@pytest.fixture
def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
