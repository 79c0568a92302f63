"""``GradBucket``: the one gradient bucket, what a reducer reduces and a communication hook receives."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..buffers import FlatOps
from ..errors import InvalidArgumentError, ShapeError, UnsupportedDtypeError

KINDS = ("all_reduce", "reduce_scatter")


class GradBucket:
    """A flat gradient buffer of one dtype, the gradients it stands for, and the state of its reduction.

    The gradients are either views of ``buffer`` (``views``: backward writes straight into what is reduced,
    PyTorch's ``gradient_as_bucket_view``) or separate arrays (``copies``) packed in before the reduction and
    written back after it.

    Attributes:
        index: its place in the reduction order (DDP, ``GradientSynchronizer``) or the unit's index (FSDP).
        buffer: the flat gradient that is reduced (``parallel.comm_hooks`` says what a hook must leave in it).
        names: names of the parameters whose gradients it holds.
        group: the process group it is reduced over (None: the current world's default group).
        kind: "all_reduce" (DDP, the synchronizer) or "reduce_scatter" (FSDP).
        views: arrays sharing ``buffer``'s memory, one per gradient (``of_views``), else None.
        copies: the arrays the next reduction packs in and writes back, else None.
        work: the reduction in flight (a ``Work``), or None.
        done: its reduction was seen complete before the final wait.
    """

    def __init__(self, index: int, buffer: Any, names: Sequence[str], group: Any, kind: str = "all_reduce"):
        if kind not in KINDS:
            raise InvalidArgumentError(f"unknown bucket kind {kind!r}; use one of {KINDS}")
        self.index, self.buffer, self.names, self.group, self.kind = index, buffer, list(names), group, kind
        self.views: Optional[List[Any]] = None
        self.copies: Optional[List[Any]] = None
        self.work: Any = None
        self.done = False

    @classmethod
    def of_views(cls, index: int, shapes: Sequence[Tuple[int, ...]], dtype: Any, ops: FlatOps,
                 names: Sequence[str], group: Any, buffer: Any = None) -> "GradBucket":
        """A bucket whose gradients of ``shapes`` are views of one buffer, back to back.

        ``buffer``: the memory to use (a slice of the node's shared window, say), 1-D, of ``dtype`` and exactly
        the gradients' elements; None allocates a zeroed one with ``ops``. ShapeError or UnsupportedDtypeError
        if it does not fit.
        """
        shapes = [tuple(int(n) for n in s) for s in shapes]
        dtype = np.dtype(dtype)
        numel = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        if buffer is None:
            buffer = ops.zeros(numel, dtype)
        elif buffer.ndim != 1 or buffer.size != numel:
            raise ShapeError(f"GradBucket: the given buffer has shape {tuple(buffer.shape)} but the gradients hold "
                             f"{numel} elements; it must be 1-D of shape ({numel},)")
        elif buffer.dtype != dtype:
            raise UnsupportedDtypeError(f"GradBucket: the given buffer has dtype {buffer.dtype}, the gradients {dtype}")
        bucket = cls(index, buffer, names, group)
        bucket.views = ops.views(buffer, shapes)
        return bucket

    def __repr__(self) -> str:
        group = getattr(self.group, "name", "default")
        return (f"GradBucket(index={self.index}, kind={self.kind!r}, elements={self.buffer.size}, "
                f"dtype={self.buffer.dtype}, group={group!r})")


__all__ = ["GradBucket", "KINDS"]
