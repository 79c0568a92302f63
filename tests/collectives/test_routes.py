"""collectives.routes.choose: the one place a collective's route is chosen, on threads and on MPI ranks."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends import ReduceOp
from axonhpc.collectives.routes import Route, choose
from support.mpi_assert import collectively


def _routes_on_threads(world):
    pg = world.default_group
    x = np.ones(1000)
    if pg.size == 1:
        assert choose(pg, x, "all_reduce", ReduceOp.SUM) == (Route.ONE_RANK, None)
    else:  # threads share no engine: the backend, or the ring's fixed order in deterministic mode
        assert choose(pg, x, "all_reduce", ReduceOp.SUM) == (Route.BACKEND, None)
    assert choose(pg, x, "reduce_scatter", ReduceOp.AVG) == (Route.BACKEND, None)
    assert choose(pg, x, "broadcast") == (Route.BACKEND, None)
    ax.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_threads_take_the_backend_or_one_rank(world_size):
    ax.run_local(_routes_on_threads, world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_deterministic_mode_takes_the_ring_without_shared_memory(world_size):
    def body(world):
        pg = world.default_group
        expected = Route.ONE_RANK if pg.size == 1 else Route.RING
        assert choose(pg, np.ones(8), "all_reduce", ReduceOp.AVG)[0] is expected
        # only where the order can change the bits: integers and MAX keep the backend
        assert choose(pg, np.ones(8, np.int64), "all_reduce", ReduceOp.SUM)[0] in (Route.ONE_RANK, Route.BACKEND)
        assert choose(pg, np.ones(8), "all_reduce", ReduceOp.MAX)[0] in (Route.ONE_RANK, Route.BACKEND)
        assert choose(pg, np.ones(6), "reduce_scatter", ReduceOp.SUM)[0] is (
            Route.BACKEND if pg.size == 1 else Route.RING)
        ax.barrier()

    ax.settings.deterministic = True
    ax.run_local(body, world_size=world_size)


@pytest.mark.mpi(min_size=2)
def test_one_node_takes_the_engine_and_each_route_gives_the_sum(mpi_world):
    def check():
        pg, n, r = mpi_world.default_group, mpi_world.world_size, mpi_world.rank
        assert choose(pg, np.ones(100), "all_reduce", ReduceOp.SUM)[0] is Route.NODE
        assert choose(pg, np.ones(100, np.int32), "all_reduce", ReduceOp.AVG)[0] is Route.NODE_WIDENED
        assert choose(pg, np.ones(100, np.float16), "all_reduce", ReduceOp.SUM)[0] is Route.NODE_WIDENED
        assert choose(pg, np.ones(100), "broadcast")[0] is Route.NODE
        big = np.ones(ax.settings.shm_allgather_max_bytes // 8 + 1)
        assert choose(pg, big, "all_gather")[0] is Route.BACKEND  # MPI's single copy wins above the bound
        taken = {}
        for shm, deterministic in (("auto", False), ("off", False), ("off", True)):
            ax.settings.shm_collectives, ax.settings.deterministic = shm, deterministic
            x = np.arange(10.0) + r
            taken[shm, deterministic] = choose(pg, x, "all_reduce", ReduceOp.SUM)[0]
            ax.all_reduce(x, async_op=True).wait()  # async: the general path, on the route chosen
            np.testing.assert_array_equal(x, n * np.arange(10.0) + n * (n - 1) / 2)
        assert taken == {("auto", False): Route.NODE, ("off", False): Route.BACKEND, ("off", True): Route.RING}

    collectively(mpi_world, check)
