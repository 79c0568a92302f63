"""GradientSynchronizer and the bucket plan: closed-form means on run_local worlds of 1-4 ranks."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axonhpc as ax
import axonhpc.bucketing.reducer as bucketing  # where the reducer calls all_reduce
from axonhpc._dtypes import bfloat16_dtype
from axonhpc.bucketing import GradientSynchronizer, GradSyncStrategy, plan_buckets
from axonhpc.errors import ArgumentTypeError, NonContiguousBufferError, ReadOnlyBufferError, UnsupportedDtypeError

pytestmark = pytest.mark.timeout(120)  # hang guard: a rank left waiting fails the test

SYNC, OVERLAP, NO_SYNC = GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.OVERLAPPED, GradSyncStrategy.NO_SYNC

# Mixed dtypes and sizes, a zero-size gradient, and one far above the bucket size used below.
SPECS = [((3, 4), np.float32), ((5,), np.float64), ((2,), np.float32), ((0,), np.float32),
         ((7,), np.int64), ((2, 2), np.float16), ((40,), np.float32), ((1,), np.int32),
         ((6,), np.uint8), ((3,), np.float64), ((9,), np.float32)]
if bfloat16_dtype() is not None:
    SPECS.append(((4,), bfloat16_dtype()))
BUCKET = 32  # bytes: many small buckets


def rank_grads(rank, specs=SPECS):
    """Gradient c of rank r is filled with r + c."""
    return [np.full(shape, rank + c, dtype=dtype) for c, (shape, dtype) in enumerate(specs)]


def expected_means(world_size, specs=SPECS, ranks=None):
    ranks = list(range(world_size)) if ranks is None else ranks
    out = []
    for c, (shape, dtype) in enumerate(specs):
        total = sum(r + c for r in ranks)
        value = total // len(ranks) if np.dtype(dtype).kind in "iu" else total / len(ranks)
        out.append(np.full(shape, value, dtype=dtype))
    return out


def assert_grads_equal(grads, expected):
    for g, e in zip(grads, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


# -- the bucket plan (pure) ----------------------------------------------------------------
def test_plan_example():
    f32 = np.float32
    specs = [(1, f32), (2, f32), (1, f32), (3, f32), (4, f32), (5, f32), (0, f32), (2, f32)]
    plan = plan_buckets(specs, 16)  # 4 float32 per bucket
    assert [idx for _, idx in plan] == [(0, 1, 2), (3,), (4,), (5,), (6, 7)]
    assert all(dtype == f32 for dtype, _ in plan)


def test_plan_keeps_dtypes_apart_and_counts_bytes():
    specs = [(2, np.float32), (1, np.float64), (2, np.float32), (1, np.float64), (1, np.float32)]
    plan = plan_buckets(specs, 16)  # 4 float32 or 2 float64 per bucket
    assert plan == [(np.dtype(np.float32), (0, 2)), (np.dtype(np.float64), (1, 3)), (np.dtype(np.float32), (4,))]


def test_plan_bucket_smaller_than_an_element():
    # capacity is one element: every non-empty gradient closes a bucket (an open one first)
    plan = plan_buckets([(1, np.float64), (0, np.float64), (3, np.float64), (0, np.float64)], 3)
    assert [idx for _, idx in plan] == [(0,), (1,), (2,), (3,)]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        plan_buckets([(1, np.float32)], 0)
    with pytest.raises(ValueError, match=r"specs\[1\] has negative numel -2"):
        plan_buckets([(1, np.float32), (-2, np.float32)], 8)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 12), st.sampled_from([np.float16, np.float32, np.float64])),
                   max_size=30),
    bucket_size=st.integers(1, 64),
)
def test_plan_properties(specs, bucket_size):
    plan = plan_buckets(specs, bucket_size)
    assert plan == plan_buckets(list(specs), bucket_size)  # deterministic
    assert sorted(i for _, idx in plan for i in idx) == list(range(len(specs)))
    nbytes = [n * np.dtype(d).itemsize for n, d in specs]
    last_of = {}
    for dtype, idx in plan:
        assert list(idx) == sorted(idx) and all(np.dtype(specs[i][1]) == dtype for i in idx)
        size = sum(nbytes[i] for i in idx)
        # bucket_size in whole elements, at least one
        capacity = max(1, bucket_size // dtype.itemsize) * dtype.itemsize
        assert size <= capacity or len(idx) == 1  # only a lone gradient may exceed it
        previous = last_of.get(dtype)
        if previous is not None:
            # greedy: the previous bucket of this dtype closed because the next gradient did not fit,
            # or because it was full
            assert previous + nbytes[idx[0]] > capacity or previous >= capacity
        last_of[dtype] = size


def test_strategy_parse():
    assert GradSyncStrategy.parse("overlapped") is OVERLAP
    assert GradSyncStrategy.parse("NO_SYNC") is NO_SYNC
    assert GradSyncStrategy.parse(SYNC) is SYNC
    with pytest.raises(ValueError, match="'eventually'"):
        GradSyncStrategy.parse("eventually")


def test_constructor_errors():
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        GradientSynchronizer(bucket_size=0)
    with pytest.raises(ValueError, match="unknown gradient sync strategy 'fast'"):
        GradientSynchronizer("fast")
    assert GradientSynchronizer("overlapped", bucket_size=10).strategy is OVERLAP


# -- averaging across ranks ---------------------------------------------------------------
@pytest.mark.parametrize("strategy", [SYNC, OVERLAP], ids=["sync", "overlap"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_synchronize_closed_form(world_size, strategy):
    def body(world):
        s = GradientSynchronizer(strategy, bucket_size=BUCKET)
        grads = rank_grads(world.rank)
        s.synchronize(grads)
        return grads, s.last_layout

    results = ax.run_local(body, world_size=world_size)
    plan = plan_buckets([(int(np.prod(shape)), dtype) for shape, dtype in SPECS], BUCKET)
    for grads, layout in results:
        assert_grads_equal(grads, expected_means(world_size))
        assert list(layout) == plan


@pytest.mark.parametrize("strategy", [SYNC, OVERLAP], ids=["sync", "overlap"])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_push_finish_closed_form(world_size, strategy):
    def body(world):
        s = GradientSynchronizer(strategy, bucket_size=BUCKET, group=world.default_group)
        grads = rank_grads(world.rank)
        for g in grads:
            s.push(g)
        s.finish(timeout=60)
        return grads, s.last_layout

    results = ax.run_local(body, world_size=world_size)
    plan = plan_buckets([(int(np.prod(shape)), dtype) for shape, dtype in SPECS], BUCKET)
    for grads, layout in results:
        assert_grads_equal(grads, expected_means(world_size))
        assert list(layout) == plan


def test_one_all_reduce_per_bucket_and_overlapped_starts_before_finish(monkeypatch):
    calls = []
    lock = threading.Lock()
    real = bucketing.all_reduce

    def counting(x, op, group=None, async_op=False):
        with lock:
            calls.append((threading.current_thread().name, x.size, async_op))
        return real(x, op, group, async_op=async_op)

    monkeypatch.setattr(bucketing, "all_reduce", counting)
    specs = [((10,), np.float32)] * 3 + [((5,), np.float64)]

    def body(world):
        s = GradientSynchronizer(OVERLAP, bucket_size=40)  # each float32 gradient fills a bucket
        grads = rank_grads(world.rank, specs)
        s.push(grads[0])
        with lock:
            started = sum(1 for name, _, _ in calls if name == threading.current_thread().name)
        for g in grads[1:]:
            s.push(g)
        s.finish()
        return started, grads

    results = ax.run_local(body, world_size=2)
    assert [started for started, _ in results] == [1, 1]  # the full bucket went out at push time
    for _, grads in results:
        assert_grads_equal(grads, expected_means(2, specs))
    assert sorted(size for _, size, _ in calls) == [5, 5, 10, 10, 10, 10, 10, 10]
    assert all(async_op for _, _, async_op in calls)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_overlapped_equals_synchronous_bit_for_bit(world_size):
    dtypes = [np.float32, np.float16, np.float64] + ([bfloat16_dtype()] if bfloat16_dtype() is not None else [])
    shapes = [(33,), (4, 5), (129,), (7,), (2, 3, 2)]

    def body(world):
        rng = np.random.default_rng(1000 + world.rank)
        base = [rng.standard_normal(shape).astype(dtypes[i % len(dtypes)]) for i, shape in enumerate(shapes * 3)]
        copies = {name: [g.copy() for g in base] for name in ("sync", "overlap", "push")}
        GradientSynchronizer(SYNC, bucket_size=100).synchronize(copies["sync"])
        GradientSynchronizer(OVERLAP, bucket_size=100).synchronize(copies["overlap"])
        pusher = GradientSynchronizer(OVERLAP, bucket_size=100)
        for g in copies["push"]:
            pusher.push(g)
        pusher.finish()
        return {name: [g.tobytes() for g in grads] for name, grads in copies.items()}

    results = ax.run_local(body, world_size=world_size)
    for result in results:
        assert result["sync"] == result["overlap"] == result["push"]
        assert result["sync"] == results[0]["sync"]  # every rank holds the same average


def test_gradient_larger_than_bucket_size_gets_its_own_bucket():
    specs = [((2,), np.float32), ((1000,), np.float32), ((3,), np.float32)]

    def body(world):
        s = GradientSynchronizer(SYNC, bucket_size=64)
        grads = rank_grads(world.rank, specs)
        s.synchronize(grads)
        return grads, s.last_layout

    for grads, layout in ax.run_local(body, world_size=3):
        assert_grads_equal(grads, expected_means(3, specs))
        assert [idx for _, idx in layout] == [(0,), (1,), (2,)]


def test_subgroup_is_forwarded():
    def body(world):
        group = world.new_group([1, 2, 3])
        grads = rank_grads(world.rank)
        if group.is_member:
            GradientSynchronizer(OVERLAP, bucket_size=BUCKET, group=group).synchronize(grads)
        return grads

    results = ax.run_local(body, world_size=4)
    assert_grads_equal(results[0], rank_grads(0))
    for grads in results[1:]:
        assert_grads_equal(grads, expected_means(4, ranks=[1, 2, 3]))


def test_buffers_are_reused_across_steps():
    def body(world):
        s = GradientSynchronizer(SYNC, bucket_size=BUCKET)
        s.synchronize(rank_grads(world.rank))
        first = {key: id(kept[0]) for key, kept in s._buffers.items()}
        s.synchronize(rank_grads(world.rank))  # new arrays, same sizes and dtypes
        o = GradientSynchronizer(OVERLAP, bucket_size=BUCKET)
        o._buffers = s._buffers
        for g in rank_grads(world.rank):
            o.push(g)
        o.finish()
        return first, {key: id(kept[0]) for key, kept in s._buffers.items()}

    for first, later in ax.run_local(body, world_size=2):
        assert first and first == later


def test_zero_size_buckets_send_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("all_reduce must not be called for empty buckets")

    monkeypatch.setattr(bucketing, "all_reduce", refuse)
    s = GradientSynchronizer(OVERLAP, bucket_size=8)
    grads = [np.zeros(0, np.float32), np.zeros((0, 3), np.float64)]
    s.synchronize(grads)
    assert [idx for _, idx in s.last_layout] == [(0,), (1,)]


# -- NO_SYNC and errors: nothing is sent ------------------------------------------------
@pytest.fixture
def no_communication(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("all_reduce was called")

    monkeypatch.setattr(bucketing, "all_reduce", refuse)


def test_no_sync_leaves_values_untouched(no_communication):
    s = GradientSynchronizer(NO_SYNC, bucket_size=BUCKET)
    grads = rank_grads(3)
    s.synchronize(grads)
    for g in grads:
        s.push(g)
    s.finish()
    assert_grads_equal(grads, rank_grads(3))


def _read_only(shape=(3,)):
    a = np.ones(shape)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("bad, error, text", [
    (_read_only(), ReadOnlyBufferError, "read-only"),
    (np.ones((4, 4))[:, 1], NonContiguousBufferError, "not C-contiguous"),
    (np.ones(3, np.complex64), UnsupportedDtypeError, "complex64"),
    ([1.0, 2.0], UnsupportedDtypeError, "must be a numpy array"),
])
def test_bad_gradient_is_refused_before_sending(no_communication, bad, error, text):
    good = [np.ones(2, np.float32) for _ in range(5)]
    for strategy in (SYNC, OVERLAP):
        with pytest.raises(error, match=rf"grads\[5\].*{text}"):
            GradientSynchronizer(strategy, bucket_size=8).synchronize(good + [bad])
    pusher = GradientSynchronizer(OVERLAP, bucket_size=1 << 20)
    pusher.push(good[0])
    with pytest.raises(error, match=rf"gradient 1.*{text}"):
        pusher.push(bad)


def test_synchronize_refuses_an_unfinished_push(no_communication):
    s = GradientSynchronizer(OVERLAP, bucket_size=1 << 20)
    s.push(np.ones(2))
    with pytest.raises(RuntimeError, match="1 pushed gradients are not finished"):
        s.synchronize([np.ones(2)])


def test_overlapped_wait_honours_the_group_timeout():
    from axonhpc.backends.local import LocalAbort
    from axonhpc.errors import CollectiveTimeoutError

    def body(world):
        if world.rank == 0:
            world.default_group.timeout = 0.3
            s = GradientSynchronizer(OVERLAP, bucket_size=8)
            with pytest.raises(CollectiveTimeoutError, match=r"missing ranks: \[1\]"):
                s.synchronize([np.ones(2, np.float32)])  # rank 1 never joins
            world.backend.abort_quietly("test over")
        else:
            with pytest.raises(LocalAbort):
                ax.recv(np.empty(1), 0)  # waits until rank 0 ends the world
        return True

    assert ax.run_local(body, world_size=2) == [True, True]


def test_dtype_groups_keep_first_seen_order_and_split_by_library():
    """One helper groups arrays by dtype for every flat message (sync_gradients, broadcast_arrays, ZeRO's and the
    parameter server's shards): a dtype's group comes where its first array is, and device arrays never join host
    ones of the same dtype (they cannot share a flat buffer)."""
    from axonhpc._dtypes import dtype_groups
    from support.strict_cupy import device

    a32, b64, c32, d64 = np.ones(2, np.float32), np.ones(3), np.zeros(4, np.float32), np.zeros(1)
    assert [[x is y for x, y in zip(g, want)] for g, want in zip(dtype_groups([b64, a32, d64, c32]),
                                                                 [[b64, d64], [a32, c32]])] == [[True, True]] * 2
    on_device = device(np.ones(2, np.float32))
    groups = dtype_groups([a32, on_device, c32])
    assert [len(g) for g in groups] == [2, 1] and groups[1][0] is on_device
    boxes = [type("P", (), {"data": x})() for x in (a32, b64)]
    assert [g[0].data.dtype for g in dtype_groups(boxes, lambda p: p.data)] == [np.float32, np.float64]
    assert dtype_groups([]) == []


@pytest.mark.parametrize("bucket_size", [1.5, "25MB"])
def test_bucket_size_must_be_an_integer(bucket_size):
    with pytest.raises(ArgumentTypeError, match=f"bucket_size must be an int .*got {type(bucket_size).__name__}"):
        plan_buckets([(3, np.float32)], bucket_size)
    with pytest.raises(ArgumentTypeError, match="bucket_size must be an int"):
        GradientSynchronizer(bucket_size=bucket_size)
