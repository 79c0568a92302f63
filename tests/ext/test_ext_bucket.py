"""GradientBucket of axonhpc._ext._bucket against a plain numpy model, over every supported dtype."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonhpc.bucketing import GradientBucket
from axonhpc.errors import ArgumentTypeError, InvalidArgumentError, NonContiguousBufferError, UnsupportedDtypeError
from support.buffer_cases import DTYPE_IDS, DTYPES, make


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_views_extract_data(dtype):
    rng = np.random.default_rng(0)
    arrays = [make((3, 4), dtype, rng), make((), dtype, rng), make((0,), dtype, rng), make((5,), dtype, rng)]
    b = GradientBucket(20, dtype=dtype)
    assert b.dtype == dtype and b.capacity == 20 and b.size == 0 and b.is_empty() and len(b) == 0
    for a in arrays:
        assert b.add(a) is True
    assert b.size == 18 and len(b) == 4 and not b.is_empty() and not b.is_full()
    np.testing.assert_array_equal(b.data, np.concatenate([a.ravel() for a in arrays]))
    assert b.data.dtype == dtype and b.data.shape == (18,)
    for a, v, e in zip(arrays, b.views(), b.extract()):
        assert v.shape == a.shape and e.shape == a.shape and v.dtype == dtype
        np.testing.assert_array_equal(v, a)
        np.testing.assert_array_equal(e, a)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_views_share_the_buffer_and_extract_does_not(dtype):
    rng = np.random.default_rng(1)
    b = GradientBucket(10, dtype=dtype)
    b.add(make((2, 2), dtype, rng))
    b.add(make((3,), dtype, rng))
    views, copies = b.views(), b.extract()
    data = b.data
    data[...] = np.asarray(7, dtype=dtype)  # what an in-place all-reduce does
    assert all(np.all(v == np.asarray(7, dtype=dtype)) for v in views)
    assert all(np.shares_memory(v, data) for v in views)
    assert not any(np.shares_memory(c, data) for c in copies)
    assert not any(np.all(c == np.asarray(7, dtype=dtype)) for c in copies)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_overflow_copies_nothing(dtype):
    rng = np.random.default_rng(2)
    b = GradientBucket(6, dtype=dtype)
    first = make(4, dtype, rng)
    assert b.add(first)
    before = b.data.copy()
    assert b.add(make(3, dtype, rng)) is False
    assert b.size == 4 and len(b) == 1
    np.testing.assert_array_equal(b.data, before)
    assert b.add(make((1, 2), dtype, rng)) is True
    assert b.is_full()
    assert b.add(make(1, dtype, rng)) is False
    assert b.add(make(0, dtype, rng)) is True  # an empty array always fits


def test_dtype_from_first_array_and_kept_after_clear():
    b = GradientBucket(4)
    assert b.dtype is None and b.data.size == 0 and b.views() == []
    assert b.add(np.zeros(9, np.int32)) is False  # does not fit: the dtype stays open
    assert b.dtype is None
    assert b.add(np.arange(2, dtype=np.int32))
    assert b.dtype == np.int32
    b.clear()
    assert b.is_empty() and b.size == 0 and b.dtype == np.int32 and b.capacity == 4
    with pytest.raises(UnsupportedDtypeError, match="float64.*int32"):
        b.add(np.zeros(1))


def test_clear_reuses_the_buffer():
    b = GradientBucket(8, dtype=np.float32)
    b.add(np.ones(8, np.float32))
    old = b.data
    b.clear()
    b.add(np.full(3, 2, np.float32))
    assert np.shares_memory(old, b.data)
    np.testing.assert_array_equal(b.data, [2, 2, 2])
    assert [v.shape for v in b.views()] == [(3,)]


def test_large_add_takes_the_nogil_path():
    big = np.arange(100_000, dtype=np.float64)
    b = GradientBucket(200_000, dtype=np.float64)
    assert b.add(big) and b.add(big[::-1].copy())
    np.testing.assert_array_equal(b.views()[0], big)
    np.testing.assert_array_equal(b.views()[1], big[::-1])


def test_add_a_view_of_itself():
    b = GradientBucket(6, dtype=np.float64)
    b.add(np.arange(3.0))
    assert b.add(b.views()[0])  # source and destination are the same buffer
    np.testing.assert_array_equal(b.data, [0, 1, 2, 0, 1, 2])


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    capacity=st.integers(1, 60),
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), max_size=25),
    seed=st.integers(0, 2**32 - 1),
)
def test_bucket_follows_a_list_model(dtype, capacity, shapes, seed):
    rng = np.random.default_rng(seed)
    b = GradientBucket(capacity, dtype=dtype)
    kept, used = [], 0
    for shape in shapes:
        a = make(shape, dtype, rng)
        fits = used + a.size <= capacity
        assert b.add(a) is fits
        if fits:
            kept.append(a)
            used += a.size
    assert b.size == used and len(b) == len(kept) and b.is_full() == (used == capacity)
    assert b.is_empty() == (not kept)
    expected = np.concatenate([a.ravel() for a in kept]) if kept else np.empty(0, dtype)
    np.testing.assert_array_equal(b.data, expected)
    for a, v, e in zip(kept, b.views(), b.extract()):
        assert v.shape == e.shape == a.shape
        np.testing.assert_array_equal(v, a)
        np.testing.assert_array_equal(e, a)


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_below_one(capacity):
    with pytest.raises(InvalidArgumentError, match=f"at least 1 element, got {capacity}"):
        GradientBucket(capacity)  # an InvalidArgumentError is a ValueError too


@pytest.mark.parametrize("capacity", [2.5, "8", None])
def test_capacity_must_be_an_integer(capacity):
    with pytest.raises(ArgumentTypeError, match=f"capacity must be an int .*got {type(capacity).__name__}"):
        GradientBucket(capacity)  # an ArgumentTypeError is a TypeError too


def test_unsupported_dtype_argument():
    with pytest.raises(UnsupportedDtypeError, match="complex64"):
        GradientBucket(4, dtype=np.complex64)


def test_dtype_mismatch_names_both():
    b = GradientBucket(4, dtype=np.float32)
    with pytest.raises(UnsupportedDtypeError, match="float16.*float32"):
        b.add(np.zeros(2, np.float16))
    assert b.is_empty()


def test_non_contiguous_add():
    b = GradientBucket(10, dtype=np.float64)
    with pytest.raises(NonContiguousBufferError, match="strides"):
        b.add(np.zeros((3, 3))[:, 0])
    assert b.is_empty()


def test_non_array_add():
    with pytest.raises(UnsupportedDtypeError, match="must be a numpy array, got builtins.list"):
        GradientBucket(4).add([1.0])


def test_unsupported_first_array():
    b = GradientBucket(4)
    with pytest.raises(UnsupportedDtypeError, match="int16"):
        b.add(np.zeros(2, np.int16))
    assert b.dtype is None
