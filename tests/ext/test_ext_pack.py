"""pack / unpack / layout_key of axonhpc._ext._pack against plain numpy, over every supported dtype."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


from axonhpc._ext._pack import layout_key
from axonhpc.bucketing import pack, unpack
from axonhpc.errors import (
    InvalidBufferError,
    NonContiguousBufferError,
    ReadOnlyBufferError,
    ShapeError,
    UnsupportedDtypeError,
)
from support.buffer_cases import DTYPE_IDS, DTYPES, make

SHAPES = [(), (0,), (1,), (7,), (3, 4), (2, 0, 5), (2, 3, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_matches_concatenate(dtype):
    rng = np.random.default_rng(1)
    arrays = [make(s, dtype, rng) for s in SHAPES]
    flat = pack(arrays)
    assert flat.dtype == dtype and flat.ndim == 1
    np.testing.assert_array_equal(flat, np.concatenate([a.ravel() for a in arrays]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_into_out_returns_out(dtype):
    rng = np.random.default_rng(2)
    arrays = [make(s, dtype, rng) for s in SHAPES]
    out = np.zeros(sum(a.size for a in arrays), dtype=dtype)
    assert pack(arrays, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([a.ravel() for a in arrays]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unpack_matches_numpy_split(dtype):
    rng = np.random.default_rng(3)
    outs = [np.zeros(s, dtype=dtype) for s in SHAPES]
    flat = make(sum(o.size for o in outs), dtype, rng)
    assert unpack(flat, outs) is None
    offset = 0
    for out in outs:
        np.testing.assert_array_equal(out.ravel(), flat[offset:offset + out.size])
        offset += out.size


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_round_trip_releases_the_gil_path(dtype):
    # Above the no-GIL threshold (64 KiB) the copy takes the other branch.
    rng = np.random.default_rng(4)
    arrays = [make((300, 301), dtype, rng), make(70_001, dtype, rng)]
    flat = pack(arrays)
    np.testing.assert_array_equal(flat, np.concatenate([a.ravel() for a in arrays]))
    outs = [np.zeros_like(a) for a in arrays]
    unpack(flat, outs)
    for a, b in zip(arrays, outs):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=20),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(dtype, shapes, seed):
    rng = np.random.default_rng(seed)
    arrays = [make(s, dtype, rng) for s in shapes]
    flat = pack(arrays)
    np.testing.assert_array_equal(flat, np.concatenate([a.ravel() for a in arrays]))
    outs = [np.empty(s, dtype=dtype) for s in shapes]
    unpack(flat, outs)
    for a, b in zip(arrays, outs):
        assert b.shape == a.shape
        np.testing.assert_array_equal(a, b)


def test_accepts_any_iterable():
    arrays = (np.arange(3, dtype=np.float32), np.arange(2, dtype=np.float32))
    np.testing.assert_array_equal(pack(iter(arrays)), [0, 1, 2, 0, 1])
    outs = (np.zeros(3, np.float32), np.zeros(2, np.float32))
    unpack(np.arange(5, dtype=np.float32), iter(outs))
    np.testing.assert_array_equal(outs[1], [3, 4])


def test_inputs_already_in_place_are_left_alone():
    # Gradients that are views of the bucket (gradient_as_bucket_view) pack and unpack as no-ops.
    flat = np.arange(10, dtype=np.float64)
    views = [flat[:4].reshape(2, 2), flat[4:10]]
    assert pack(views, out=flat) is flat
    unpack(flat, views)
    np.testing.assert_array_equal(flat, np.arange(10))


def test_empty_list_with_out():
    out = np.empty(0, np.float32)
    assert pack([], out=out) is out
    unpack(out, [])


# -- errors ------------------------------------------------------------------------------
def test_pack_no_arrays_no_out():
    with pytest.raises(ShapeError, match="no arrays"):
        pack([])


def test_mixed_dtypes_name_both():
    with pytest.raises(UnsupportedDtypeError, match=r"arrays\[1\] has dtype float64.*float32"):
        pack([np.zeros(2, np.float32), np.zeros(2, np.float64)])


def test_unsupported_dtype():
    with pytest.raises(UnsupportedDtypeError, match="complex128"):
        pack([np.zeros(2, complex)])
    with pytest.raises(TypeError):  # UnsupportedDtypeError is also a TypeError
        pack([np.zeros(2, np.int16)])


def test_non_native_byte_order_is_rejected():
    swapped = np.zeros(3, dtype=np.dtype(np.float32).newbyteorder())
    with pytest.raises(UnsupportedDtypeError):
        pack([swapped])
    with pytest.raises(UnsupportedDtypeError):
        pack([np.zeros(3, np.float32), swapped])


def test_not_an_array():
    with pytest.raises(UnsupportedDtypeError, match=r"arrays\[0\] must be a numpy array, got builtins.list"):
        pack([[1.0, 2.0]])
    with pytest.raises(UnsupportedDtypeError, match=r"outs\[1\] must be a numpy array"):
        unpack(np.zeros(4), [np.zeros(2), (0.0, 0.0)])


def test_non_contiguous_input():
    with pytest.raises(NonContiguousBufferError, match=r"arrays\[1\].*strides"):
        pack([np.zeros(2), np.zeros(6)[::2]])
    with pytest.raises(ValueError):  # also a ValueError
        pack([np.zeros((3, 3)).T])


def test_out_wrong_size_gives_numbers():
    with pytest.raises(ShapeError, match=r"\(4,\).*5 elements"):
        pack([np.zeros(2), np.zeros(3)], out=np.zeros(4))


def test_out_must_be_flat():
    with pytest.raises(ShapeError, match="1-D"):
        pack([np.zeros(2), np.zeros(2)], out=np.zeros((2, 2)))


def test_out_read_only():
    out = np.zeros(2)
    out.flags.writeable = False
    with pytest.raises(ReadOnlyBufferError, match="pack: out"):
        pack([np.zeros(2)], out=out)


def test_out_wrong_dtype():
    with pytest.raises(UnsupportedDtypeError, match=r"arrays\[0\] has dtype float64.*float32"):
        pack([np.zeros(2)], out=np.zeros(2, np.float32))


def test_unpack_size_mismatch():
    with pytest.raises(ShapeError, match=r"\(5,\).*4 elements"):
        unpack(np.zeros(5), [np.zeros(2), np.zeros(2)])


def test_unpack_read_only_out():
    ro = np.zeros(2)
    ro.flags.writeable = False
    with pytest.raises(ReadOnlyBufferError, match=r"outs\[1\]"):
        unpack(np.zeros(4), [np.zeros(2), ro])


def test_unpack_non_contiguous_out():
    with pytest.raises(NonContiguousBufferError, match=r"outs\[0\]"):
        unpack(np.zeros(2), [np.zeros(4)[::2]])


def test_unpack_dtype_mismatch():
    with pytest.raises(UnsupportedDtypeError, match=r"outs\[0\] has dtype int64.*float64"):
        unpack(np.zeros(2), [np.zeros(2, np.int64)])


def test_partial_overlap_is_refused():
    buf = np.arange(8, dtype=np.float64)
    with pytest.raises(InvalidBufferError, match=r"arrays\[0\] overlaps out.*offset 0"):
        pack([buf[2:6]], out=buf[:4])
    with pytest.raises(InvalidBufferError, match=r"outs\[1\] overlaps flat.*offset 2"):
        unpack(buf[:4], [np.zeros(2), buf[1:3]])
    np.testing.assert_array_equal(buf, np.arange(8))  # nothing was written


# -- layout_key --------------------------------------------------------------------------
def test_layout_key_depends_on_sizes_and_dtypes_only():
    a = [np.zeros((2, 3), np.float32), np.zeros(4, np.int64)]
    assert layout_key(a) == layout_key([np.ones(6, np.float32), np.ones((2, 2), np.int64)])
    assert layout_key(a) != layout_key([np.zeros(6, np.float64), np.zeros(4, np.int64)])
    assert layout_key(a) != layout_key([np.zeros(7, np.float32), np.zeros(4, np.int64)])
    assert layout_key(a) != layout_key(a[:1])
    assert layout_key([]) == b""


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layout_key_distinguishes_every_dtype(dtype):
    keys = {layout_key([np.zeros(3, d)]) for d in DTYPES}
    assert len(keys) == len(DTYPES)
    assert layout_key([np.zeros(3, dtype)]) in keys


def test_layout_key_errors():
    ro = np.zeros(2)
    ro.flags.writeable = False
    layout_key([ro])  # fine when nothing is written
    with pytest.raises(ReadOnlyBufferError, match=r"grads\[0\]"):
        layout_key([ro], "grads", writable=True)
    with pytest.raises(NonContiguousBufferError, match=r"grads\[1\]"):
        layout_key([np.zeros(2), np.zeros(4)[::2]], "grads")
    with pytest.raises(UnsupportedDtypeError, match="complex64"):
        layout_key([np.zeros(2, np.complex64)])
    with pytest.raises(UnsupportedDtypeError, match="must be a numpy array"):
        layout_key([3.0])
