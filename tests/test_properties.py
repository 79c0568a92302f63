"""Property-based tests of the public API against numpy references (hypothesis).

Collectives run on the in-process backend (``ax.run_local``: threads as
ranks) with random world sizes 1-4, subgroups (random member lists in random
order), dtypes, shapes (0-d, empty and one-element included), reduce ops,
roots, blocking or async calls, with or without a group timeout, and the
all-reduce algorithms; the compiled buffers (bucket, pack, shard arithmetic,
gradient synchronizer) with random sizes. Values are multiples of 1/8 small
enough that every sum and product is exact in every float dtype, so the
results are compared with the reference bit for bit, whatever the order of
the additions.

Invalid arguments must raise the exception the docstrings name, on every
rank, before anything is sent: no hang (``run`` fails an example that takes
longer than ``HANG_LIMIT`` and the file has a pytest-timeout), no crash, no
garbage.
"""
import functools
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import axonhpc as ax
from axonhpc._dtypes import bfloat16_dtype, is_low_precision_float, supported_dtypes
from axonhpc.bucketing import (
    FlatLayout,
    GradientBucket,
    GradientSynchronizer,
    flatten_into_padded,
    pack,
    padded_size,
    plan_buckets,
    shard_bounds,
    shard_size,
    shard_view,
    unflatten,
    unpack,
)
from axonhpc.collectives.ring import chunk_offsets
from axonhpc.errors import (
    CollectiveMismatchError,
    NonContiguousBufferError,
    NotAMemberError,
    RankError,
    ReadOnlyBufferError,
    ShapeError,
    UnsupportedDtypeError,
)

pytestmark = pytest.mark.timeout(300)  # the last line of defence; run() catches a hang first

DTYPES = list(supported_dtypes())  # float16/32/64, int32/64, uint8, and bfloat16 with ml_dtypes
OPS = list(ax.ReduceOp)
HANG_LIMIT = 60.0  # seconds one example's run_local may take before it counts as a hang
EXAMPLES = 100
PROFILE = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)  # (), (0,), (1,), (1, 1), ...
dtypes = st.sampled_from(DTYPES)
world_sizes = st.integers(1, 4)


@st.composite
def member_lists(draw, n):
    """The global ranks of a subgroup: a non-empty selection of range(n) in any order."""
    order = draw(st.permutations(range(n)))
    return list(order[:draw(st.integers(1, n))])


# ------------------------------------------------------------------------------------ helpers

def run(n, body):
    """``ax.run_local(body, world_size=n)``, failing (not hanging) if it takes longer than HANG_LIMIT."""
    box = {}

    def target():
        try:
            box["result"] = ax.run_local(body, world_size=n)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_LIMIT)
    if thread.is_alive():
        pytest.fail(f"run_local(world_size={n}) did not finish in {HANG_LIMIT} s: a hang")
    if "error" in box:
        raise box["error"]
    return box["result"]


def values(seed, rank, shape, dtype):
    """Per-rank data whose sums and products over 4 ranks are exact in every supported dtype."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "u":
        return np.array(rng.integers(0, 10, size=shape), dtype=dtype)
    if dtype.kind == "i":
        return np.array(rng.integers(-9, 10, size=shape), dtype=dtype)
    return np.array(rng.integers(-31, 32, size=shape) / 8, dtype=dtype)  # a 0-d array, never a numpy scalar


_UFUNC = {ax.ReduceOp.SUM: np.add, ax.ReduceOp.AVG: np.add, ax.ReduceOp.PRODUCT: np.multiply,
          ax.ReduceOp.MIN: np.minimum, ax.ReduceOp.MAX: np.maximum}


def reference(xs, op, dtype):
    """The documented result: 16-bit floats reduced in float32 and rounded once; AVG = SUM / n (floor for ints)."""
    dtype = np.dtype(dtype)
    work = [x.astype(np.float32) if is_low_precision_float(dtype) else x for x in xs]
    total = functools.reduce(_UFUNC[op], work[1:], work[0].copy())
    if op is ax.ReduceOp.AVG:
        total = total // len(xs) if dtype.kind in "iu" else total / len(xs)
    return np.asarray(total).astype(dtype)


def same(got, want):
    """Equal dtype, shape and bytes (so -0.0 and 0.0 differ, as they should not here)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert got.tobytes() == want.tobytes(), (got, want)


