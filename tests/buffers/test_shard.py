"""Shard arithmetic and the flatten / pad / slice helpers (pure functions, no communication)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonhpc.bucketing import (
    FlatLayout,
    flatten_into_padded,
    padded_size,
    shard_bounds,
    shard_size,
    shard_view,
    unflatten,
    unpack,
)
from axonhpc.errors import InvalidArgumentError, NonContiguousBufferError, RankError, ShapeError, UnsupportedDtypeError
from support.buffer_cases import DTYPE_IDS, DTYPES, make


@pytest.mark.parametrize("numel, rank, world_size, expected", [
    (10, 0, 4, (0, 3, 0)),
    (10, 3, 4, (9, 12, 2)),
    (8, 1, 4, (2, 4, 0)),
    (1, 0, 2, (0, 1, 0)),
    (1, 1, 2, (1, 2, 1)),
    (5, 4, 8, (4, 5, 0)),
    (5, 7, 8, (7, 8, 1)),
    (0, 2, 3, (0, 0, 0)),
    (7, 0, 1, (0, 7, 0)),
])
def test_shard_bounds_examples(numel, rank, world_size, expected):
    assert shard_bounds(numel, rank, world_size) == expected


def _check_tiling(numel, world_size):
    chunk = math.ceil(numel / world_size)
    padded = padded_size(numel, world_size)
    assert shard_size(numel, world_size) == chunk
    assert padded == chunk * world_size and numel <= padded < numel + world_size
    position = 0
    for rank in range(world_size):
        start, stop, pad = shard_bounds(numel, rank, world_size)
        assert start == position and stop - start == chunk
        if stop <= numel:
            assert pad == 0  # all data
        elif start >= numel:
            assert pad == chunk  # all padding
        else:
            assert pad == stop - numel  # the slice that holds the end of the data
        position = stop
    assert position == padded
    assert sum(shard_bounds(numel, r, world_size)[2] for r in range(world_size)) == padded - numel


@pytest.mark.parametrize("world_size", range(1, 10))
def test_tiling_exhaustive_small(world_size):
    for numel in range(0, 40):
        _check_tiling(numel, world_size)


@settings(max_examples=200, deadline=None)
@given(numel=st.one_of(st.integers(0, 1000), st.integers(0, 10**12)), world_size=st.integers(1, 9))
def test_tiling_property(numel, world_size):
    _check_tiling(numel, world_size)


def test_pad_counts_positions_beyond_numel_brute_force():
    for world_size in range(1, 10):
        for numel in range(0, 30):
            padded = padded_size(numel, world_size)
            is_pad = np.arange(padded) >= numel
            for rank in range(world_size):
                start, stop, pad = shard_bounds(numel, rank, world_size)
                assert pad == int(is_pad[start:stop].sum())


# -- argument errors ---------------------------------------------------------------------
@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_rank_out_of_range(rank):
    with pytest.raises(RankError, match=f"rank {rank} is out of range for world_size 4"):
        shard_bounds(10, rank, 4)
    with pytest.raises(ValueError):  # RankError is a ValueError
        shard_bounds(10, rank, 4)


@pytest.mark.parametrize("world_size", [0, -2])
def test_world_size_below_one(world_size):
    for call in (lambda: shard_bounds(10, 0, world_size), lambda: padded_size(10, world_size),
                 lambda: shard_size(10, world_size), lambda: FlatLayout([(2,)], np.float32, world_size)):
        with pytest.raises(InvalidArgumentError, match=f"world_size must be at least 1, got {world_size}"):
            call()


def test_negative_numel():
    for call in (lambda: shard_bounds(-1, 0, 2), lambda: padded_size(-1, 2), lambda: shard_size(-1, 2)):
        with pytest.raises(InvalidArgumentError, match="numel must be non-negative, got -1"):
            call()


def test_negative_dimension():
    with pytest.raises(ShapeError, match=r"FlatLayout: shape \(2, -3\) of array 1 has a negative dimension \(-3\)"):
        FlatLayout([(4,), (2, -3)], np.float32, 2)


# -- flatten / shard / unflatten --------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_flatten_shard_unflatten(dtype, world_size):
    rng = np.random.default_rng(world_size)
    arrays = [make((3, 5), dtype, rng), make((), dtype, rng), make((4,), dtype, rng)]
    flat, layout = flatten_into_padded(arrays, world_size)
    numel = 20
    assert layout.numel == numel and layout.padded_numel == padded_size(numel, world_size)
    assert layout.shapes == ((3, 5), (), (4,)) and layout.offsets == (0, 15, 16) and layout.sizes == (15, 1, 4)
    assert layout.dtype == dtype and layout.world_size == world_size
    assert flat.shape == (layout.padded_numel,) and flat.dtype == dtype
    np.testing.assert_array_equal(flat[:numel], np.concatenate([a.ravel() for a in arrays]))
    assert np.all(flat[numel:] == np.zeros(1, dtype))
    shards = [shard_view(flat, r, world_size) for r in range(world_size)]
    assert all(np.shares_memory(s, flat) for s in shards)
    for rank, s in enumerate(shards):
        start, stop, pad = layout.shard_bounds(rank)
        assert s.size == stop - start and np.all(s[s.size - pad:] == np.zeros(1, dtype))
    np.testing.assert_array_equal(np.concatenate(shards), flat)
    views = unflatten(flat, layout)
    for a, v in zip(arrays, views):
        assert v.shape == a.shape and np.shares_memory(v, flat)
        np.testing.assert_array_equal(v, a)
    # the FSDP round trip: gathered shards copied back into the original arrays
    outs = [np.zeros_like(a) for a in arrays]
    unpack(np.concatenate(shards)[:layout.numel], outs)
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=1, max_size=10),
    world_size=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_flatten_round_trip_property(dtype, shapes, world_size, seed):
    rng = np.random.default_rng(seed)
    arrays = [make(s, dtype, rng) for s in shapes]
    flat, layout = flatten_into_padded(arrays, world_size)
    assert flat.size == padded_size(layout.numel, world_size) == layout.padded_numel
    gathered = np.concatenate([shard_view(flat, r, world_size) for r in range(world_size)])
    for a, v in zip(arrays, unflatten(gathered, layout)):
        np.testing.assert_array_equal(v, a)


def test_unflatten_accepts_an_unpadded_buffer():
    flat, layout = flatten_into_padded([np.arange(3.0), np.arange(2.0)], 4)
    views = unflatten(flat[:layout.numel].copy(), layout)
    np.testing.assert_array_equal(views[1], [0, 1])


def test_flat_layout_equality():
    a = FlatLayout([(2, 3), (4,)], np.float32, 2)
    assert a == FlatLayout([[2, 3], [4]], "float32", 2) and hash(a) == hash(FlatLayout([(2, 3), (4,)], np.float32, 2))
    assert a != FlatLayout([(2, 3), (4,)], np.float32, 3)
    assert a != FlatLayout([(6,), (4,)], np.float32, 2)
    assert "padded_numel=10" in repr(a)


def test_flatten_errors():
    with pytest.raises(ShapeError, match="no arrays"):
        flatten_into_padded([], 2)
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        flatten_into_padded([np.zeros(2)], 0)
    with pytest.raises(UnsupportedDtypeError, match="float32.*float64"):
        flatten_into_padded([np.zeros(2), np.zeros(2, np.float32)], 2)


def test_shard_view_errors():
    with pytest.raises(ShapeError, match="7 elements, not a multiple of world_size 2"):
        shard_view(np.zeros(7), 0, 2)
    with pytest.raises(ShapeError, match="must be 1-D"):
        shard_view(np.zeros((2, 2)), 0, 2)
    with pytest.raises(RankError, match="rank 2 is out of range for world_size 2"):
        shard_view(np.zeros(4), 2, 2)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        shard_view(np.zeros(4), 0, 0)
    with pytest.raises(NonContiguousBufferError):
        shard_view(np.zeros(8)[::2], 0, 2)


def test_unflatten_errors():
    flat, layout = flatten_into_padded([np.zeros(3), np.zeros(2)], 2)
    with pytest.raises(ShapeError, match="4 elements but the layout needs 5"):
        unflatten(flat[:4], layout)
    with pytest.raises(UnsupportedDtypeError, match="float32 but the layout is float64"):
        unflatten(flat.astype(np.float32), layout)
    with pytest.raises(ShapeError, match="must be 1-D"):
        unflatten(flat.reshape(2, 3), layout)
    with pytest.raises(NonContiguousBufferError):
        unflatten(np.zeros(12)[::2], layout)
