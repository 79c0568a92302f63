"""axonhpc.buffers: FlatShard (and the GradBucket views built on FlatOps) on the host and the strict cupy stand-in."""
import sys

import numpy as np
import pytest

from axonhpc.bucketing import GradBucket
from axonhpc.buffers import HOST, DeviceOps, FlatShard, flat_ops_for
from axonhpc.errors import ShapeError, UnsupportedDtypeError
from support.strict_cupy import DeviceArray, StrictCupy, device, host

SHAPES = [
    [(2, 3), (4,)],
    [(5,), (0,), (3, 1), (1,)],
    [(7,)],
    [(3, 3, 2), (2,), (1, 4)],
]


@pytest.fixture(params=["host", "device"])
def memory(request, monkeypatch):
    """(ops, to_memory): the host operations, or the device ones over the strict stand-in."""
    if request.param == "host":
        return HOST, np.asarray
    cupy = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return DeviceOps(cupy), device


def arrays_for(shapes, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_the_parts_put_together_are_the_padded_vector(memory, shapes, parts):
    ops, mem = memory
    shard = FlatShard(shapes, np.float64, parts, ops)
    values = arrays_for(shapes)
    numel = sum(v.size for v in values)
    assert shard.numel == numel and shard.padded_numel % parts == 0
    assert shard.padded_numel - numel < parts and shard.part_numel * parts == shard.padded_numel
    want = np.concatenate([v.ravel() for v in values] + [np.zeros(shard.padded_numel - numel)])
    flat = shard.pack([mem(v) for v in values])
    assert type(flat) is type(mem(values[0])) and host(flat).tolist() == want.tolist()
    for k in range(parts):
        start, stop, pad = shard.bounds(k)
        part = mem(np.full(shard.part_numel, np.nan))
        shard.pack_part([mem(v) for v in values], k, part)
        assert host(part).tolist() == want[start:stop].tolist()
        assert pad == max(0, stop - max(start, numel))
        for i, first, last, at in shard.spans(k):  # each span names where an array's elements landed
            assert host(part)[at:at + last - first].tolist() == values[i].ravel()[first:last].tolist()
        held = sum(last - first for _, first, last, _ in shard.spans(k))
        assert held == shard.part_numel - pad


@pytest.mark.parametrize("parts", [1, 3])
def test_a_missing_gradient_packs_as_zeros_and_another_dtype_is_cast(memory, parts):
    ops, mem = memory
    shapes = [(2, 2), (3,), (1,)]
    shard = FlatShard(shapes, np.float32, parts, ops)
    grads = [mem(np.full((2, 2), 1.5, np.float64)), None, mem(np.full(1, 4.0, np.float32))]
    flat = shard.pack(grads)
    assert flat.dtype == np.float32
    want = [1.5] * 4 + [0.0] * 3 + [4.0] + [0.0] * (shard.padded_numel - 8)
    assert host(flat).tolist() == want
    together = []
    for k in range(parts):
        part = mem(np.full(shard.part_numel, np.nan, np.float32))
        together += host(shard.pack_part(grads, k, part)).tolist()
    assert together == want


def test_unpack_and_views_round_trip(memory):
    ops, mem = memory
    shapes = [(2, 3), (0,), (4,)]
    shard = FlatShard(shapes, np.float32, 4, ops)  # 10 elements, padded to 12
    values = arrays_for(shapes, np.float32, seed=3)
    flat = shard.pack([mem(v) for v in values])
    outs = [mem(np.zeros(s, np.float32)) for s in shapes]
    shard.unpack(flat, outs)  # the padded vector: only its first numel elements are read
    assert all(host(o).tolist() == v.tolist() for o, v in zip(outs, values))
    views = shard.views(flat)
    views[2][...] = mem(np.full(4, 9.0, np.float32))
    assert host(flat)[6:10].tolist() == [9.0] * 4 and host(flat)[10:].tolist() == [0.0, 0.0]
    assert shard.with_dtype(np.float64).pack([mem(v) for v in values]).dtype == np.float64


def test_a_wrong_number_of_arrays_is_refused_with_both_counts():
    shard = FlatShard([(2,), (3,)], np.float64, 2, HOST)
    with pytest.raises(ShapeError, match="3 arrays for a flat vector of 2"):
        shard.pack([np.zeros(2), np.zeros(3), np.zeros(1)])
    with pytest.raises(ShapeError, match="1 arrays for a flat vector of 2"):
        shard.pack_part([np.zeros(2)], 0, np.zeros(3))


def test_bucket_views_share_the_buffer_that_is_communicated(memory):
    ops, mem = memory
    bucket = GradBucket.of_views(0, [(2, 3), (4,), (1,)], np.float32, ops, ["a", "b", "c"], None)
    assert bucket.buffer.size == 11 and host(bucket.buffer).tolist() == [0.0] * 11
    bucket.views[1][...] = mem(np.arange(4, dtype=np.float32))
    bucket.buffer[0:6] = mem(np.full(6, 2.0, np.float32))  # what an all-reduce in place does
    assert host(bucket.views[0]).tolist() == [[2.0] * 3] * 2
    assert host(bucket.buffer)[6:10].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert bucket.copies is None and bucket.kind == "all_reduce"
    if ops is not HOST:
        assert type(bucket.buffer) is DeviceArray and all(type(v) is DeviceArray for v in bucket.views)


def test_a_bucket_in_memory_the_caller_holds():
    window = np.zeros(64, np.uint8)  # as DDP passes a slice of the node's shared window
    flat = window[:40].view(np.float64)
    bucket = GradBucket.of_views(3, [(2, 2), (1,)], np.float64, HOST, ["w", "b"], None, flat)
    bucket.views[1][...] = 7.0
    assert bucket.buffer is flat and window[32:40].view(np.float64)[0] == 7.0
    with pytest.raises(ShapeError, match=r"shape \(5,\) but the gradients hold 4 elements"):
        GradBucket.of_views(0, [(2, 2)], np.float64, HOST, ["w"], None, flat)
    with pytest.raises(UnsupportedDtypeError, match="dtype float64, the gradients float32"):
        GradBucket.of_views(0, [(5,)], np.float32, HOST, ["w"], None, flat)


def test_the_memory_kind_is_chosen_once_from_the_arrays(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", StrictCupy())
    assert flat_ops_for([np.zeros(2)]) is HOST
    ops = flat_ops_for([device(np.zeros(2)), device(np.zeros(3))])
    assert ops.name == "device" and type(FlatShard([(2,)], np.float32, 2, ops).zeros()) is DeviceArray
