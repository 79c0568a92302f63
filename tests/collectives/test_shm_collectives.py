"""Intra-node all-reduce, reduce-scatter, broadcast and all-gather through the shared-memory window, against MPI.

Every case runs the same call twice, once through the shared-memory engine
and once through MPI (``settings.shm_collectives = "off"``), on the same
inputs, at every world size the suite runs (2, 3, 4), and compares: equal
bits where the order of the reduction cannot differ (data movement, MIN and
MAX, SUM and PRODUCT on integers and on two ranks), float tolerance
otherwise. Small slots make messages cross many chunks and slot reuses.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends.shm import engine_for
from axonhpc.errors import CollectiveTimeoutError, ReadOnlyBufferError
from support.mpi_assert import collectively
from support.settings_override import override

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
SIZES = [0, 1, 17, 1000, 65536 + 3]


@pytest.fixture
def small_slots_group(mpi_world):
    """A group of every rank whose engine has 4 KiB slots, 2 of them (many chunks, much slot reuse)."""
    with override(shm_slot_bytes=4096, shm_slots=2, shm_min_bytes=0):
        group = mpi_world.new_group(list(range(mpi_world.world_size)), name="shm-small")
        ax.all_reduce(np.ones(4), "SUM", group)  # the group's first eligible call sets its window up
    yield group


def _inputs(dtype, size, rank, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype).kind == "f":
        return (rng.random(size) + 0.5).astype(dtype)  # in [0.5, 1.5): products stay finite
    return rng.integers(1, 4, size).astype(dtype)


def _both(call, x, group):
    """``call`` on copies of ``x`` through shared memory and through MPI."""
    with override(shm_collectives="auto", shm_min_bytes=0):
        a = call(x.copy(), group)
    with override(shm_collectives="off"):
        b = call(x.copy(), group)
    return a, b


def _same(a, b, exact, what):
    if exact or np.dtype(a.dtype).kind != "f":
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        tol = 1e-2 if a.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=0, err_msg=what)


def _all_reduce(op):
    def call(x, group):
        ax.all_reduce(x, op, group)
        return x
    return call


def test_engine_is_used(mpi_world, small_slots_group):
    def check():
        engine = engine_for(small_slots_group.backend, 4096, 2)  # made by the fixture's first call
        assert engine is not None
        before = engine.chunks
        x = np.ones(10000, dtype=np.float64)
        with override(shm_min_bytes=0):
            ax.all_reduce(x, "SUM", small_slots_group)
        assert engine.chunks - before == 20  # 80000 bytes in 4 KiB slots
        assert np.all(x == mpi_world.world_size)
    collectively(mpi_world, check)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_reduce_matches_mpi(mpi_world, small_slots_group, dtype):
    def check():
        for op in OPS:
            for size in SIZES:
                x = _inputs(dtype, size, mpi_world.rank)
                a, b = _both(_all_reduce(op), x, small_slots_group)
                exact = op in ("MIN", "MAX") or mpi_world.world_size == 2
                _same(a, b, exact, f"all_reduce {op} {np.dtype(dtype).name} size {size}")
    collectively(mpi_world, check)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reduce_scatter_matches_mpi(mpi_world, small_slots_group, dtype):
    n = mpi_world.world_size

    def check():
        for op in OPS:
            for per_rank in (1, 5, 3001):
                x = _inputs(dtype, n * per_rank, mpi_world.rank, seed=1).reshape(n, per_rank)
                a, b = _both(lambda v, g: ax.reduce_scatter(v, op, g), x, small_slots_group)
                exact = op in ("MIN", "MAX") or n == 2
                _same(a, b, exact, f"reduce_scatter {op} {np.dtype(dtype).name} {per_rank}")
    collectively(mpi_world, check)


def test_broadcast_matches_mpi(mpi_world, small_slots_group):
    def check():
        for dtype in DTYPES:
            for size in SIZES:
                x = _inputs(np.float64, size, mpi_world.rank, seed=2).astype(dtype)
                for root in range(mpi_world.world_size):
                    def bcast(v, g, root=root):
                        ax.broadcast(v, root, g)
                        return v
                    a, b = _both(bcast, x.reshape(-1, 1) if size else x, small_slots_group)
                    np.testing.assert_array_equal(a, b)
    collectively(mpi_world, check)


def test_all_gather_matches_mpi(mpi_world, small_slots_group):
    """Small all-gathers go through the slots (bits equal to MPI's); results over the cap go to MPI."""
    engine = engine_for(small_slots_group.backend, 4096, 2)
    n = mpi_world.world_size

    def gather(v, g):
        return ax.all_gather(v, g)

    def check():
        for dtype in DTYPES:
            for shape in ((0,), (1,), (3, 5), (3001,)):
                x = _inputs(np.float64, int(np.prod(shape)), mpi_world.rank, seed=6).astype(dtype).reshape(shape)
                before = engine.chunks
                a, b = _both(gather, x, small_slots_group)
                assert a.shape == b.shape == (n,) + shape and a.dtype == b.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(a, b)
                # Through the slots; an empty array takes one data-free step (the agreement check).
                assert engine.chunks - before == max(1, -(-x.nbytes // 4096)), (dtype, shape)
        x = np.full(1000, mpi_world.rank, dtype=np.float64)
        with override(shm_allgather_max_bytes=n * x.nbytes - 1):
            before = engine.chunks
            out = ax.all_gather(x, small_slots_group)
            # Over the cap: MPI carries it, after one data-free step of the agreement check in the engine.
            assert engine.chunks == before + 1
        np.testing.assert_array_equal(out, np.repeat(np.arange(n, dtype=np.float64)[:, None], 1000, axis=1))
    collectively(mpi_world, check)


def test_plain_all_reduce_is_recorded_and_follows_the_settings(mpi_world):
    """The hot path of a plain all-reduce keeps the flight record and sequence, and re-routes on a change."""
    from axonhpc.collectives import flight

    group = mpi_world.new_group(list(range(mpi_world.world_size)), name="shm-plain")

    def check():
        x = np.ones(64, dtype=np.float32)
        ax.all_reduce(x, ax.ReduceOp.SUM, group)  # the window is set up here
        engine = engine_for(group.backend, ax.settings.shm_slot_bytes, ax.settings.shm_slots)
        seq, chunks = group.seq, engine.chunks
        ax.all_reduce(x, ax.ReduceOp.MAX, group)
        assert group.seq == seq + 1 and engine.chunks == chunks + 1
        last = flight.records(mpi_world.rank)[-1]
        assert (last["group"], last["seq"], last["op"], last["reduce"], last["dtype"], last["shape"], last["done"]) == \
            ("shm-plain", seq, "all_reduce", "MAX", "float32", (64,), True)
        with override(shm_collectives="off"):  # a settings change re-routes the next call: MPI
            ax.all_reduce(x, ax.ReduceOp.SUM, group)
        assert engine.chunks == chunks + 1 and group.seq == seq + 2
        with override(debug=True):  # debug mode: the general path, which checks the call across ranks
            ax.all_reduce(x, ax.ReduceOp.SUM, group)
        assert engine.chunks == chunks + 2
        n = mpi_world.world_size
        assert np.all(x == n ** 3)
        with pytest.raises(ReadOnlyBufferError):  # refused by the general path's checks
            x.setflags(write=False)
            ax.all_reduce(x, ax.ReduceOp.SUM, group)
        # No data moved, but the refusal took its place in the call's agreement step (so that a refusal on one
        # rank alone reaches the others: issue 42), and so its number.
        assert group.seq == seq + 4 and engine.chunks == chunks + 3
        x.setflags(write=True)
        ax.all_reduce(x, ax.ReduceOp.SUM, group)  # in step
        assert np.all(x == n ** 4)
    collectively(mpi_world, check)


def test_large_messages_with_default_geometry(mpi_world):
    """Messages of several MiB cross many slots of the default geometry."""
    def check():
        for count in (3 * 2**20 + 7, 5 * 2**20):  # 12 and 20 MiB of float32
            x = _inputs(np.float32, count, mpi_world.rank, seed=3)
            a, b = _both(_all_reduce("SUM"), x, None)
            _same(a, b, mpi_world.world_size == 2, f"all_reduce of {count} float32")
    collectively(mpi_world, check)


def _placed(x, offset):
    """A copy of ``x`` whose data starts ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(x.nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    view = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    view[...] = x
    assert view.ctypes.data % 64 == offset
    return view


@pytest.mark.parametrize("offset", [0, 8, 16, 24, 40, 56])
def test_arrays_at_any_distance_from_a_cache_line(mpi_world, offset):
    """The engine copies an array that is not 64-byte aligned against the slots in pieces (byte_copy.h):
    every byte of every collective arrives, at each distance, across chunks of the default geometry."""
    n = mpi_world.world_size

    def through(call, x):
        with override(shm_collectives="auto", shm_min_bytes=0):
            a = call(_placed(x, offset))
        with override(shm_collectives="off"):
            b = call(x.copy())
        return a, b

    def check():
        x = _inputs(np.float64, 100_003, mpi_world.rank, seed=7)  # 800 KB: four chunks, the last partial
        for op in ("SUM", "MAX"):
            a, b = through(lambda v: (ax.all_reduce(v, op), v)[1], x)
            _same(a, b, op == "MAX" or n == 2, f"all_reduce {op} at offset {offset}")
        a, b = through(lambda v: (ax.broadcast(v, n - 1), v)[1], x)
        np.testing.assert_array_equal(a, b)
        blocks = _inputs(np.float64, n * 30_001, mpi_world.rank, seed=8).reshape(n, 30_001)
        a, b = through(lambda v: ax.reduce_scatter(v, "MAX"), blocks)
        np.testing.assert_array_equal(a, b)
        part = _inputs(np.float64, 7_001, mpi_world.rank, seed=9)  # under the all-gather cap at 4 ranks
        a, b = through(lambda v: ax.all_gather(v), part)
        np.testing.assert_array_equal(a, b)
    collectively(mpi_world, check)


def test_result_is_bit_identical_run_after_run(mpi_world, small_slots_group):
    """Deterministic: the reduction order is fixed, so timing cannot change the bits."""
    def check():
        x = _inputs(np.float32, 50001, mpi_world.rank, seed=4) * 1e3
        results = []
        for _ in range(5):
            y = x.copy()
            with override(shm_min_bytes=0):
                ax.all_reduce(y, "SUM", small_slots_group)
            results.append(y)
        for y in results[1:]:
            np.testing.assert_array_equal(y, results[0])
        expected = sum(_inputs(np.float32, 50001, r, seed=4) * np.float32(1e3)
                       for r in range(mpi_world.world_size))  # rank order, like the kernel
        np.testing.assert_array_equal(results[0], expected.astype(np.float32))
    collectively(mpi_world, check)


def test_async_calls_complete_and_return_results(mpi_world, small_slots_group):
    def check():
        with override(shm_min_bytes=0):
            x = np.ones(5000)
            work = ax.all_reduce(x, "AVG", small_slots_group, async_op=True)
            assert work.wait() is None and np.all(x == 1.0)
            part = ax.reduce_scatter(np.ones(4 * mpi_world.world_size), "SUM", small_slots_group, async_op=True).wait()
            assert part.shape == (4,) and np.all(part == mpi_world.world_size)
            out = np.empty(4)
            assert ax.reduce_scatter(np.ones(4 * mpi_world.world_size), "SUM", small_slots_group, out=out) is out
    collectively(mpi_world, check)


def test_a_rank_that_never_arrives_is_named(mpi_world):
    """A rank that skips the call: the others time out naming it (global rank), none hangs."""
    def check():
        with override(shm_min_bytes=0):
            group = mpi_world.new_group(list(range(mpi_world.world_size)), name="shm-timeout")
            ax.all_reduce(np.ones(8), "SUM", group)  # sets the window up on every rank
            group.timeout = 1.0
            last = mpi_world.world_size - 1
            if mpi_world.rank != last:
                with pytest.raises(CollectiveTimeoutError, match=rf"timed out.*missing ranks: \[{last}\]"):
                    ax.all_reduce(np.ones(8), "SUM", group)
    collectively(mpi_world, check)


def test_arrays_in_the_window_are_reduced_in_place(mpi_world):
    from axonhpc.backends.shm import engine_in_window

    def check():
        with override(shm_min_bytes=0):
            for dtype in (np.float32, np.float64, np.int64, np.uint8):
                for op in ("SUM", "MAX", "AVG"):
                    shared = ax.shared_memory_array((1001,), dtype)
                    assert engine_in_window(mpi_world.default_group.backend, shared) is not None
                    shared[...] = _inputs(dtype, 1001, mpi_world.rank, seed=5)
                    plain = shared.copy()
                    ax.all_reduce(shared, op)
                    with override(shm_collectives="off"):
                        ax.all_reduce(plain, op)
                    _same(shared, plain, mpi_world.world_size == 2 or op == "MAX", f"in window {op} {dtype}")
        with override(shm_collectives="off"):
            plain = ax.shared_memory_array((7,), np.float32)  # no window when shared memory is off
            assert engine_in_window(mpi_world.default_group.backend, plain) is None
    collectively(mpi_world, check)


def test_ddp_buckets_in_the_window_train_like_plain_buckets(mpi_world, monkeypatch):
    from axonhpc import nn, optim
    from axonhpc.backends.shm import engine_in_window
    from support.ddp_cases import make_data, make_model, shard

    from axonhpc.parallel.ddp import wrapper as ddp_module

    monkeypatch.setattr(ddp_module, "SHARED_BUCKETS_MIN_BYTES", 0)  # the test model is small

    def train(mode):
        with override(shm_collectives=mode):
            n, r = mpi_world.world_size, mpi_world.rank
            ddp = ax.DDP(make_model(np.float64), bucket_size_mb=300 / 2**20)
            opt = optim.Adam(ddp.parameters(), lr=1e-2)
            loss_fn = nn.CrossEntropyLoss()
            for step in range(4):
                opt.zero_grad()
                x, y = make_data(step)
                loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
                ddp.backward(loss_fn.backward())
                opt.step()
            return ddp

    def check():
        shared, plain = train("auto"), train("off")
        backend = mpi_world.default_group.backend
        assert all(engine_in_window(backend, b.buffer) is not None for b in shared._buckets)
        assert all(engine_in_window(backend, b.buffer) is None for b in plain._buckets)
        for (name, p), (_, q) in zip(shared.named_parameters(), plain.named_parameters()):
            if mpi_world.world_size == 2:
                np.testing.assert_array_equal(p.data, q.data, err_msg=name)
            else:
                np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-12, err_msg=name)
    collectively(mpi_world, check)


def test_fsdp_shards_in_the_window_train_like_private_shards(mpi_world, monkeypatch):
    """FSDP's master shards in the window: gathered with no copy in, updated in place, same training."""
    from axonhpc.backends.shm import engine_in_window
    from axonhpc.parallel.fsdp import flat_param
    from support.fsdp_cases import train_fsdp

    monkeypatch.setattr(flat_param, "SHARED_SHARDS_MIN_BYTES", 0)  # the test model is small

    def train(mode):
        with override(shm_collectives=mode):
            fsdp, _, _ = train_fsdp(mpi_world, np.float64, "adam", "full_shard")
            return fsdp, fsdp.full_state_dict(rank0_only=False)

    def check():
        (shared, shared_state), (plain, plain_state) = train("auto"), train("off")
        backend = mpi_world.default_group.backend
        assert all(engine_in_window(backend, u.shard.data) is not None for u in shared._units)  # after 4 steps
        assert all(engine_in_window(backend, u.shard.data) is None for u in plain._units)
        for name, value in plain_state.items():
            np.testing.assert_allclose(shared_state[name], value, rtol=1e-12, atol=1e-12, err_msg=name)
    collectively(mpi_world, check)


def test_all_gather_of_arrays_in_the_window(mpi_world):
    """An all-gather of a window array reads every rank's part where it lies, at any size (no cap)."""
    def check():
        n = mpi_world.world_size
        for dtype, count in ((np.float32, 1), (np.int64, 1001), (np.float64, 300_000)):
            shared = ax.shared_memory_array((count,), dtype)
            shared[...] = _inputs(dtype, count, mpi_world.rank, seed=7)
            with override(shm_allgather_max_bytes=0):  # the cap is for the slots, not for arrays in the window
                out = ax.all_gather(shared)
            expected = np.stack([_inputs(dtype, count, r, seed=7) for r in range(n)])
            np.testing.assert_array_equal(out, expected)
    collectively(mpi_world, check)