def group_for(world, members):
    """The subgroup of ``members`` (every rank calls new_group); the default group if it is everyone in order."""
    if members == list(range(world.world_size)):
        return world.default_group
    return world.new_group(members)


def finish(result, async_op):
    return result.wait() if async_op else result


def maybe_timeout(pg, timeout):
    if pg.is_member and timeout is not None:
        pg.timeout = timeout  # exercises the watched wait of collectives.watch


# ------------------------------------------------------------------------------------ collectives

@PROFILE
@given(data=st.data(), n=world_sizes, dtype=dtypes, shape=shapes, op=st.sampled_from(OPS),
       async_op=st.booleans(), timeout=st.sampled_from([None, 30.0]), seed=st.integers(0, 2**16),
       algorithm=st.sampled_from(["native", "native", "ring", "rhd", "hierarchical"]))
def test_all_reduce_matches_numpy(data, n, dtype, shape, op, async_op, timeout, seed, algorithm):
    members = data.draw(member_lists(n))
    size = len(members)

    def body(world):
        pg = group_for(world, members)
        maybe_timeout(pg, timeout)
        x = values(seed, max(pg.rank, 0), shape, dtype)
        if not pg.is_member:
            with pytest.raises(NotAMemberError):
                ax.all_reduce(x, op, group=pg)
            return None
        out = ax.all_reduce(x, op, group=pg, async_op=async_op, algorithm=algorithm)
        if async_op:
            out.wait()
        else:
            assert out is None
        return x

    results = run(n, body)
    want = reference([values(seed, r, shape, dtype) for r in range(size)], op, dtype)
    for g in members:
        same(results[g], want)


@PROFILE
@given(data=st.data(), n=world_sizes, dtype=dtypes, shape=shapes, async_op=st.booleans(),
       timeout=st.sampled_from([None, 30.0]), seed=st.integers(0, 2**16))
def test_broadcast_matches_numpy(data, n, dtype, shape, async_op, timeout, seed):
    members = data.draw(member_lists(n))
    src = data.draw(st.integers(0, len(members) - 1))

    def body(world):
        pg = group_for(world, members)
        maybe_timeout(pg, timeout)
        x = values(seed, max(pg.rank, 0), shape, dtype)
        if not pg.is_member:
            with pytest.raises(NotAMemberError):
                ax.broadcast(x, src=0, group=pg)
            return None
        finish(ax.broadcast(x, src=src, group=pg, async_op=async_op), async_op)
        return x

    results = run(n, body)
    for g in members:
        same(results[g], values(seed, src, shape, dtype))


@PROFILE
@given(data=st.data(), n=world_sizes, dtype=dtypes, shape=shapes, async_op=st.booleans(),
       timeout=st.sampled_from([None, 30.0]), seed=st.integers(0, 2**16))
def test_all_gather_and_gather_match_numpy(data, n, dtype, shape, async_op, timeout, seed):
    members = data.draw(member_lists(n))
    dst = data.draw(st.integers(0, len(members) - 1))

    def body(world):
        pg = group_for(world, members)
        maybe_timeout(pg, timeout)
        x = values(seed, max(pg.rank, 0), shape, dtype)
        if not pg.is_member:
            with pytest.raises(NotAMemberError):
                ax.all_gather(x, group=pg)
            with pytest.raises(NotAMemberError):
                ax.gather(x, dst=0, group=pg)
            return None
        everyone = finish(ax.all_gather(x, group=pg, async_op=async_op), async_op)
        at_dst = finish(ax.gather(x, dst=dst, group=pg, async_op=async_op), async_op)
        return everyone, at_dst, pg.rank

    results = run(n, body)
    want = np.stack([values(seed, r, shape, dtype) for r in range(len(members))])
    for g in members:
        everyone, at_dst, rank = results[g]
        same(everyone, want)
        if rank == dst:
            same(at_dst, want)
        else:
            assert at_dst is None


@PROFILE
@given(data=st.data(), n=world_sizes, dtype=dtypes, rows=st.integers(0, 3), tail=shapes.map(lambda s: s[:2]),
       op=st.sampled_from(OPS), async_op=st.booleans(), timeout=st.sampled_from([None, 30.0]),
       seed=st.integers(0, 2**16))
