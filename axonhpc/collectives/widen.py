"""The two rules every reduction here shares: AVG is a SUM then a division, 16-bit floats are reduced widened.

float16 and bfloat16 have no MPI reduction and lose too much summed in 16 bits, so they are reduced
in a float32 copy and rounded back once.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._dtypes import array_module, is_integer, is_low_precision_float
from ..backends.base import ReduceOp


def base_op(op: ReduceOp) -> ReduceOp:
    """The operation the transfer runs: SUM for AVG, else ``op``."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


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
    """Run ``body(work, base_op)`` on ``x`` (or its float32 copy), finish AVG, write back into ``x``.

    ``body`` reduces ``work`` in place across the group with the base operation.
    """
    work = x.astype(np.float32) if is_low_precision_float(x.dtype) else x
    body(work, base_op(op))
    divide_average(work, op, size)
    if work is not x:
        x[...] = work.astype(x.dtype)


__all__ = ["base_op", "divide_average", "reduce_widened"]
