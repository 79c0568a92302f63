"""FlatBucket: arrays of one dtype that are views of one flat buffer.

DDP's gradients are such views (PyTorch's ``gradient_as_bucket_view``), so backward writes straight
into the buffer that is all-reduced, with no pack copy. The buffer is the model's memory by default,
or one the caller holds (a slice of the node's shared window, so an intra-node all-reduce reads the
other ranks' buckets in place). The compiled ``GradientBucket`` is the other kind: arrays are
*copied* into it, for callers that do not own their memory.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from ..errors import ShapeError, UnsupportedDtypeError
from .ops import FlatOps


class FlatBucket:
    """Arrays of ``shapes`` in one flat buffer of ``dtype``, back to back, each a view of it.

    Args:
        ops: the flat-buffer operations of the memory the bucket lives in.
        flat: the buffer to use (a shared window, say), 1-D, of ``dtype`` and exactly ``numel``
            elements; None allocates a zeroed one with ``ops``.

    Attributes:
        flat: the flat buffer (what is communicated).
        views: one array per shape, sharing ``flat``'s memory.

    Raises:
        ShapeError, UnsupportedDtypeError: ``flat`` does not fit the shapes and dtype.
    """

    def __init__(self, shapes: Sequence[Tuple[int, ...]], dtype: Any, ops: FlatOps, flat: Any = None):
        self.shapes = [tuple(int(n) for n in s) for s in shapes]
        self.dtype = np.dtype(dtype)
        self.ops = ops
        self.numel = sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)
        if flat is None:
            flat = ops.zeros(self.numel, self.dtype)
        elif flat.ndim != 1 or flat.size != self.numel:
            raise ShapeError(f"FlatBucket: the given buffer has shape {tuple(flat.shape)} but the arrays hold "
                             f"{self.numel} elements; it must be 1-D of shape ({self.numel},)")
        elif flat.dtype != self.dtype:
            raise UnsupportedDtypeError(f"FlatBucket: the given buffer has dtype {flat.dtype}, the bucket {self.dtype}")
        self.flat = flat
        self.views: List[Any] = ops.views(flat, self.shapes)

    def __repr__(self) -> str:
        return f"FlatBucket({len(self.shapes)} arrays, numel={self.numel}, dtype={self.dtype}, {self.ops.name})"


__all__ = ["FlatBucket"]
