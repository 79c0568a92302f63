"""The rules every reduction here shares: AVG is a SUM then a division, and some reductions run widened.

float16 and bfloat16 have no MPI reduction and lose too much summed in 16 bits, so they are reduced
in a float32 copy and rounded back once. An integer AVG is summed in an int64 copy, so the sum of
uint8 or int32 values cannot overflow before the division: the average of n values of a dtype is a
value of that dtype. It is the floor of the exact mean (``floor_divide``, towards minus infinity) on
every path and backend. int64 is summed in int64 itself: only a sum beyond its range wraps.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .._dtypes import array_module, is_integer, is_low_precision_float
from ..backends.base import ReduceOp

_FLOAT32, _INT64 = np.dtype(np.float32), np.dtype(np.int64)


def base_op(op: ReduceOp) -> ReduceOp:
    """The operation the transfer runs: SUM for AVG, else ``op``."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def work_dtype(dtype: Any, op: ReduceOp) -> Optional[np.dtype]:
    """The dtype ``op`` on ``dtype`` is reduced in, when it is not ``dtype`` itself (see the module note); else None."""
    if is_low_precision_float(dtype):
        return _FLOAT32
    if op is ReduceOp.AVG and is_integer(dtype) and dtype != _INT64:
        return _INT64
    return None


def divide_average(a: Any, op: ReduceOp, size: int) -> None:
    """For AVG, divide the sum ``a`` by ``size`` in place (floor for integers); otherwise nothing."""
    if op is not ReduceOp.AVG:
        return
    xp = array_module(a)
    if is_integer(a.dtype):
        xp.floor_divide(a, size, out=a)
    else:
        xp.divide(a, size, out=a)


def reduce_widened(x: Any, op: ReduceOp, size: int, body: Callable[[Any, ReduceOp], None]) -> None:
    """Run ``body(work, base_op)`` on ``x`` (or its ``work_dtype`` copy), finish AVG, write back into ``x``.

    ``body`` reduces ``work`` in place across the group with the base operation.
    """
    wide = work_dtype(x.dtype, op)
    work = x if wide is None else x.astype(wide)
    body(work, base_op(op))
    divide_average(work, op, size)
    if work is not x:
        x[...] = work.astype(x.dtype)


__all__ = ["base_op", "divide_average", "reduce_widened", "work_dtype"]