def test_reduce_scatter_matches_numpy(data, n, dtype, rows, tail, op, async_op, timeout, seed):
    members = data.draw(member_lists(n))
    size = len(members)
    shape = (rows * size,) + tail

    def body(world):
        pg = group_for(world, members)
        maybe_timeout(pg, timeout)
        x = values(seed, max(pg.rank, 0), shape, dtype)
        if not pg.is_member:
            with pytest.raises(NotAMemberError):
                ax.reduce_scatter(x, op, group=pg)
            return None
        return finish(ax.reduce_scatter(x, op, group=pg, async_op=async_op), async_op), pg.rank

    results = run(n, body)
    full = reference([values(seed, r, shape, dtype) for r in range(size)], op, dtype)
    for g in members:
        part, rank = results[g]
        same(part, full[rank * rows:(rank + 1) * rows])


@PROFILE
@given(data=st.data(), n=world_sizes, dtype=dtypes, tail=shapes, async_op=st.booleans(),
       timeout=st.sampled_from([None, 30.0]), seed=st.integers(0, 2**16))
def test_scatter_matches_numpy(data, n, dtype, tail, async_op, timeout, seed):
    members = data.draw(member_lists(n))
    size = len(members)
    src = data.draw(st.integers(0, size - 1))
    whole = values(seed, 99, (size,) + tail, dtype)

    def body(world):
        pg = group_for(world, members)
        maybe_timeout(pg, timeout)
        if not pg.is_member:
            with pytest.raises(NotAMemberError):
                ax.scatter(whole.copy(), src=0, group=pg)
            return None
        x = whole.copy() if pg.rank == src else None
        return finish(ax.scatter(x, src=src, group=pg, async_op=async_op), async_op), pg.rank

    results = run(n, body)
    for g in members:
        part, rank = results[g]
        same(part, whole[rank])


def test_reduce_scatter_of_parts_with_a_zero_dimension():
    """Found by the property above: the in-process backend reshaped (n, -1, 0), which numpy refuses."""
    parts = run(3, lambda world: ax.reduce_scatter(np.zeros((6, 0), np.float32)))
    assert [p.shape for p in parts] == [(2, 0)] * 3


def test_the_in_process_backend_only_reads_a_broadcast_source():
    """Found by the property below: the in-process backend wrote the result back into the source buffer.

    The collective layer now refuses a read-only broadcast buffer on every rank (issue 18), so the backend
    itself is called here, with a read-only source."""
    from axonhpc.backends import LocalBackend

    backends = LocalBackend.create_world(3)

    def body(world):
        x = np.full(3, 7.0) if world.rank == 1 else np.zeros(3)
        x.flags.writeable = world.rank != 1
        backends[world.rank].broadcast(x, 1, async_op=False)
        return x.tolist()

    assert run(3, body) == [[7.0] * 3] * 3


def test_a_read_only_broadcast_buffer_is_refused_on_every_rank_the_source_included():
    def body(world):
        x = np.full(3, 7.0)
        x.flags.writeable = False
        with pytest.raises(ReadOnlyBufferError, match=f"on group rank {world.rank}"):
            ax.broadcast(x, src=1)
        y = np.ones(1)
        ax.all_reduce(y)  # nothing was sent: every rank is still in step
        return float(y[0])

    assert run(3, body) == [3.0] * 3


# ------------------------------------------------------------------------------------ invalid arguments

BAD_ROOTS = st.one_of(st.integers(-5, -1), st.integers(4, 9), st.sampled_from([True, False, 1.0, "0", None, 2**70]))


