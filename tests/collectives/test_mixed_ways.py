"""One collective blocking on some ranks and nonblocking on others: threads, and MPI with shared memory on and off."""
import pytest

from support.mixed_way_cases import CASES, COMPARED_CASES
from support.runner import case_tests
from support.settings_override import override


test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES, sizes=(2, 3, 4), min_size=2, shm=["auto", "off"])


@pytest.fixture
def straggler_every():
    """The ranks' arrivals compared every 5 collectives (``stragglers``), for the length of a test."""
    with override(straggler_every=5):
        yield 5


test_arrivals_compared_on_threads, test_arrivals_compared_on_mpi_ranks = case_tests(
    COMPARED_CASES, sizes=(2, 3, 4), min_size=2, shm=["auto", "off"], fixtures=("straggler_every",))
