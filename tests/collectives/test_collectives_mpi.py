"""The collective suite on real MPI ranks (run under mpiexec -n 2, 3, 4)."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends.mpi import chunk_bounds
from support.collective_cases import CASES, closed_form
from support.mpi_assert import collectively
from support.runner import mpi_test


test_collective_case = mpi_test(CASES)


@pytest.fixture
def small_chunks():
    """Force the chunked path: at most 5 elements per MPI call."""
    saved = ax.settings.max_message_elements
    ax.settings.max_message_elements = 5
    yield 5
    ax.settings.max_message_elements = saved


@pytest.mark.mpi(min_size=1)
def test_chunked_messages(mpi_world, small_chunks):
    """Buffers larger than one MPI call are moved in chunks, for every operation."""

    def check():
        n, r = mpi_world.world_size, mpi_world.rank
        x = np.arange(23, dtype=np.float64) + r
        ax.all_reduce(x)
        np.testing.assert_array_equal(x, sum(np.arange(23.0) + k for k in range(n)))
        y = np.arange(17, dtype=np.int64) + r
        ax.all_reduce(y, async_op=True).wait()
        assert y.tolist() == [n * v + n * (n - 1) // 2 for v in range(17)]
        h = np.full(13, r, dtype=np.float16)
        ax.all_reduce(h, "avg")
        assert np.all(h == np.float16((n - 1) / 2))
        b = np.arange(12, dtype=np.int32) if r == 0 else np.zeros(12, dtype=np.int32)
        ax.broadcast(b, 0)
        assert b.tolist() == list(range(12))
        g = ax.all_gather(np.arange(11, dtype=np.float32) * (r + 1))
        np.testing.assert_array_equal(g, np.stack([np.arange(11, dtype=np.float32) * (k + 1) for k in range(n)]))
        g2 = ax.all_gather(np.arange(11, dtype=np.float32) * (r + 1), async_op=True).wait()
        np.testing.assert_array_equal(g, g2)
        rs = ax.reduce_scatter(np.arange(9 * n, dtype=np.float64).reshape(n, 9) + r)
        full = sum(np.arange(9 * n, dtype=np.float64).reshape(n, 9) + k for k in range(n))
        np.testing.assert_array_equal(rs, full[r:r + 1])
        rs2 = ax.reduce_scatter(np.arange(9 * n, dtype=np.float64).reshape(n, 9) + r, async_op=True).wait()
        np.testing.assert_array_equal(rs, rs2)
        ga = ax.gather(np.arange(8) + 10 * r, dst=n - 1)
        if r == n - 1:
            assert ga.tolist() == [list(range(10 * k, 10 * k + 8)) for k in range(n)]
        src = np.arange(7 * n, dtype=np.float64).reshape(n, 7) if r == 0 else None
        part = ax.scatter(src, 0)
        assert part.tolist() == list(range(7 * r, 7 * r + 7))
        if n > 1:
            right, left = (r + 1) % n, (r - 1) % n
            into = np.empty(14)
            works = [ax.irecv(into, left, tag=3), ax.isend(np.full(14, float(r)), right, tag=3)]
            for w in works:
                w.wait()
            assert np.all(into == left)

    collectively(mpi_world, check)


def test_blocks_cover_every_element():
    """The chunk arithmetic: consecutive, bounded, complete, one empty block for 0."""
    assert list(chunk_bounds(0, 5)) == [(0, 0)]
    for n in range(1, 40):
        for step in range(1, 12):
            blocks = list(chunk_bounds(n, step))
            assert blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(b - a <= step and b > a for a, b in blocks)
            assert all(blocks[i][1] == blocks[i + 1][0] for i in range(len(blocks) - 1))


@pytest.mark.mpi(min_size=1)
def test_mpi_backend_works_on_a_duplicate(mpi_world):
    """The backend never uses the user's communicator itself."""
    from mpi4py import MPI

    def check():
        comm = MPI.COMM_WORLD
        backend = ax.MPIBackend(comm)
        assert backend.comm != comm
        assert MPI.Comm.Compare(backend.comm, comm) == MPI.CONGRUENT
        world = ax.World(backend)
        x = np.full(3, world.rank + 1.0)
        ax.all_reduce(x, group=world.default_group)
        assert np.all(x == closed_form(ax.ReduceOp.SUM, world.world_size, 1, np.float64))
        backend.free()

    collectively(mpi_world, check)



@pytest.mark.mpi(min_size=2)
def test_a_reduce_op_given_by_name_takes_the_fast_path(mpi_world, monkeypatch):
    # "SUM" or "avg" (as the docs write them) went the general way on every call: 3-5x slower for 4 KiB.
    from axonhpc.collectives import allreduce

    general = []
    checked = allreduce.checked_all_reduce
    monkeypatch.setattr(allreduce, "checked_all_reduce", lambda *a, **k: general.append(a[1]) or checked(*a, **k))

    def check():
        n = mpi_world.world_size
        for name, want in (("SUM", n * (n + 1) / 2), ("avg", (n + 1) / 2), ("Mean", (n + 1) / 2), ("max", n)):
            for _ in range(3):
                x = np.full(1024, mpi_world.rank + 1.0, dtype=np.float32)
                ax.all_reduce(x, name)
                assert (x == want).all(), (name, x[:2])
        # Over MPI alone (no shared-memory engine) AVG, which MPI lacks, goes the general way.
        assert not [op for op in general if op is not ax.ReduceOp.AVG], general
        with pytest.raises(ax.errors.InvalidArgumentError, match="median"):  # refused on the general path, everywhere
            ax.all_reduce(np.ones(1024, dtype=np.float32), "median")

    collectively(mpi_world, check)