@PROFILE
@given(data=st.data(), n=world_sizes, root=BAD_ROOTS, which=st.sampled_from(["broadcast", "gather", "scatter"]))
def test_bad_roots_raise_rank_error_on_every_rank(data, n, root, which):
    members = data.draw(member_lists(n))
    if isinstance(root, int) and not isinstance(root, bool) and 0 <= root < len(members):
        root = len(members)  # an in-range draw: make it the first out-of-range rank instead

    def body(world):
        pg = group_for(world, members)
        if not pg.is_member:
            return "not a member"
        x = np.zeros((pg.size, 2))
        with pytest.raises(RankError) as info:
            if which == "broadcast":
                ax.broadcast(x, src=root, group=pg)
            elif which == "gather":
                ax.gather(x, dst=root, group=pg)
            else:
                ax.scatter(x, src=root, group=pg)
        assert repr(root) in str(info.value) or str(root) in str(info.value)
        y = np.ones(1)
        ax.all_reduce(y, group=pg)  # nothing was sent: the group is still in step
        return float(y[0])

    results = run(n, body)
    assert [results[g] for g in members] == [float(len(members))] * len(members)


BAD_BUFFERS = {
    "int16": (lambda: np.zeros(4, np.int16), UnsupportedDtypeError),
    "bool": (lambda: np.zeros(4, bool), UnsupportedDtypeError),
    "complex64": (lambda: np.zeros(4, np.complex64), UnsupportedDtypeError),
    "object": (lambda: np.array([None] * 4, dtype=object), UnsupportedDtypeError),
    "list": (lambda: [0.0] * 4, UnsupportedDtypeError),
    "strided": (lambda: np.zeros((4, 4))[:, ::2], NonContiguousBufferError),
    "fortran": (lambda: np.asfortranarray(np.zeros((4, 3))), NonContiguousBufferError),
    "read-only": (lambda: _frozen(np.zeros(4)), ReadOnlyBufferError),
}


def _frozen(a):
    a.flags.writeable = False
    return a


