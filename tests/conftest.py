"""Shared fixtures. Multi-rank tests are marked ``mpi`` and run under mpiexec (scripts/test.sh)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def mpi_world():
    """The real MPI world (only under --with-mpi)."""
    import axonhpc as ax

    return ax.init()


@pytest.fixture
def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
