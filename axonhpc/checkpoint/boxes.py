"""Boxes: the blocks of global arrays that ranks hold, and FSDP's flat ranges cut into boxes.

[Note: flat shards]
FSDP keeps a contiguous range of each parameter's C-order flattening. Such a range is not a box but at most
``2 * ndim - 1`` of them (``flat_range_boxes``), each a view of the flat shard reshaped to its box.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import is_cupy_array
from ..errors import CheckpointError
from .format import MAX_NDIM


def _int_tuple(values: Any, what: str) -> Tuple[int, ...]:
    """``values`` as a tuple of Python ints; CheckpointError if not integers or more than ``MAX_NDIM``."""
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError as exc:
        raise CheckpointError(f"{what} {values!r} is not a sequence of integers") from exc
    if len(out) > MAX_NDIM:
        raise CheckpointError(f"{what} {values!r} has {len(out)} dimensions, more than {MAX_NDIM}")
    return out


@dataclasses.dataclass(frozen=True)
class Box:
    """A block of a global array: ``global[offset[0]:offset[0]+shape[0], ...]``.

    Raises CheckpointError if ``global_shape``, ``offset`` and ``shape`` differ in length, hold a negative or
    non-integer value, or the block reaches beyond the global shape.
    """

    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]

    def __post_init__(self) -> None:
        global_shape = _int_tuple(self.global_shape, "global shape")
        offset = _int_tuple(self.offset, "offset")
        shape = _int_tuple(self.shape, "shape")
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "shape", shape)
        if not len(global_shape) == len(offset) == len(shape):
            raise CheckpointError(f"a box needs one offset and one extent per axis: global shape {global_shape}, "
                                  f"offset {offset}, shape {shape}")
        if any(v < 0 for v in global_shape + offset + shape):
            raise CheckpointError(f"box with a negative value: global shape {global_shape}, offset {offset}, "
                                  f"shape {shape}")
        if any(o + s > g for o, s, g in zip(offset, shape, global_shape)):
            raise CheckpointError(f"box at offset {offset} of shape {shape} reaches beyond the global shape "
                                  f"{global_shape} (it ends at {self.stop})")

    @classmethod
    def full(cls, global_shape: Sequence[int]) -> "Box":
        """The whole array of shape ``global_shape``."""
        global_shape = _int_tuple(global_shape, "global shape")
        return cls(global_shape, (0,) * len(global_shape), global_shape)

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self.global_shape)

    @property
    def stop(self) -> Tuple[int, ...]:
        """End of the block along every axis (exclusive)."""
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def size(self) -> int:
        """Number of elements in the block (1 for a 0-d array)."""
        return int(np.prod(self.shape, dtype=object))

    @property
    def slices(self) -> Tuple[slice, ...]:
        """The block as an index into the global array: ``global[box.slices]``."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def split(self, axis: int, index: int, parts: int) -> "Box":
        """Block ``index`` of this box cut into ``parts`` along ``axis``, as ``numpy.array_split`` cuts; splits compose.

        Raises CheckpointError for a bad axis, ``parts`` below 1 or ``index`` outside ``[0, parts)``.
        """
        if not 0 <= axis < self.ndim or parts < 1 or not 0 <= index < parts:
            raise CheckpointError(f"cannot take block {index} of {parts} along axis {axis} of a box of shape "
                                  f"{self.shape}")
        base, longer = divmod(self.shape[axis], parts)
        start = self.offset[axis] + index * base + min(index, longer)
        length = base + (index < longer)
        offset = self.offset[:axis] + (start,) + self.offset[axis + 1:]
        shape = self.shape[:axis] + (length,) + self.shape[axis + 1:]
        return Box(self.global_shape, offset, shape)

    def intersect(self, other: "Box") -> Optional["Box"]:
        """The block both boxes hold, or None; CheckpointError if their global shapes differ."""
        if other.global_shape != self.global_shape:
            raise CheckpointError(f"boxes of arrays of global shapes {self.global_shape} and {other.global_shape} "
                                  f"do not intersect")
        start = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(lo >= hi for lo, hi in zip(start, stop)):
            return None
        return Box(self.global_shape, start, tuple(hi - lo for lo, hi in zip(start, stop)))

    def within(self, outer: "Box") -> Tuple[slice, ...]:
        """This box as an index into the local array of ``outer`` (which must contain it)."""
        return tuple(slice(o - p, o - p + s) for o, p, s in zip(self.offset, outer.offset, self.shape))


def _subtract(a: Box, b: Box) -> List[Box]:
    """``a`` without ``b``, as disjoint boxes (``a`` itself when they do not meet)."""
    common = a.intersect(b)
    if common is None:
        return [a]
    pieces = []
    lo, hi = list(a.offset), list(a.stop)
    for axis in range(a.ndim):
        for start, stop in ((lo[axis], common.offset[axis]), (common.stop[axis], hi[axis])):
            if start < stop:
                offset = tuple(lo[:axis]) + (start,) + tuple(lo[axis + 1:])
                shape = tuple(h - l for l, h in zip(lo, hi))
                pieces.append(Box(a.global_shape, offset, shape[:axis] + (stop - start,) + shape[axis + 1:]))
        lo[axis], hi[axis] = common.offset[axis], common.stop[axis]
    return pieces


