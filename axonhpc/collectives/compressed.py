"""Averaging with 16-bit floats on the wire: the collectives behind gradient compression.

[Note: compressed averaging]
``compressed_all_reduce(x, "float16")`` averages a float32/float64 array while every message carries
float16 (or bfloat16): half of float32's bytes. The array is divided by the group size first (so the
sum cannot overflow where the average does not) and rounded to the wire type; a ring then runs on
the 16-bit copy, each hop adding in 16 bits with numpy, as an NCCL float16 all-reduce does. MPI has
no 16-bit addition, hence the ring instead of one MPI call.

Error: one rounding at the start and one per addition (P - 1); with float16 the relative error of
an average of P same-signed terms is at most about ``P * 2**-11`` (values below 6.1e-5 lose
precision progressively), with bfloat16 about ``P * 2**-8``. The tests and ``axonhpc bench ddp
--comm-hook`` measure it.

``compressed_reduce_scatter`` is the first half alone, shifted so rank r ends with chunk r (FSDP's
gradient shards). The order of every addition is fixed, so results are bit-identical everywhere.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._dtypes import array_module, bfloat16_dtype, check_array
from ..backends.base import ReduceOp
from ..errors import InvalidArgumentError, ShapeError, UnsupportedDtypeError
from ..groups import ProcessGroup
from . import flight, graphed
from .core import member, start_call
from .ring import RING_TAG, channel, execute, ring_reduce_scatter_schedule, ring_schedule

WIRE_DTYPES = ("float16", "bfloat16")
_RING_IN_GRAPH = ("the 16-bit ring is made of messages between the ranks, sent and added from the host; a "
                  "graphed step averages with NCCL's all-reduce (no compression hook)")


def wire_dtype(name: str) -> np.dtype:
    """The numpy dtype of a wire format name.

    Raises:
        ValueError: not "float16" or "bfloat16".
        UnsupportedDtypeError: bfloat16 without ml_dtypes installed.
    """
    if name == "float16":
        return np.dtype(np.float16)
    if name == "bfloat16":
        bf16 = bfloat16_dtype()
        if bf16 is None:
            raise UnsupportedDtypeError("bfloat16 compression needs ml_dtypes (pip install axonhpc[bf16])")
        return bf16
    raise InvalidArgumentError(f"unknown wire dtype {name!r}; use one of {WIRE_DTYPES}")


def _compressed(x: Any, wire: str, pg: ProcessGroup, what: str) -> Any:
    check_array(x, f"{what} buffer", writable=True)
    if np.dtype(x.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise UnsupportedDtypeError(f"{what} compresses float32 or float64 arrays, got {x.dtype}")
    dtype = wire_dtype(wire)
    xp = array_module(x)
    half = (x.reshape(-1) / pg.size).astype(dtype)
    return xp.ascontiguousarray(half)


def compressed_all_reduce(x: Any, wire: str = "float16", group: Optional[ProcessGroup] = None) -> None:
    """Average ``x`` over the group in place, with ``wire`` (float16 or bfloat16) on the wire.

    Args:
        x: a writable, contiguous float32 or float64 array (same shape everywhere).
        wire: "float16" or "bfloat16".

    Raises:
        UnsupportedDtypeError: ``x`` is not float32/float64, or bfloat16 without ml_dtypes.
        ValueError: unknown ``wire``.
    """
    pg = member(group, "compressed_all_reduce")
    graphed.admit(pg, "compressed_all_reduce", x, why_not=_RING_IN_GRAPH)
    half = _compressed(x, wire, pg, "compressed_all_reduce")
    entry = start_call(pg, "compressed_all_reduce", half, ReduceOp.SUM).entry
    if pg.size > 1 and half.size:
        execute(half, ring_schedule(pg.size, pg.rank), ReduceOp.SUM, channel(pg), RING_TAG,
                pg.effective_timeout(), f"compressed ({wire}) all_reduce on group {pg.name}")
    x.reshape(-1)[...] = half
    if entry is not None:
        entry[flight.DONE] = True


def compressed_reduce_scatter(x: Any, wire: str = "float16", group: Optional[ProcessGroup] = None) -> Any:
    """This rank's part of the group average of ``x``, with ``wire`` on the wire.

    Returns:
        A new 1-d array of ``x.size // size`` elements in ``x``'s dtype: part ``rank``.

    Raises:
        ShapeError: ``x.size`` is not divisible by the group size.
        UnsupportedDtypeError, ValueError: as ``compressed_all_reduce``.
    """
    pg = member(group, "compressed_reduce_scatter")
    if x.size % pg.size:
        raise ShapeError(f"compressed_reduce_scatter: {x.size} elements do not split into {pg.size} equal parts "
                         f"({x.size} % {pg.size} = {x.size % pg.size})")
    graphed.admit(pg, "compressed_reduce_scatter", x, why_not=_RING_IN_GRAPH)
    half = _compressed(x, wire, pg, "compressed_reduce_scatter")
    entry = start_call(pg, "compressed_reduce_scatter", half, ReduceOp.SUM).entry
    if pg.size > 1 and half.size:
        execute(half, ring_reduce_scatter_schedule(pg.size, pg.rank), ReduceOp.SUM, channel(pg), RING_TAG,
                pg.effective_timeout(), f"compressed ({wire}) reduce_scatter on group {pg.name}")
    if entry is not None:
        entry[flight.DONE] = True
    part = x.size // pg.size
    return half[pg.rank * part:(pg.rank + 1) * part].astype(x.dtype)


__all__ = ["compressed_all_reduce", "compressed_reduce_scatter", "wire_dtype", "WIRE_DTYPES"]
