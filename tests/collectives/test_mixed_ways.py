"""One collective blocking on some ranks and nonblocking on others: threads, and MPI with shared memory on and off."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.collectives import agreement

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


def test_a_call_left_waiting_when_its_world_ended_leaves_the_next_world_alone():
    # A nonblocking call nobody waited for, whose check never came back, stays noted; it must not make the
    # next world's calls (whose thread ranks may reuse the ended threads' idents) wait the polled way.
    class Stop(Exception):
        pass

    def left(world):
        if world.rank == 0:
            ax.all_reduce(np.ones(3), async_op=True)  # never made on rank 1, never waited for
            raise Stop("rank 0 stops")

    with pytest.raises(Stop):
        ax.run_local(left, world_size=2)

    def after(world):
        assert not agreement.elsewhere(world.default_group, own_too=True)
        x = np.ones(3)
        ax.all_reduce(x)
        assert (x == 2).all()

    ax.run_local(after, world_size=2)