def cover_problem(target: Box, boxes: Sequence[Box]) -> Optional[str]:
    """Why ``boxes`` do not cover ``target`` exactly once, or None (overlaps searched only when volumes exceed)."""
    remaining = [target] if target.size else []
    for box in boxes:
        remaining = [piece for part in remaining for piece in _subtract(part, box)]
    covered = target.size - sum(piece.size for piece in remaining)
    if sum(box.size for box in boxes) > covered:
        for i, first in enumerate(boxes):
            for second in boxes[i + 1:]:
                if first.intersect(second) is not None:
                    return (f"the boxes at offset {first.offset} of shape {first.shape} and at offset "
                            f"{second.offset} of shape {second.shape} overlap")
    if remaining:
        return f"position {remaining[0].offset} is in no box"
    return None


def _flat_runs(shape: Tuple[int, ...], lo: int, hi: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Elements ``[lo, hi)`` (``lo < hi``) of the C-order flattening of ``shape`` as ``(offset, extent)`` blocks."""
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    rest = shape[1:]
    row = int(np.prod(rest, dtype=object))  # > 0: the range is not empty
    first, head = divmod(lo, row)
    last, tail = divmod(hi, row)
    if first == last:  # inside one row
        return [((first,) + o, (1,) + e) for o, e in _flat_runs(rest, head, tail)]
    runs = []
    if head:
        runs += [((first,) + o, (1,) + e) for o, e in _flat_runs(rest, head, row)]
        first += 1
    if first < last:
        runs.append(((first,) + (0,) * len(rest), (last - first,) + rest))
    if tail:
        runs += [((last,) + o, (1,) + e) for o, e in _flat_runs(rest, 0, tail)]
    return runs


def flat_range_boxes(box: Box, start: int, stop: int) -> List[Tuple[Box, int, int]]:
    """The elements ``[start, stop)`` of the C-order flattening of the block ``box``, as boxes of the global array.

    A pure function, for FSDP's flat shards: with ``local = global[box.slices]``, piece ``(piece, a, b)`` is
    ``local.ravel()[a:b]``, and the pieces in order join into ``local.ravel()[start:stop]``. At most
    ``2 * ndim - 1`` boxes, none empty (none for an empty range; ``[(box, 0, 1)]`` for a 0-d box)::

        >>> block = Box((4, 6), (1, 2), (3, 4))  # global[1:4, 2:6]
        >>> for piece, a, b in flat_range_boxes(block, 3, 10):
        ...     print(piece.offset, piece.shape, a, b)
        (1, 5) (1, 1) 3 4
        (2, 2) (1, 4) 4 8
        (3, 2) (1, 2) 8 10
        >>> g = np.arange(24).reshape(4, 6)
        >>> np.concatenate([g[p.slices].ravel() for p, _, _ in flat_range_boxes(block, 3, 10)]).tolist()
        [11, 14, 15, 16, 17, 20, 21]
        >>> g[block.slices].ravel()[3:10].tolist()
        [11, 14, 15, 16, 17, 20, 21]

    Raises CheckpointError unless ``box`` is a Box and ``0 <= start <= stop <= box.size`` are integers.
    """
    if not isinstance(box, Box):
        raise CheckpointError(f"flat_range_boxes: expected a Box, got {type(box).__name__}")
    try:
        lo, hi = operator.index(start), operator.index(stop)
    except TypeError as exc:
        raise CheckpointError(f"flat_range_boxes: start {start!r} and stop {stop!r} must be integers") from exc
    if not 0 <= lo <= hi <= box.size:
        raise CheckpointError(f"flat_range_boxes: the range [{lo}, {hi}) is not inside the {box.size} elements of "
                              f"the block at offset {box.offset} of shape {box.shape} (0 <= start <= stop <= "
                              f"{box.size} is needed)")
    if lo == hi:
        return []
    pieces = []
    for offset, extent in _flat_runs(box.shape, lo, hi):
        size = int(np.prod(extent, dtype=object))
        pieces.append((Box(box.global_shape, tuple(o + p for o, p in zip(offset, box.offset)), extent), lo,
                       lo + size))
        lo += size
    return pieces


def check_name(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise CheckpointError(f"{what}: array names must be str, got {type(name).__name__} {name!r}")
    return name


def as_piece(name: Any, value: Any, what: str, item: Optional[int] = None) -> Tuple[Box, Any]:
    """``(box, array)`` from ``(Box, array)`` or ``(global_shape, offset, array)``; CheckpointError otherwise.

    ``item`` is the piece's position in the list of pieces of ``name`` (None for one given alone).
    """
    check_name(name, what)
    label = f"{what} {name!r}" + ("" if item is None else f" [{item}]")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Box):
        box, array = value
    elif isinstance(value, tuple) and len(value) == 3:
        global_shape, offset, array = value
        box = Box(global_shape, offset, getattr(array, "shape", ()))
    else:
        raise CheckpointError(f"{label}: expected (Box, array) or (global_shape, offset, array)"
                              f"{'' if item is not None else ', or a list of them'}, got {type(value).__name__}")
    if not (isinstance(array, (np.ndarray, np.generic)) or is_cupy_array(array)):
        raise CheckpointError(f"{label}: expected a numpy or cupy array, got {type(array).__name__}")
    if tuple(array.shape) != box.shape:
        raise CheckpointError(f"{label}: the array has shape {tuple(array.shape)}, its box {box.shape}")
    return box, array


__all__ = ["Box", "flat_range_boxes"]
