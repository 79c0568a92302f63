"""Folding one rank's array into an accumulator: the elementwise step every reduction here is made of.

[Note: MIN and MAX of floats are IEEE 754-2019 minimum and maximum]
A float MIN or MAX gives the same bits on every rank, in every order and on every path: a NaN in any
rank's element gives NaN there (which NaN, its sign and payload, is not promised), and -0.0 counts as
less than +0.0, so MIN of a -0.0 and a +0.0 is -0.0 and MAX is +0.0. ``np.minimum``/``np.maximum``
return whichever zero comes second, so folding the same values in another order (MPI's recursive
doubling gives each rank its own) gave another sign; ordered this way both ops are commutative and
associative bit for bit, so no order can show. The element function is the node engine's
(``ax_fmin_*``/``ax_fmax_*`` in cython_src/shm_engine.h: on a tie the bits are ORed for MIN, ANDed for
MAX); ``_shm.MinMax`` runs it on two host buffers, for MPI's user op (``backends.mpi_work``), the thread
backend and ring/rhd (``collectives.ring``). Device arrays, and dtypes the kernels do not take, fold with
``_fold_ufunc``: the numpy/cupy ufunc, then the same OR/AND of the bits where the operands were equal.
NCCL reduces device arrays with its own MIN/MAX, which this does not cover (docs/collectives.md).
Integers are exact in any order and keep the plain ufuncs, and so do SUM and PRODUCT.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from .._dtypes import array_module
from .._ext import _shm
from .base import ReduceOp

_UFUNCS = {ReduceOp.SUM: "add", ReduceOp.PRODUCT: "multiply", ReduceOp.MIN: "minimum", ReduceOp.MAX: "maximum"}
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_KERNELS: Dict[Tuple[ReduceOp, np.dtype], Any] = {}


def min_max_kernel(op: ReduceOp, dtype: Any) -> Any:
    """The engine's MIN or MAX of ``dtype`` (float32 or float64) as a callable ``(inbuf, inoutbuf, datatype=None)``.

    It sets ``inoutbuf`` to ``inbuf op inoutbuf``, and is what MPI's user op calls (see the module note).
    """
    key = (op, np.dtype(dtype))
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _shm.MinMax(op.name, key[1])
    return found


def _fold_ufunc(xp: Any, op: ReduceOp, acc: Any, other: Any) -> None:
    """``acc = acc op other`` with the array module's ufunc, and for float MIN/MAX the note's ties."""
    ufunc = getattr(xp, _UFUNCS[op])
    if op not in (ReduceOp.MIN, ReduceOp.MAX) or np.dtype(acc.dtype).kind not in "fV":
        ufunc(acc, other, out=acc)
        return
    bits = _BITS[acc.dtype.itemsize]
    mine, theirs = acc.view(bits), other.view(bits)
    tie = acc == other  # never true for a NaN
    joined = (mine | theirs) if op is ReduceOp.MIN else (mine & theirs)  # before the ufunc overwrites either zero
    if xp is np:
        with np.errstate(invalid="ignore"):  # ml_dtypes' bfloat16 warns of the NaN it propagates
            ufunc(acc, other, out=acc)
    else:
        ufunc(acc, other, out=acc)
    xp.copyto(mine, joined, where=tie)


def fold(op: ReduceOp, acc: Any, other: Any) -> None:
    """Set ``acc`` to ``acc op other`` elementwise, in place (SUM, PRODUCT, MIN or MAX; AVG is a SUM first).

    ``acc`` and ``other`` have one shape and dtype, numpy or cupy arrays alike. Float MIN and MAX follow
    the module note, on the host with the engine's own kernel.
    """
    if (op is ReduceOp.MIN or op is ReduceOp.MAX) and type(acc) is np.ndarray and type(other) is np.ndarray \
            and acc.dtype in _KERNEL_DTYPES and other.dtype == acc.dtype \
            and acc.flags.c_contiguous and other.flags.c_contiguous and acc.size == other.size:
        min_max_kernel(op, acc.dtype)(other, acc)
        return
    _fold_ufunc(array_module(acc), op, acc, other)


__all__ = ["fold", "min_max_kernel"]
