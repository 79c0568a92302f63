"""backends.folding: float MIN and MAX are IEEE 754-2019 minimum and maximum in every fold, bit for bit.

The engine's kernel (``_shm.MinMax``, MPI's user op) and the ufunc fold (device arrays, 16-bit floats)
against a reference written out case by case, on every pair of special values; then folds in every
order of four arrays giving one set of bits.
"""
import itertools

import numpy as np
import pytest

from axonhpc._dtypes import bfloat16_dtype
from axonhpc._ext import _shm
from axonhpc.backends import folding
from axonhpc.backends.base import ReduceOp
from support.reduction_cases import ieee_min_max

SPECIAL = [-0.0, 0.0, 1.0, -1.0, 2.5, np.nan, -np.nan, np.inf, -np.inf]
FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)] + (
    [bfloat16_dtype()] if bfloat16_dtype() is not None else [])
MIN_MAX = [ReduceOp.MIN, ReduceOp.MAX]


def _bits(x):
    x = np.ascontiguousarray(x).reshape(-1)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _pairs(dtype, length):
    """Every ordered pair of special values, each pair repeated to ``length`` elements: (acc, other, rows)."""
    pairs = list(itertools.product(SPECIAL, SPECIAL))
    rows = np.array(pairs, dtype=np.float64).T  # (2, pairs)
    rows = np.repeat(rows, -(-length // len(pairs)), axis=1)[:, :max(length, 1)]
    return rows[0].astype(dtype), rows[1].astype(dtype), rows.astype(dtype).astype(np.float64)


def _assert_ieee(got, rows, op, what):
    want = ieee_min_max(rows, op).astype(got.dtype)
    nan = np.isnan(want.astype(np.float64))
    assert np.array_equal(np.isnan(got.astype(np.float64)), nan), what
    wrong = np.flatnonzero(_bits(got)[~nan] != _bits(want)[~nan])
    assert not wrong.size, (f"{what}: got {got[~nan][wrong[:4]].tolist()}, IEEE {want[~nan][wrong[:4]].tolist()} "
                            f"for {rows[:, ~nan][:, wrong[:4]].T.tolist()}")


@pytest.mark.parametrize("op", MIN_MAX, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", [1, 81, 1000, 70001])  # a scalar tail, vector loops, past the GIL threshold
def test_the_engine_kernel_is_ieee_minimum_and_maximum(op, dtype, length):
    acc, other, rows = _pairs(dtype, length)
    folding.min_max_kernel(op, dtype)(other, acc)  # MPI's order: inoutbuf = inbuf op inoutbuf
    _assert_ieee(acc, rows, op, f"MinMax {op.name} {np.dtype(dtype)}")


@pytest.mark.parametrize("op", MIN_MAX, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_ufunc_fold_is_ieee_minimum_and_maximum(op, dtype):
    """The formulation device arrays and 16-bit floats take, here on numpy arrays."""
    acc, other, rows = _pairs(dtype, 81)
    folding._fold_ufunc(np, op, acc, other)
    _assert_ieee(acc, rows, op, f"ufunc fold {op.name} {dtype}")


@pytest.mark.parametrize("op", MIN_MAX, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_every_order_of_folding_gives_the_same_bits(op, dtype):
    """Commutative and associative bit for bit: four arrays of signed zeros, numbers and NaN, in all 24 orders."""
    rng = np.random.default_rng(7)
    choices = np.array([-0.0, 0.0, -0.0, 0.0, 1.0, -1.0, np.nan])
    arrays = [rng.choice(choices, 4096).astype(dtype) for _ in range(4)]
    want = ieee_min_max(np.stack(arrays).astype(np.float64), op)
    seen = set()
    for order in itertools.permutations(range(4)):
        acc = arrays[order[0]].copy()
        for k in order[1:]:
            folding.fold(op, acc, arrays[k])
        _assert_ieee(acc, np.stack([arrays[k] for k in order]).astype(np.float64), op, f"order {order}")
        bits = _bits(acc).copy()
        bits[np.isnan(want)] = 1  # which NaN is not promised
        seen.add(bits.tobytes())
    assert len(seen) == 1


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_integers_fold_as_the_numpy_ufuncs(op, dtype):
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 100, 999).astype(dtype), rng.integers(0, 100, 999).astype(dtype)
    want = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
            ReduceOp.MAX: np.maximum}[op](a, b)
    folding.fold(op, a, b)
    assert a.dtype == want.dtype and np.array_equal(a, want)


@pytest.mark.parametrize("op, first, second, want", [(ReduceOp.MIN, -0.0, 0.0, -0.0), (ReduceOp.MAX, 0.0, -0.0, 0.0)])
def test_non_contiguous_operands_take_the_ufunc_fold(op, first, second, want):
    acc = np.full(20, first, dtype=np.float32)[::2]
    folding.fold(op, acc, np.full(20, second, dtype=np.float32)[::2])
    assert (np.signbit(acc) == np.signbit(want)).all()


def test_the_kernel_refuses_what_it_cannot_reduce():
    with pytest.raises(ValueError, match="not MIN or MAX"):
        _shm.MinMax("SUM", np.float32)
    with pytest.raises(ValueError, match="float32 or float64, not int32"):
        _shm.MinMax("MIN", np.int32)
    kernel = _shm.MinMax("MAX", np.float64)
    with pytest.raises(ValueError, match="16 bytes into 24"):
        kernel(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="in elements of 8 bytes"):
        kernel(np.zeros(3, dtype=np.uint8), np.zeros(3, dtype=np.uint8))
    with pytest.raises(ValueError, match="not C-contiguous"):  # numpy's refusal of the buffer
        kernel(np.zeros(3), np.zeros(6)[::2])
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernel(np.zeros(3), readonly)
    with pytest.raises(ValueError, match="3 bytes into 24"):
        kernel(b"abc", np.zeros(3))
    assert repr(kernel) == "MinMax('MAX', float64)"