@PROFILE
@given(data=st.data(), n=world_sizes, bad=st.sampled_from(sorted(BAD_BUFFERS)),
       which=st.sampled_from(["all_reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "scatter"]))
def test_bad_buffers_raise_the_documented_error_before_sending(data, n, bad, which):
    """Every member passes the same bad buffer: every member raises the documented error, and the group
    is still in step afterwards (nothing was sent). A read-only input of an operation that only reads it
    is accepted and gives the right result; a broadcast buffer is written on every rank but the source, so a
    read-only one is refused on every rank, the source included."""
    members = data.draw(member_lists(n))
    make, error = BAD_BUFFERS[bad]

    def body(world):
        pg = group_for(world, members)
        if not pg.is_member:
            return "not a member"
        src = pg.size - 1
        x = make()
        if which == "scatter" and pg.rank != src:
            x = None  # only the source's argument counts; the source's error reaches every rank
        call = {
            "all_reduce": lambda: ax.all_reduce(x, group=pg),
            "broadcast": lambda: ax.broadcast(x, src=src, group=pg),
            "all_gather": lambda: ax.all_gather(x, group=pg),
            "gather": lambda: ax.gather(x, dst=src, group=pg),
            "reduce_scatter": lambda: ax.reduce_scatter(x, group=pg),
            "scatter": lambda: ax.scatter(x, src=src, group=pg),
        }[which]
        expected = error
        if error is ReadOnlyBufferError and which not in ("all_reduce", "broadcast"):
            expected = None  # these only read their input
        if expected is None and which == "reduce_scatter" and np.shape(make())[0] % pg.size:
            expected = ShapeError
        if expected is None and which == "scatter" and np.shape(make())[0] != pg.size:
            expected = ShapeError
        if which == "scatter" and expected is not None and pg.rank != src:
            expected = ShapeError  # the others hear "the source array on group rank ... was invalid"
        if expected is None:
            result = call()
            return "ok" if result is None or isinstance(result, np.ndarray) else repr(result)
        with pytest.raises(expected):
            call()
        y = np.ones(1)
        ax.all_reduce(y, group=pg)  # nobody was left waiting inside the failed call
        return float(y[0])

    results = [r for r in run(n, body) if r != "not a member"]
    assert len(set(results)) == 1, results


@PROFILE
@given(n=st.integers(2, 4), rows=st.integers(0, 5), which=st.sampled_from(["reduce_scatter", "scatter", "0-d"]))
def test_shape_errors_are_raised_on_every_rank(n, rows, which):
    if which == "reduce_scatter" and rows % n == 0:
        rows += 1

    def body(world):
        if which == "reduce_scatter":
            with pytest.raises(ShapeError, match=rf"\({rows},\) must have a first dimension divisible"):
                ax.reduce_scatter(np.zeros(rows))
        elif which == "0-d":
            with pytest.raises(ShapeError):
                ax.reduce_scatter(np.array(1.0))
            with pytest.raises(ShapeError):
                ax.scatter(np.array(1.0) if world.rank == 0 else None)
        else:
            leading = rows if rows != n else n + 1
            with pytest.raises(ShapeError, match=f"group size {n}|source array on group rank 0"):
                ax.scatter(np.zeros((leading, 2)) if world.rank == 0 else None)
        return True

    assert run(n, body) == [True] * n


@PROFILE
@given(n=st.integers(2, 4), which=st.sampled_from(["all_reduce", "broadcast", "all_gather", "gather",
                                                     "reduce_scatter"]),
       odd=st.sampled_from(["shape", "dtype", "root"]), debug=st.booleans(), rank=st.integers(0, 3))
def test_cross_rank_mismatches_raise_on_every_rank(n, which, odd, debug, rank):
    """One rank passes another shape, dtype or root: every rank raises CollectiveMismatchError, none hangs."""
    rank %= n
    if odd == "root" and which not in ("broadcast", "gather"):
        odd = "shape"

    def body(world):
        pg = world.split(0) if debug else world.default_group
        pg.debug = debug
        mine = world.rank == rank
        shape = (2 * n + (2 * n if mine and odd == "shape" else 0), 3)
        # float64 against int32: neither is widened, so the backends see different dtypes
        x = np.zeros(shape, dtype=np.int32 if mine and odd == "dtype" else np.float64)
        root = (1 if mine else 0) if odd == "root" else 0
        with pytest.raises(CollectiveMismatchError, match="ranks disagree|collective mismatch"):
            {
                "all_reduce": lambda: ax.all_reduce(x, group=pg),
                "broadcast": lambda: ax.broadcast(x, src=root, group=pg),
                "all_gather": lambda: ax.all_gather(x, group=pg),
                "gather": lambda: ax.gather(x, dst=root, group=pg),
                "reduce_scatter": lambda: ax.reduce_scatter(x, group=pg),
            }[which]()
        pg.debug = False
        y = np.ones(1)
        ax.all_reduce(y, group=pg)
        return float(y[0])

    assert run(n, body) == [float(n)] * n


@PROFILE
@given(n=world_sizes, ranks=st.lists(st.integers(-3, 6), min_size=0, max_size=5))
def test_new_group_rejects_bad_rank_lists(n, ranks):
    valid = bool(ranks) and all(0 <= r < n for r in ranks) and len(set(ranks)) == len(ranks)

    def body(world):
        if valid:
            pg = world.new_group(ranks)
            assert pg.is_member == (world.rank in ranks) and pg.ranks == tuple(ranks)
            return pg.rank
        with pytest.raises(RankError):
            world.new_group(ranks)
        return None

    results = run(n, body)
    if valid:
        assert [results[g] for g in ranks] == list(range(len(ranks)))


# ------------------------------------------------------------------------------------ compiled buffers

@PROFILE
@given(dtype=dtypes, shapes_=st.lists(shapes, max_size=6), capacity=st.integers(1, 40), seed=st.integers(0, 99))
def test_gradient_bucket_matches_a_list_model(dtype, shapes_, capacity, seed):
    bucket = GradientBucket(capacity, dtype)
    kept, used = [], 0
    for i, shape in enumerate(shapes_):
        a = values(seed, i, shape, dtype)
        fits = used + a.size <= capacity
        assert bucket.add(a) is fits
        if fits:
            kept.append(a)
            used += a.size
    assert bucket.size == used and len(bucket) == len(kept) and bucket.is_full() == (used == capacity)
    flat = np.concatenate([a.reshape(-1) for a in kept]) if kept else np.empty(0, dtype)
    same(bucket.data, flat.astype(dtype))
    for got, want in zip(bucket.extract(), kept):
        same(got, want)


@PROFILE
@given(capacity=st.integers(-2**63, 0))
def test_gradient_bucket_rejects_non_positive_capacities(capacity):
    with pytest.raises(ValueError, match="at least 1 element"):
        GradientBucket(capacity)


@PROFILE
@given(dtype=dtypes, shapes_=st.lists(shapes, min_size=1, max_size=6), seed=st.integers(0, 99),
       bad=st.sampled_from([None, "short out", "long out", "2-d out", "other dtype", "read-only out"]))
def test_pack_and_unpack_match_numpy(dtype, shapes_, seed, bad):
    arrays = [values(seed, i, s, dtype) for i, s in enumerate(shapes_)]
    total = sum(a.size for a in arrays)
    want = np.concatenate([a.reshape(-1) for a in arrays]).astype(dtype)
    if bad is None:
        same(pack(arrays), want)
        outs = [np.zeros(a.shape, dtype) for a in arrays]
        unpack(want.copy(), outs)
        for got, a in zip(outs, arrays):
            same(got, a)
        return
    other = np.float64 if np.dtype(dtype) != np.float64 else np.float32
    out = {"short out": lambda: np.empty(max(total - 1, 0), dtype), "long out": lambda: np.empty(total + 1, dtype),
           "2-d out": lambda: np.empty((1, total), dtype), "other dtype": lambda: np.empty(total, other),
           "read-only out": lambda: _frozen(np.empty(total, dtype))}[bad]()
    error = {"other dtype": UnsupportedDtypeError, "read-only out": ReadOnlyBufferError}.get(bad, ShapeError)
    if bad == "short out" and total == 0:
        error = None  # an empty out is exactly right for empty arrays
    if error is None:
        same(pack(arrays, out=out), want)
        return
    with pytest.raises(error):
        pack(arrays, out=out)
    if bad != "read-only out":
        with pytest.raises(error):
            unpack(out, [np.zeros(a.shape, dtype) for a in arrays])


@PROFILE
@given(numel=st.one_of(st.integers(0, 10**6), st.integers(0, 2**62)), world_size=st.integers(1, 2**20))
def test_shard_bounds_tile_the_padded_buffer(numel, world_size):
    chunk = shard_size(numel, world_size)
    assert chunk * world_size >= numel > (chunk - 1) * world_size or numel == 0
    assert padded_size(numel, world_size) == chunk * world_size
    for rank in {0, world_size // 2, world_size - 1}:
        start, stop, pad = shard_bounds(numel, rank, world_size)
        assert (start, stop) == (rank * chunk, (rank + 1) * chunk)
        assert pad == stop - min(max(numel, start), stop) and 0 <= pad <= chunk


INT64 = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(2**63 - 2**16, 2**63 - 1), st.integers(-4, 2**20))


@PROFILE
@example(numel=2**63 - 1, rank=1, world_size=2)  # ceil(numel / 2) by (numel + 1) // 2 overflows
@example(numel=10, rank=2**62, world_size=2**63 - 1)
@example(numel=2**63 - 1, rank=2, world_size=3)  # stop = 3 * ceil(numel / 3) > PY_SSIZE_T_MAX
@given(numel=INT64, rank=INT64, world_size=INT64)
def test_shard_arithmetic_rejects_bad_arguments_or_answers_exactly(numel, rank, world_size):
    """Over the whole int64 range: a documented error, or the exact answer (never an overflowed one)."""
    if numel < 0 or world_size < 1:
        with pytest.raises(ValueError):
            shard_bounds(numel, rank, world_size)
        return
    if not 0 <= rank < world_size:
        with pytest.raises(RankError):
            shard_bounds(numel, rank, world_size)
        return
    chunk = -(-numel // world_size)
    start, stop = rank * chunk, (rank + 1) * chunk
    assert shard_size(numel, world_size) == chunk
    if chunk * world_size > 2**63 - 1:
        with pytest.raises(OverflowError):
            padded_size(numel, world_size)
    else:
        assert padded_size(numel, world_size) == chunk * world_size
    if stop > 2**63 - 1:
        with pytest.raises(OverflowError):
            shard_bounds(numel, rank, world_size)
        return
    assert shard_bounds(numel, rank, world_size) == (start, stop, stop - min(max(numel, start), stop))


@PROFILE
@given(dtype=dtypes, shapes_=st.lists(shapes, min_size=1, max_size=5), world_size=st.integers(1, 6),
       seed=st.integers(0, 99))
def test_flatten_shard_unflatten_round_trip(dtype, shapes_, world_size, seed):
    arrays = [values(seed, i, s, dtype) for i, s in enumerate(shapes_)]
    flat, layout = flatten_into_padded(arrays, world_size)
    assert flat.size == layout.padded_numel == padded_size(layout.numel, world_size)
    assert not flat[layout.numel:].any()
    pieces = [shard_view(flat, r, world_size) for r in range(world_size)]
    same(np.concatenate(pieces), flat)
    for got, want in zip(unflatten(flat, layout), arrays):
        same(got, want)


@PROFILE
@given(shapes_=st.lists(st.lists(st.integers(-3, 4), max_size=3).map(tuple), min_size=1, max_size=4),
       world_size=st.integers(1, 4))
def test_flat_layout_refuses_negative_dimensions(shapes_, world_size):
    if any(d < 0 for s in shapes_ for d in s):
        with pytest.raises(ValueError, match="negative"):
            FlatLayout(shapes_, np.float32, world_size)
    else:
        layout = FlatLayout(shapes_, np.float32, world_size)
        assert layout.numel == sum(int(np.prod(s)) for s in shapes_) and min(layout.sizes) >= 0


@PROFILE
@given(n=st.integers(0, 200), parts=st.integers(1, 12))
def test_chunk_offsets_tile_the_array(n, parts):
    off = chunk_offsets(n, parts)
    sizes = np.diff(off)
    assert off[0] == 0 and off[-1] == n and len(off) == parts + 1
    assert sizes.max() - sizes.min() <= 1 and list(sizes) == sorted(sizes, reverse=True)


@PROFILE
@given(specs=st.lists(st.tuples(st.integers(0, 50), st.sampled_from(DTYPES)), max_size=10),
       bucket_size=st.one_of(st.integers(1, 64), st.integers(65, 4096)),
       first=st.one_of(st.none(), st.integers(1, 64)))
def test_plan_buckets_is_a_partition_in_order(specs, bucket_size, first):
    plan = plan_buckets(specs, bucket_size, first)
    flat = sorted(i for _, idx in plan for i in idx)
    assert flat == list(range(len(specs)))
    for dtype, idx in plan:
        assert all(np.dtype(specs[i][1]) == dtype for i in idx) and list(idx) == sorted(idx)
        elements = sum(specs[i][0] for i in idx)
        if len(idx) > 1:  # a bucket of several never exceeds its capacity (a big one gets its own)
            assert elements <= max(1, max(bucket_size, first or 0) // np.dtype(dtype).itemsize)


@PROFILE
@given(bucket_size=st.integers(-2**63, 0))
def test_plan_buckets_and_synchronizer_reject_bad_bucket_sizes(bucket_size):
    with pytest.raises(ValueError, match="at least 1 byte"):
        plan_buckets([(3, np.float32)], bucket_size)
    with pytest.raises(ValueError, match="at least 1 byte"):
        GradientSynchronizer(bucket_size=bucket_size)
    with pytest.raises(ValueError, match="negative numel"):
        plan_buckets([(-1, np.float32)], 16)


@PROFILE
@given(n=world_sizes, specs=st.lists(st.tuples(shapes, dtypes), min_size=1, max_size=6),
       bucket_size=st.integers(1, 256), strategy=st.sampled_from(["synchronous", "overlapped"]),
       seed=st.integers(0, 2**16), pushed=st.booleans())
def test_gradient_synchronizer_averages_like_numpy(n, specs, bucket_size, strategy, seed, pushed):
    def body(world):
        grads = [values(seed + i, world.rank, shape, dtype) for i, (shape, dtype) in enumerate(specs)]
        sync = GradientSynchronizer(strategy, bucket_size=bucket_size)
        if pushed:
            for g in grads:
                sync.push(g)
            sync.finish()
        else:
            sync.synchronize(grads)
        return grads

    results = run(n, body)
    for i, (shape, dtype) in enumerate(specs):
        want = reference([values(seed + i, r, shape, dtype) for r in range(n)], ax.ReduceOp.AVG, dtype)
        for r in range(n):
            same(results[r][i], want)


def test_bfloat16_is_covered_when_ml_dtypes_is_installed():
    if bfloat16_dtype() is None:
        pytest.skip("ml_dtypes not installed")
    assert bfloat16_dtype() in DTYPES
