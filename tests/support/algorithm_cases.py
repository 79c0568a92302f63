"""Ring and recursive halving-doubling all-reduce cases, run on threads (1-4 ranks) and on MPI ranks.

Each equals the native all-reduce: bit for bit on integers, MIN and MAX and
at world sizes 1 and 2 (one addition of two numbers is exact in any order),
within rounding otherwise; and each is bit-identical from run to run and on
every rank.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc._dtypes import supported_dtypes
from axonhpc.backends import ReduceOp
from axonhpc.collectives.ring import rhd_all_reduce, ring_all_reduce

ALGORITHMS = ("ring", "rhd")
OPS = ("sum", "avg", "max", "min", "product")
RUN = {"ring": ring_all_reduce, "rhd": rhd_all_reduce}


def _data(world, dtype, size, seed=0, shape=None):
    rng = np.random.default_rng(1000 * world.rank + size + 7 * seed)
    if np.dtype(dtype).kind in "iu":
        x = rng.integers(1, 4, size).astype(dtype)
    else:
        x = (rng.standard_normal(size) + 2).astype(dtype)
    return x.reshape(shape) if shape is not None else x


def _must_be_exact(world, dtype, op):
    return world.world_size <= 2 or np.dtype(dtype).kind in "iu" or op in ("max", "min")


def _check_equal(world, algorithm, dtype, op, size, shape=None):
    x = _data(world, dtype, size, shape=shape)
    native, mine = x.copy(), x.copy()
    ax.all_reduce(native, op, algorithm="native")
    ax.all_reduce(mine, op, algorithm=algorithm)
    assert mine.dtype == x.dtype and mine.shape == x.shape
    where = f"{algorithm} {np.dtype(dtype).name} {op} size {size} on {world.world_size} ranks"
    if _must_be_exact(world, dtype, op):
        np.testing.assert_array_equal(mine.reshape(-1).view(np.uint8), native.reshape(-1).view(np.uint8),
                                      err_msg=where)
    else:
        tol = 1e-12 if dtype == np.float64 else 1e-5 if dtype == np.float32 else 1e-2
        np.testing.assert_allclose(mine.astype(np.float64), native.astype(np.float64), rtol=tol, err_msg=where)
    _check_same_on_every_rank(mine, where)


def _check_same_on_every_rank(x, where):
    """Every rank holds the same bits (the all-gather only copies finished chunks)."""
    bits = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    gathered = ax.all_gather(bits)
    for r in range(gathered.shape[0]):
        np.testing.assert_array_equal(gathered[r], bits, err_msg=f"{where}: rank {r} differs")


def case_every_dtype_op_and_algorithm_equals_native(world):
    for algorithm in ALGORITHMS:
        for dtype in supported_dtypes():
            for op in OPS:
                if op == "product" and np.dtype(dtype).itemsize < 4:
                    continue  # overflows small types the same way, but not usefully
                _check_equal(world, algorithm, dtype, op, 11)


def case_sizes_around_the_group_size_and_uneven_chunks(world):
    p = world.world_size
    for algorithm in ALGORITHMS:
        for size in sorted({0, 1, max(p - 1, 0), p, p + 1, 1000, 4099}):
            _check_equal(world, algorithm, np.float64, "sum", size)
            _check_equal(world, algorithm, np.float32, "avg", size)
            _check_equal(world, algorithm, np.int64, "avg", size)
            _check_equal(world, algorithm, np.int32, "max", size)


def case_multi_dimensional_arrays(world):
    for algorithm in ALGORITHMS:
        for shape in [(2, 3, 4), (5, 1, 7), (1,), ()]:
            size = int(np.prod(shape))
            _check_equal(world, algorithm, np.float64, "sum", size, shape=shape)
            _check_equal(world, algorithm, np.int32, "product", size, shape=shape)


def case_closed_form_values(world):
    """Each rank fills rank + c: the sum is n(n-1)/2 + n c, the mean (n-1)/2 + c."""
    n = world.world_size
    for algorithm in ALGORITHMS:
        x = np.full(37, world.rank + 3.0)
        ax.all_reduce(x, "sum", algorithm=algorithm)
        assert np.all(x == n * (n - 1) / 2 + 3 * n)
        x = np.full(37, world.rank + 3.0)
        ax.all_reduce(x, "avg", algorithm=algorithm)
        assert np.allclose(x, (n - 1) / 2 + 3)
        x = np.full(5, world.rank, dtype=np.int64)
        ax.all_reduce(x, "min", algorithm=algorithm)
        assert np.all(x == 0)
        x = np.full(5, world.rank, dtype=np.int64)
        ax.all_reduce(x, "max", algorithm=algorithm)
        assert np.all(x == n - 1)


def case_repeated_runs_are_bit_identical(world):
    for algorithm in ALGORITHMS:
        for dtype in (np.float32, np.float64, np.float16):
            x = _data(world, dtype, 4099, seed=3)
            first = x.copy()
            ax.all_reduce(first, "sum", algorithm=algorithm)
            for _ in range(3):
                again = x.copy()
                ax.all_reduce(again, "sum", algorithm=algorithm)
                np.testing.assert_array_equal(again.view(np.uint8), first.view(np.uint8))


def case_direct_calls_match_dispatch(world):
    pg = world.default_group
    for algorithm in ALGORITHMS:
        x = _data(world, np.float64, 101)
        direct, dispatched = x.copy(), x.copy()
        RUN[algorithm](direct, ReduceOp.SUM, pg)
        ax.all_reduce(dispatched, "sum", algorithm=algorithm)
        np.testing.assert_array_equal(direct, dispatched)


def case_per_call_selection_and_async(world):
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) + world.rank
    expected = x.copy()
    ax.all_reduce(expected, "avg", algorithm="native")
    for algorithm in ALGORITHMS:
        y = x.copy()
        work = ax.all_reduce(y, "avg", algorithm=algorithm.upper(), async_op=True)
        assert work.is_completed()
        assert work.wait() is None
        np.testing.assert_allclose(y, expected, rtol=1e-14)


def case_selection_by_setting(world):
    before = ax.settings.allreduce_algorithm
    try:
        for algorithm in ALGORITHMS:
            ax.settings.allreduce_algorithm = algorithm
            x = _data(world, np.float64, 50)
            by_setting, explicit = x.copy(), x.copy()
            ax.all_reduce(by_setting, "sum")
            RUN[algorithm](explicit, ReduceOp.SUM, world.default_group)
            np.testing.assert_array_equal(by_setting, explicit)
    finally:
        ax.settings.allreduce_algorithm = before


def case_user_messages_with_any_tag_never_mix_with_the_algorithm(world):
    """A user's isend to the next rank, in flight across the all-reduce, on the tags the algorithms use."""
    from axonhpc.collectives.ring import RHD_TAG, RING_TAG

    n, r = world.world_size, world.rank
    if n == 1:
        return
    for algorithm in ALGORITHMS:
        for tag in (0, RING_TAG, RHD_TAG):
            out = np.full(7, 100.0 + r)
            inbox = np.zeros(7)
            sent = ax.isend(out, (r + 1) % n, tag=tag)
            x = np.full(7, r + 1.0)
            ax.all_reduce(x, "sum", algorithm=algorithm)
            ax.recv(inbox, (r - 1) % n, tag=tag)
            sent.wait()
            assert np.all(x == n * (n + 1) / 2)
            assert np.all(inbox == 100.0 + (r - 1) % n)


def case_subgroups(world):
    n = world.world_size
    half = world.split(world.rank % 2, world.rank)
    for algorithm in ALGORITHMS:
        x = np.full(9, float(world.rank))
        ax.all_reduce(x, "sum", group=half, algorithm=algorithm)
        assert np.all(x == sum(range(world.rank % 2, n, 2)))


def case_setting_applies_to_ddp(world):
    from support.ddp_cases import parity

    before = ax.settings.allreduce_algorithm
    try:
        for algorithm in ALGORITHMS:
            ax.settings.allreduce_algorithm = algorithm
            parity(world, np.float64, "adam")
    finally:
        ax.settings.allreduce_algorithm = before


def case_unknown_algorithm_is_refused_before_sending(world):
    with pytest.raises(ax.errors.ConfigurationError, match="algorithm='tree' is not an all-reduce algorithm"):
        ax.all_reduce(np.zeros(3), algorithm="tree")
    ax.barrier()


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}
