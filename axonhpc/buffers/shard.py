"""FlatShard: arrays of one dtype as one padded flat vector cut into equal parts.

FSDP's flat parameter, ZeRO-1's optimizer shards and the parameter server's slices share this. The
arithmetic is the compiled ``FlatLayout``'s (padded to a multiple of the parts, part ``k`` being
``[k * n, (k + 1) * n)``); this class adds the copies, in the model's memory, written once for all three.

[Note: missing arrays]
A parameter that took no part in a backward has ``grad is None``. Every copy *into* a flat vector
takes None as zeros without allocating them, so the padded vector a collective sends is the same
whatever was missing.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .._ext import _shard
from ..errors import ShapeError
from .ops import FlatOps

Span = Tuple[int, int, int, int]


class FlatShard:
    """Arrays of one dtype as one flat vector, zero-padded to a multiple of ``parts``, in ``parts`` parts.

    Attributes:
        layout: the ``FlatLayout`` (shapes, offsets, sizes, numel, padded_numel).
        part_numel: elements of one part.

    Raises:
        UnsupportedDtypeError, InvalidArgumentError: from ``FlatLayout``.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: Any, parts: int, ops: FlatOps):
        self.layout = _shard.FlatLayout(shapes, dtype, parts)
        self.ops = ops
        self.xp = ops.xp
        self.part_numel = self.layout.padded_numel // self.layout.world_size

    def __repr__(self) -> str:
        return (f"FlatShard({len(self.layout.shapes)} arrays, numel={self.layout.numel}, dtype={self.dtype}, "
                f"parts={self.parts}, {self.ops.name})")

    @property
    def dtype(self) -> np.dtype:
        """The arrays' dtype."""
        return self.layout.dtype

    @property
    def numel(self) -> int:
        """Elements of the arrays (unpadded)."""
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        """Elements of the padded flat vector."""
        return self.layout.padded_numel

    @property
    def parts(self) -> int:
        """How many parts the padded vector is cut into."""
        return self.layout.world_size

    def with_dtype(self, dtype: Any) -> "FlatShard":
        """The same arrays and parts in another dtype (FSDP's compute and reduce dtypes)."""
        return FlatShard(self.layout.shapes, dtype, self.parts, self.ops)

    def bounds(self, part: int) -> Tuple[int, int, int]:
        """``(start, stop, pad)`` of ``part`` in the padded vector (``pad``: its positions at or past numel)."""
        return self.layout.shard_bounds(part)

    def spans(self, part: int) -> List[Span]:
        """What of each array ``part`` holds.

        Returns:
            ``(i, first, last, at)`` per array ``i`` with elements in the part:
            elements ``[first, last)`` of array ``i``'s C-order flattening are
            the part's ``[at, at + last - first)``. Padding is in no span.
        """
        start, stop, _ = self.bounds(part)
        out = []
        for i, (offset, size) in enumerate(zip(self.layout.offsets, self.layout.sizes)):
            lo, hi = max(offset, start), min(offset + size, stop)
            if lo < hi:
                out.append((i, lo - offset, hi - offset, lo - start))
        return out

    def empty(self) -> Any:
        """An uninitialised padded flat vector."""
        return self.ops.empty(self.padded_numel, self.dtype)

    def zeros(self) -> Any:
        """A zeroed padded flat vector."""
        return self.ops.zeros(self.padded_numel, self.dtype)

    def _check_count(self, arrays: Sequence[Any], what: str) -> None:
        if len(arrays) != len(self.layout.shapes):
            raise ShapeError(f"{what}: {len(arrays)} arrays for a flat vector of {len(self.layout.shapes)}")

    def pack(self, arrays: Sequence[Optional[Any]], out: Any = None) -> Any:
        """The arrays, back to back, into a padded flat vector (None as zeros; see the note).

        ``arrays``: one per shape, None for zeros, another dtype cast; ``out``: the vector (None: a new one).
        """
        arrays = list(arrays)
        self._check_count(arrays, "FlatShard.pack")
        out = self.empty() if out is None else out
        if all(a is not None and a.dtype == out.dtype for a in arrays):
            return self.ops.pack_padded(arrays, out, self.numel)  # the compiled (or device) copy
        for a, offset, size in zip(arrays, self.layout.offsets, self.layout.sizes):
            if a is None:
                out[offset:offset + size] = 0
            else:
                out[offset:offset + size] = a.reshape(-1)
        out[self.numel:] = 0
        return out

    def pack_part(self, arrays: Sequence[Optional[Any]], part: int, out: Any) -> Any:
        """Only ``part``'s elements of ``pack(arrays)`` into ``out`` (``part_numel`` long), padding as zeros."""
        arrays = list(arrays)
        self._check_count(arrays, "FlatShard.pack_part")
        filled = 0
        for i, first, last, at in self.spans(part):
            a = arrays[i]
            if a is None:
                out[at:at + last - first] = 0
            else:
                out[at:at + last - first] = a.reshape(-1)[first:last]
            filled = at + last - first
        out[filled:] = 0
        return out

    def unpack(self, flat: Any, arrays: Sequence[Any]) -> None:
        """The first ``numel`` elements of ``flat`` (padded or not) into the arrays, in place."""
        arrays = list(arrays)
        self._check_count(arrays, "FlatShard.unpack")
        self.ops.unpack(flat[:self.numel], arrays)

    def views(self, flat: Any) -> List[Any]:
        """Arrays of the shapes sharing ``flat``'s memory (``flat``: a padded or unpadded flat vector)."""
        return self.ops.views(flat, self.layout.shapes)


__all__ = ["FlatShard"]
