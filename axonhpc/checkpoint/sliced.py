"""Checkpoints of global arrays held in pieces: saved under one parallel layout, loaded under any other.

[Note: boxes]
A model spread over data-, tensor- and pipeline-parallel ranks holds pieces
of its dense arrays: a tensor-parallel shard is a block of rows or columns
of a weight, pipeline ranks hold different layers, data-parallel replicas
hold identical copies. Each piece is described by a ``Box``: the global
shape of the array, the offset of the piece in every dimension and the
piece's own shape. ``save_slices`` takes, on every rank, a mapping from a
global name to ``(box, array)``, or to a list of them when the rank holds
several disjoint boxes of one array; ``load_slices`` takes a mapping from a
name to the box (or list of boxes) this rank wants now, under whatever
layout it runs, and assembles each from the saved boxes that overlap it.

[Note: flat shards]
FSDP keeps, of each parameter, a contiguous range of its C-order
flattening (of the whole parameter, or of this rank's tensor-parallel block
of it). Such a range is not a box but at most ``2 * ndim - 1`` of them: a
partial run of the innermost axis, partial runs of each outer axis up to
the first, one block of whole rows of the first axis, then the same down
again (``flat_range_boxes``, a pure function). A rank gives them as a list
of pieces of the one name; each piece is a view of its flat shard reshaped
to its box, and a load fills views of a flat buffer the same way.

[Note: what a save checks, and who writes]
Before anything is written, the ranks all-gather the small description of
their pieces (name, dtype, box) and each rank computes the same plan from it
(``plan_slices``, a pure function), so every check fails on every rank with
the same message:

- the ranks that hold a name agree on its global shape and dtype;
- a rank gives at most ``MAX_PIECES_PER_FILE`` pieces of one name, and
  not the same (non-empty) box of a name twice;
- boxes that are equal are replicas: the lowest group rank holding one
  writes it, the others write nothing of it (replicas are not compared:
  that would move every array through the network);
- distinct boxes of a name, whichever ranks hold them (the same rank
  included), must not overlap at all (two tensor-parallel shards that share
  a row are a bug in the layout, not replicas), and together they must
  cover the global array: a hole is reported with its name and the first
  uncovered position.

Boxes with no element are allowed (an uneven split over more ranks than
rows) and never written. Every group rank that writes at least one box writes
one file, ``slices-<rank>-of-<size>.npz``, an ordinary checkpoint file (no
pickle, a sha256 per array) mapping a key per box it writes to the piece
(see the index note for the keys). The directory protocol is
``directory``'s: a temporary directory, every file, then the index by rank
0 and an atomic switch, so a crash leaves the previous checkpoint whole.

[Note: the index]
``index.npz`` holds::

    {"format": "axonhpc.sliced/1", "world_size": <group size at save>,
     "arrays": {name: {"shape": [7, 5], "dtype": "<f8",
                       "boxes": [[file rank, [offset...], [shape...]], ...]}},
     "extra": <rank 0's extra>}

A rank that writes one box of a name stores it in its file under the key
``name``, and its index entry is ``[file rank, offset, shape]`` (every
checkpoint of the first version of this format is of this kind, and still
loads). A rank that writes k > 1 boxes of a name stores them under the keys
``name#0`` ... ``name#<k-1>``, in the order it gave them, and box ``i`` is
recorded as ``[file rank, offset, shape, i]``. A save refuses a name that
would collide with such a key in one rank's file (``w#0`` beside a ``w`` of
several pieces).

File names are computed from the file rank and ``world_size`` (never read
from the index), and every integer is checked before it is used: the world
size from 1 to ``MAX_WORLD_SIZE``, a file rank below it, a piece number
below ``MAX_PIECES_PER_FILE``, dimensions and offsets non-negative with
every box inside its global shape; per name, at most one unnumbered box per
file, numbered boxes with distinct (file rank, piece number) and never both
kinds in one file, and at most ``world_size * MAX_PIECES_PER_FILE`` boxes. A
load also checks that the boxes it reads cover each box it wants exactly
once, and, before allocating anything, that the bytes it expects from each
file are no more than the file holds, so a crafted index cannot make a
reader allocate more than the checkpoint could hold.

[Note: reading only what is needed]
A load opens only the files holding a box that overlaps what this rank
wants, and from each reads only the entries it needs (each checked against
its sha256), each once however many wanted boxes it serves. A rank's
result is assembled in new arrays; destinations given to ``load_slices``
are filled only once every rank of the group has read and checked its part,
so a failed load changes nothing on any rank.
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import array_module, is_cupy_array
from ..collectives import all_gather
from ..errors import CheckpointError
from ..groups import resolve_group
from .archive import EntryRefused, open_archive
from .directory import MAX_WORLD_SIZE, _as_checkpoint_error, index_int, member_path, read_index, save_directory
from .format import MAX_META_BYTES, MAX_NDIM, META_ENTRY, decode, parse_meta
from .io import _agree

INDEX_FORMAT = "axonhpc.sliced/1"
MAX_DIM = 1 << 62  # elements along one axis; more is a corrupt index, not a model
MAX_PIECES_PER_FILE = 4096  # pieces of one name from one rank (a flat shard needs at most 2 * ndim - 1)
_PLAIN_KINDS = "biufc"  # what a checkpoint file stores as it is (see ``format``)


# ------------------------------------------------------------------------------------------- boxes

def _int_tuple(values: Any, what: str) -> Tuple[int, ...]:
    """``values`` as a tuple of Python ints (numpy integers accepted).

    Raises:
        CheckpointError: not a sequence of integers, or more than ``MAX_NDIM`` of them.
    """
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError as exc:
        raise CheckpointError(f"{what} {values!r} is not a sequence of integers") from exc
    if len(out) > MAX_NDIM:
        raise CheckpointError(f"{what} {values!r} has {len(out)} dimensions, more than {MAX_NDIM}")
    return out


@dataclasses.dataclass(frozen=True)
class Box:
    """A block of a global array: ``global[offset[0]:offset[0]+shape[0], offset[1]:..., ...]``.

    Attributes:
        global_shape: shape of the whole (dense) array.
        offset: start of the block along every axis.
        shape: extent of the block along every axis (the local array's shape).

    Raises:
        CheckpointError: the three differ in length, a value is negative or
            not an integer, or the block reaches beyond the global shape.
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
        """Block ``index`` of this box cut into ``parts`` along ``axis``.

        The extent ``n`` is cut as ``numpy.array_split`` cuts it: the first
        ``n % parts`` blocks are one longer. Splits compose: ``Box.full((8,
        6)).split(0, i, 2).split(1, j, 3)`` is block (i, j) of a 2 x 3 grid.

        Raises:
            CheckpointError: ``axis`` not an axis of the box, ``parts`` below
                1, or ``index`` not in ``[0, parts)``.
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
        """The block both boxes hold, or None when they share no element.

        Raises:
            CheckpointError: the boxes belong to arrays of different global shapes.
        """
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


def _cover_problem(target: Box, boxes: Sequence[Box]) -> Optional[str]:
    """Why ``boxes`` (inside ``target``) do not cover ``target`` exactly once, or None when they do.

    Disjoint boxes inside the target that leave no hole have volumes summing
    to the target's; a larger sum means an overlap, found pairwise (only then).
    """
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
    """Elements ``[lo, hi)`` (``lo < hi``) of the C-order flattening of ``shape`` as ``(offset, extent)`` blocks.

    The rows of the first axis that the range covers whole are one block; the
    partial rows before and after them are the same problem one axis down.
    """
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

    A pure function, for FSDP's flat shards (see the module note): with
    ``local = global[box.slices]``, concatenating ``global[piece.slices].ravel()``
    over the returned pieces gives ``local.ravel()[start:stop]``, and piece
    ``(piece, a, b)`` is ``local.ravel()[a:b]``. The decomposition is the
    minimal one: a partial run of the innermost axis, partial runs of each
    outer axis up to the first, one block of whole rows of the first axis,
    then the same down again; at most ``2 * ndim - 1`` boxes, none empty
    (none at all for an empty range; ``[(box, 0, 1)]`` for a 0-d box)::

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

    Args:
        box: the block whose flattening is cut (a whole array: ``Box.full(shape)``).
        start: first element of the range, in the block's flattening.
        stop: end of the range (exclusive); ``0 <= start <= stop <= box.size``.

    Returns:
        ``[(piece, a, b), ...]`` in flat order: each piece a Box of the global
        array (offsets include ``box.offset``) and its range ``[a, b)`` of
        the block's flattening; the ranges join into ``[start, stop)``.

    Raises:
        CheckpointError: ``box`` is not a Box, or ``start`` and ``stop`` are
            not integers with ``0 <= start <= stop <= box.size``.
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


# ------------------------------------------------------------------------------------------- dtypes

def _ml_dtypes_name(dtype: np.dtype) -> Optional[str]:
    return dtype.name if getattr(dtype.type, "__module__", "") == "ml_dtypes" else None


def _dtype_text(dtype: np.dtype, what: str) -> str:
    """How the index records ``dtype``: ``"<f4"``, or an ml_dtypes name such as ``"bfloat16"``.

    Raises:
        CheckpointError: a dtype a checkpoint cannot store (object, string, structured).
    """
    ml_name = _ml_dtypes_name(dtype)
    if ml_name is not None:
        return ml_name
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"{what}: arrays of dtype {dtype} cannot be checkpointed (only bool, integer, "
                              f"float, complex and ml_dtypes arrays)")
    return dtype.str


def _parse_dtype(text: Any, what: str) -> np.dtype:
    """The dtype the index records as ``text``.

    Raises:
        CheckpointError: not a dtype a checkpoint stores, or an ml_dtypes type
            without ml_dtypes installed.
    """
    if isinstance(text, str) and text.startswith(("<", ">", "|", "=")):
        try:
            dtype = np.dtype(text)
        except (TypeError, ValueError):
            dtype = None
        if dtype is not None and dtype.kind in _PLAIN_KINDS and dtype.fields is None and dtype.subdtype is None:
            return dtype
    elif isinstance(text, str) and text.isidentifier():
        try:
            import ml_dtypes
        except ImportError as exc:
            raise CheckpointError(f"{what} is a {text} array, which needs the ml_dtypes package "
                                  f"(pip install 'axonhpc[bf16]')") from exc
        if isinstance(getattr(ml_dtypes, text, None), type):
            return np.dtype(getattr(ml_dtypes, text))
    shown = repr(text) if len(repr(text)) <= 80 else repr(text)[:80] + "..."
    raise CheckpointError(f"{what}: dtype {shown} is not a dtype a checkpoint stores (a corrupt or crafted index)")


# ------------------------------------------------------------------------------------------- saving

def slice_file(rank: int, world_size: int) -> str:
    """File name of the boxes group rank ``rank`` wrote: ``slices-00002-of-00004.npz``."""
    return f"slices-{rank:05d}-of-{world_size:05d}.npz"


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise CheckpointError(f"{what}: array names must be str, got {type(name).__name__} {name!r}")
    return name


def _as_piece(name: Any, value: Any, what: str, item: Optional[int] = None) -> Tuple[Box, Any]:
    """``(box, array)`` from ``(Box, array)`` or ``(global_shape, offset, array)``.

    Args:
        name: the array's global name.
        value: the piece.
        what: how messages name it ("piece", "wanted").
        item: its position in the list of pieces of ``name``, or None for a piece given alone.

    Raises:
        CheckpointError: another form, a name that is not a str, or an array
            whose shape is not the box's.
    """
    _check_name(name, what)
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


def _too_many_pieces(count: int) -> str:
    return f"{count} pieces, more than MAX_PIECES_PER_FILE = {MAX_PIECES_PER_FILE} (of one name from one rank)"


def _checked_pieces(pieces: Mapping[str, Any]) -> List[Tuple[str, str, Box, Any]]:
    """Every piece this rank gives as ``(name, dtype text, box, array)``, in order, each checked; nothing copied.

    Raises:
        CheckpointError: ``pieces`` is not a mapping, a piece is malformed or
            of a dtype a checkpoint cannot store, or a list holds more than
            ``MAX_PIECES_PER_FILE`` pieces.
    """
    if not isinstance(pieces, Mapping):
        raise CheckpointError(f"pieces must be a mapping of names to (box, array), got {type(pieces).__name__}")
    out = []
    for name, value in pieces.items():
        _check_name(name, "piece")
        if isinstance(value, list):
            if len(value) > MAX_PIECES_PER_FILE:
                raise CheckpointError(f"piece {name!r}: a list of {_too_many_pieces(len(value))}")
            items: List[Tuple[Optional[int], Any]] = list(enumerate(value))
        else:
            items = [(None, value)]
        for item, piece in items:
            box, array = _as_piece(name, piece, "piece", item)
            dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
            out.append((name, _dtype_text(dtype, f"piece {name!r}"), box, array))
    return out


def _host_array(array: Any, copy: bool) -> np.ndarray:
    """``array`` in host memory, little-endian: cupy arrays copied to the host, numpy ones copied if ``copy``."""
    if is_cupy_array(array):
        host = array.get()
    else:
        host = np.array(array, order="C", copy=True) if copy else np.asarray(array)
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    return host


def _gather_text(text: str, pg: Any) -> List[str]:
    """Collective: every rank's ``text``, in group rank order (a length, then the padded UTF-8 bytes)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    sizes = all_gather(np.array([data.size], dtype=np.int64), group=pg).reshape(-1)
    buffer = np.zeros(int(sizes.max()), dtype=np.uint8)
    buffer[:data.size] = data
    table = all_gather(buffer, group=pg)
    return [table[r, :int(sizes[r])].tobytes().decode("utf-8") for r in range(pg.size)]


def _describe(problem: Optional[str], mine: Sequence[Tuple[str, str, Box, Any]]) -> str:
    """This rank's pieces (or its problem) as JSON for the exchange."""
    pieces = [[name, dtype, list(box.global_shape), list(box.offset), list(box.shape)]
              for name, dtype, box, _ in mine]
    return json.dumps({"problem": problem, "pieces": pieces})


def _read_description(text: str) -> Tuple[Optional[str], List[Tuple[str, str, Box]]]:
    """``_describe``'s JSON back as (problem, [(name, dtype text, box), ...])."""
    data = json.loads(text)
    return data["problem"], [(name, dtype, Box(g, o, s)) for name, dtype, g, o, s in data["pieces"]]


def _shown_ranks(ranks: Sequence[int]) -> str:
    return f"group rank {ranks[0]}" if len(ranks) == 1 else f"group ranks {list(ranks)}"


def _agreed(name: str, what: str, held: Sequence[Tuple[int, Any]]) -> Any:
    """The one value every holder of ``name`` gives for ``what`` (``held``: ``(rank, value)`` in rank order).

    Raises:
        CheckpointError: the holders disagree, naming the ranks and the values.
    """
    by_value: Dict[Any, List[int]] = {}
    for rank, value in held:
        ranks = by_value.setdefault(value, [])
        if not ranks or ranks[-1] != rank:  # a rank of several pieces is named once per value
            ranks.append(rank)
    if len(by_value) > 1:
        seen = ", ".join(f"{_shown_ranks(ranks)} {'say' if len(ranks) > 1 else 'says'} {value}"
                         for value, ranks in by_value.items())
        raise CheckpointError(f"the ranks disagree on the {what} of {name!r}: {seen}")
    return next(iter(by_value))


def _check_pieces_per_rank(name: str, held: Sequence[Tuple[int, str, Box]]) -> None:
    """Refuse more than ``MAX_PIECES_PER_FILE`` pieces of ``name`` from a rank, or a non-empty box given twice."""
    counts: Dict[int, int] = {}
    seen: Dict[Tuple[int, Box], int] = {}
    for rank, _, box in held:
        counts[rank] = counts.get(rank, 0) + 1
        if counts[rank] > MAX_PIECES_PER_FILE:
            total = sum(1 for r, _, _ in held if r == rank)
            raise CheckpointError(f"group rank {rank} gives {name!r} in {_too_many_pieces(total)}")
        if box.size and (rank, box) in seen:
            raise CheckpointError(f"group rank {rank} gives the box at offset {box.offset} of shape {box.shape} of "
                                  f"{name!r} twice (as its pieces {seen[(rank, box)]} and {counts[rank] - 1})")
        seen.setdefault((rank, box), counts[rank] - 1)


def _file_key(name: str, piece: Optional[int]) -> str:
    """The key of a box in its slice file: the name, or ``name#<piece>`` for one of several (see the index note)."""
    return name if piece is None else f"{name}#{piece}"


def plan_slices(table: Sequence[Sequence[Tuple[str, str, Box]]]) -> Tuple[Dict[int, List[str]], Dict[str, Any]]:
    """Who writes which box under which key, and the index entries, from every rank's pieces (a pure function).

    Args:
        table: per group rank, its pieces as ``(name, dtype text, box)``, in
            the order it gave them; a name appears once per piece, so
            several times on a rank that holds several boxes of it.

    Returns:
        ``(writes, arrays)``: group rank -> the keys it writes in its file
        (for its boxes that no lower rank holds and that hold an element:
        ``name`` for a name it writes one box of, ``name#0``, ``name#1``,
        ... in its order for a name it writes several of), by name; and
        name -> the index entry ``{"shape", "dtype", "boxes": [[rank,
        offset, shape], or [rank, offset, shape, i] for key name#i, ...]}``.

    Raises:
        CheckpointError: the holders of a name disagree on its global shape or
            dtype, a rank gives more than ``MAX_PIECES_PER_FILE`` pieces of a
            name or one non-empty box of it twice, two distinct boxes of a
            name overlap, the boxes leave a hole, or a name is also the key
            of another name's piece in one rank's file; naming the array,
            the ranks and the values.
    """
    holders: Dict[str, List[Tuple[int, str, Box]]] = {}
    for rank, pieces in enumerate(table):
        for name, dtype, box in pieces:
            holders.setdefault(name, []).append((rank, dtype, box))
    writes: Dict[int, List[str]] = {}
    arrays: Dict[str, Any] = {}
    keys: Dict[Tuple[int, str], str] = {}  # (rank, key) -> the name whose box it is
    for name in sorted(holders):
        held = holders[name]
        _check_pieces_per_rank(name, held)
        shape = _agreed(name, "global shape", [(r, box.global_shape) for r, _, box in held])
        dtype = _agreed(name, "dtype", [(r, d) for r, d, _ in held])
        writer: Dict[Box, int] = {}
        for rank, _, box in held:  # in rank order, each rank's pieces in its order
            if box.size:
                writer.setdefault(box, rank)  # replicas: the lowest rank holding the box writes it
        problem = _cover_problem(Box.full(shape), list(writer))
        if problem is not None:
            raise CheckpointError(f"the pieces of {name!r} (global shape {shape}) do not cover it exactly once: "
                                  f"{problem} (held by {_holders_text(held)})")
        written: Dict[int, int] = {}
        for rank in writer.values():
            written[rank] = written.get(rank, 0) + 1
        boxes, numbered = [], {}
        for box, rank in writer.items():
            entry = [rank, list(box.offset), list(box.shape)]
            piece = None
            if written[rank] > 1:
                piece = numbered[rank] = numbered.get(rank, -1) + 1
                entry.append(piece)
            key = _file_key(name, piece)
            if (rank, key) in keys:
                several, single = (keys[(rank, key)], name) if piece is None else (name, keys[(rank, key)])
                raise CheckpointError(f"group rank {rank} writes several boxes of {several!r}, stored in its file "
                                      f"as {several + '#<i>'!r}, and a box of {single!r}: both would be stored "
                                      f"under the key {key!r}; rename {single!r}")
            keys[(rank, key)] = name
            writes.setdefault(rank, []).append(key)
            boxes.append(entry)
        arrays[name] = {"shape": list(shape), "dtype": dtype, "boxes": boxes}
    return writes, arrays


def _holders_text(held: Sequence[Tuple[int, str, Box]], limit: int = 8) -> str:
    """Which rank holds which box, for a message (the first ``limit`` pieces)."""
    parts = [f"rank {r}: offset {box.offset} shape {box.shape}" for r, _, box in held[:limit]]
    return "; ".join(parts) + ("; ..." if len(held) > limit else "")


def _file_entries(arrays: Mapping[str, Any], rank: int) -> List[Tuple[str, str, Box]]:
    """``(key, name, box)`` for each box ``plan_slices``'s index entries place in the file of ``rank``."""
    out = []
    for name, entry in arrays.items():
        for item in entry["boxes"]:
            if item[0] == rank:
                box = Box(entry["shape"], item[1], item[2])
                out.append((_file_key(name, item[3] if len(item) == 4 else None), name, box))
    return out


def prepare_slices(path: str, pieces: Mapping[str, Any], pg: Any, extra: Any, copy: bool = False
                   ) -> Tuple[Optional[Tuple[str, Callable[[], Dict[str, np.ndarray]]]], Callable[[], Dict[str, Any]]]:
    """Collective, in the calling thread: every check and the plan of a ``save_slices``, and this rank's part.

    The ranks all-gather the description of their pieces and plan with
    ``plan_slices``, so a malformed piece on any rank, or a layout the plan
    refuses, raises the same CheckpointError on every rank before anything
    is written. The synchronous ``save_slices`` and
    ``AsyncCheckpointer.save_slices`` both start here.

    Args:
        path: the checkpoint directory (for messages).
        pieces: as ``save_slices`` takes them.
        pg: the group (this rank a member).
        extra: what goes into the index as ``extra``.
        copy: ``state()`` copies the numpy arrays this rank writes
            (C-contiguous); False keeps them as given. Cupy arrays are
            always copied to the host.

    Returns:
        ``(my_file, index)``: ``(slice file name, state())`` where
        ``state()`` copies to host memory and returns this rank's file as
        key -> array, or None when this rank writes no box; and a function
        returning the index (for rank 0 once every file is written).

    Raises:
        CheckpointError: on every rank alike, as ``save_slices`` describes.
    """
    mine: List[Tuple[str, str, Box, Any]] = []
    problem: Optional[str] = None
    try:
        mine = _checked_pieces(pieces)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it in the exchange below
        problem = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        mine = []
    texts = _gather_text(_describe(problem, mine), pg) if pg.size > 1 else [_describe(problem, mine)]
    described = [_read_description(text) for text in texts]
    failed = [(rank, why) for rank, (why, _) in enumerate(described) if why is not None]
    if failed:
        raise CheckpointError(f"saving checkpoint {path!r}: nothing was written, a piece was refused on "
                              + "; ".join(f"group rank {rank}: {why}" for rank, why in failed))
    try:
        writes, arrays = plan_slices([pieces_of_rank for _, pieces_of_rank in described])
    except CheckpointError as exc:
        raise CheckpointError(f"saving checkpoint {path!r}: nothing was written, {exc}") from None

    def index() -> Dict[str, Any]:
        return {"format": INDEX_FORMAT, "world_size": pg.size, "arrays": arrays, "extra": extra}

    if not writes.get(pg.rank):
        return None, index
    held = {(name, box): array for name, _, box, array in mine}  # non-empty boxes of a name are distinct
    entries = _file_entries(arrays, pg.rank)

    def state() -> Dict[str, np.ndarray]:
        return {key: _host_array(held[(name, box)], copy) for key, name, box in entries}

    return (slice_file(pg.rank, pg.size), state), index


def save_slices(path: "str | os.PathLike[str]", pieces: Mapping[str, Any], group: Any = None,
                extra: Any = None) -> None:
    """Collective: write the pieces every rank holds as one checkpoint directory (see the module notes).

    Args:
        path: the checkpoint directory; replaced atomically if it exists.
        pieces: global name -> ``(Box, array)`` or ``(global_shape, offset,
            array)`` for the piece this rank holds, or a list of them for
            several disjoint boxes of the name (FSDP's flat shards, see
            ``flat_range_boxes``; an empty list: none). Numpy arrays; cupy
            arrays are copied to the host. Ranks may hold equal boxes
            (replicas: written once) and different names (pipeline stages).
        group: the ranks that take part (None: the default group).
        extra: shared plain state (step, rng states, ...), as ``save`` takes
            it; group rank 0's goes into the index.

    Raises:
        CheckpointError: on every rank, with the same message, when a piece
            is malformed on any rank, the ranks disagree on a name's global
            shape or dtype, a rank gives a box twice or more than
            ``MAX_PIECES_PER_FILE`` pieces of a name, boxes overlap or leave
            a hole (all before anything is written); or when any rank fails
            to write (the previous checkpoint at ``path`` is then left as it
            was).
        NotAMemberError: this rank is not in ``group``.
    """
    path = os.fspath(path)
    pg = resolve_group(group).require_member("checkpoint save_slices")
    my_file, index = prepare_slices(path, pieces, pg, extra)
    save_directory(path, pg, my_file, index)


# ------------------------------------------------------------------------------------------- loading

def _refuse_index(path: str, where: str, value: Any, expected: str) -> NoReturn:
    """Raise the CheckpointError of a malformed index value, naming where it is and what it is."""
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
    raise CheckpointError(f"{path!r}: the index records {where}={shown}; expected {expected} (a corrupt or "
                          f"crafted index)")


def _index_ints(path: str, where: str, value: Any, length: int, high: int) -> Tuple[int, ...]:
    """``value`` checked to be a list of ``length`` ints from 0 to ``high``."""
    if (not isinstance(value, list) or len(value) != length
            or not all(type(v) is int and 0 <= v <= high for v in value)):
        _refuse_index(path, where, value, f"a list of {length} integers from 0 to {high}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class _Saved:
    """One array as the (checked) index records it."""

    shape: Tuple[int, ...]
    dtype: np.dtype
    boxes: Tuple[Tuple[int, str, Box], ...]  # (file rank, key in that file, box)


def _saved_array(path: str, name: str, entry: Any, world_size: int) -> _Saved:
    """The index entry of ``name``, every value checked before use.

    Raises:
        CheckpointError: a malformed entry, naming where and the value.
    """
    where = f"arrays[{name!r}]"
    if not isinstance(entry, dict) or not {"shape", "dtype", "boxes"} <= set(entry):
        _refuse_index(path, where, entry, "a dict with 'shape', 'dtype' and 'boxes'")
    raw_shape = entry["shape"]
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_NDIM:
        _refuse_index(path, f"{where}.shape", raw_shape, f"a list of at most {MAX_NDIM} integers")
    shape = _index_ints(path, f"{where}.shape", raw_shape, len(raw_shape), MAX_DIM)
    dtype = _parse_dtype(entry["dtype"], f"{path!r}: array {name!r}")
    most = world_size * MAX_PIECES_PER_FILE
    if not isinstance(entry["boxes"], list) or len(entry["boxes"]) > most:
        _refuse_index(path, f"{where}.boxes", entry["boxes"], f"a list of at most {most} boxes")
    boxes = []
    pieces: Dict[int, set] = {}  # file rank -> its piece numbers (None: its one unnumbered box)
    for i, item in enumerate(entry["boxes"]):
        at = f"{where}.boxes[{i}]"
        if not isinstance(item, list) or len(item) not in (3, 4):
            _refuse_index(path, at, item, "[file rank, offset, shape] or [file rank, offset, shape, piece]")
        rank = _index_ints(path, f"{at} file rank", [item[0]], 1, world_size - 1)[0]
        offset = _index_ints(path, f"{at} offset", item[1], len(shape), MAX_DIM)
        extent = _index_ints(path, f"{at} shape", item[2], len(shape), MAX_DIM)
        piece = _index_ints(path, f"{at} piece", [item[3]], 1, MAX_PIECES_PER_FILE - 1)[0] if len(item) == 4 \
            else None
        numbers = pieces.setdefault(rank, set())
        if (any(o + s > g for o, s, g in zip(offset, extent, shape)) or piece in numbers
                or (numbers and (piece is None or None in numbers))):
            _refuse_index(path, at, item, f"a box inside the global shape {shape}, one per file, or numbered "
                                          f"pieces [file rank, offset, shape, i] with each (file rank, i) once")
        numbers.add(piece)
        boxes.append((rank, _file_key(name, piece), Box(shape, offset, extent)))
    return _Saved(shape, dtype, tuple(boxes))


def _as_request(name: Any, value: Any, item: Optional[int] = None) -> Tuple[Box, Any]:
    """``(box, destination or None)`` from a Box, ``(Box, array)`` or ``(global_shape, offset, array)``."""
    if isinstance(value, Box):
        _check_name(name, "wanted")
        return value, None
    box, dest = _as_piece(name, value, "wanted", item)
    label = f"wanted {name!r}" + ("" if item is None else f" [{item}]")
    if isinstance(dest, np.ndarray) and not dest.flags.writeable:
        raise CheckpointError(f"{label}: the destination array is read-only")
    if not isinstance(dest, np.ndarray) and not is_cupy_array(dest):
        raise CheckpointError(f"{label}: a destination must be a numpy or cupy array, got {type(dest).__name__}")
    return box, dest


def _as_requests(name: Any, value: Any) -> Tuple[bool, List[Tuple[Box, Any]]]:
    """``(given as a list?, [(box, destination or None), ...])`` for one name of ``wanted``."""
    if isinstance(value, list):
        _check_name(name, "wanted")
        return True, [_as_request(name, item, i) for i, item in enumerate(value)]
    return False, [_as_request(name, value)]


def _plan_read(path: str, saved: _Saved, name: str, want: Box,
               dtype: Optional[np.dtype]) -> List[Tuple[int, str, Box, Box]]:
    """The saved boxes to read for ``want``: ``[(file rank, key, saved box, the part of it wanted)]``.

    Raises:
        CheckpointError: the global shape or dtype differs from the
            checkpoint's (naming both), or the saved boxes do not cover
            ``want`` exactly once (a crafted index).
    """
    if want.global_shape != saved.shape:
        raise CheckpointError(f"{path!r}: array {name!r} has global shape {saved.shape} in the checkpoint; the "
                              f"requested global shape is {want.global_shape}")
    if dtype is not None and np.dtype(dtype) != saved.dtype:
        raise CheckpointError(f"{path!r}: array {name!r} is {saved.dtype} in the checkpoint; the destination is "
                              f"{np.dtype(dtype)}")
    parts = [(rank, key, box, common) for rank, key, box in saved.boxes
             if (common := box.intersect(want)) is not None]
    problem = _cover_problem(want, [common for _, _, _, common in parts])
    if problem is not None:
        raise CheckpointError(f"{path!r}: the saved boxes of {name!r} do not cover the requested offset "
                              f"{want.offset} shape {want.shape} exactly once: {problem} (a corrupt or crafted "
                              f"index)")
    return parts


def _read_entries(path: str, names: Sequence[str], source: str) -> Dict[str, np.ndarray]:
    """The arrays ``names`` of one slice file, reading (and verifying) only those entries.

    Raises:
        CheckpointError: the file is missing, not a slice file, lacks a name,
            or an entry is refused (see ``archive`` and ``format``).
    """
    with open_archive(path, source) as archive:
        if META_ENTRY not in archive.names:
            raise CheckpointError(f"{source}: not an axonhpc checkpoint (no {META_ENTRY!r} entry)")
        try:
            raw = archive.read(META_ENTRY, max_bytes=MAX_META_BYTES)
        except EntryRefused as exc:
            raise CheckpointError(f"{source}: entry {META_ENTRY!r} cannot be read ({exc})") from exc
        meta = parse_meta(raw, source)
        tree = meta["tree"]
        items = tree.get("items") if isinstance(tree, dict) and tree.get("t") == "dict" else None
        if not isinstance(items, list):
            raise CheckpointError(f"{source}: not a slice file (its state is not a dict of arrays)")
        described = {item[1].get("entry") for item in items
                     if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)}
        undescribed = sorted(set(archive.names) - described - {META_ENTRY})
        if undescribed:
            raise CheckpointError(f"{source}: entries {undescribed[:10]} are not described by the metadata; the "
                                  f"file was altered after it was written")
        wanted = set(names)
        chosen = [item for item in items if isinstance(item, list) and len(item) == 2 and item[0] in wanted]
        found = [item[0] for item in chosen]
        if sorted(found) != sorted(wanted):
            missing = sorted(wanted - set(found)) or sorted(n for n in found if found.count(n) > 1)
            raise CheckpointError(f"{source}: the file holds {missing[:10]} not exactly once, as the index says "
                                  f"it does")
        return decode(dict(meta, tree={"t": "dict", "items": chosen}), archive, [], source)


def _check_file_sizes(path: str, world_size: int, needs: Mapping[int, Mapping[str, Tuple[str, Box]]],
                      saved: Mapping[str, _Saved]) -> None:
    """Refuse to allocate for a file more bytes than it holds (a crafted index), before anything is read."""
    for rank, keys in needs.items():
        file = member_path(path, slice_file(rank, world_size), f"slice file of rank {rank}")
        claimed = sum(box.size * saved[name].dtype.itemsize for name, box in keys.values())
        try:
            size = os.path.getsize(file)
        except OSError as exc:
            raise CheckpointError(f"{path!r}: cannot read slice file {slice_file(rank, world_size)!r}: {exc}") \
                from exc
        if claimed > size:
            raise CheckpointError(f"{path!r}: the index places {claimed} bytes of arrays in "
                                  f"{slice_file(rank, world_size)!r}, which holds {size} (a corrupt or crafted "
                                  f"index)")


def _read_boxes(path: str, requests: Mapping[str, Sequence[Tuple[Optional[Box], Optional[np.dtype]]]]
                ) -> Tuple[Dict[str, List[np.ndarray]], Any, bytes]:
    """Assemble every requested box (None: the whole array) on this rank alone.

    Args:
        path: the checkpoint directory.
        requests: name -> ``[(box or None, destination dtype or None), ...]``.

    Returns:
        ``(arrays, extra, digest)``: name -> new host arrays, one per
        request in order; the saved ``extra``; the sha256 of the index's
        metadata.

    Raises:
        CheckpointError: see ``load_slices``.
    """
    index, digest = read_index(path, INDEX_FORMAT)
    world_size = index_int(index, "world_size", path, 1, MAX_WORLD_SIZE)
    recorded = index.get("arrays")
    if not isinstance(recorded, dict):
        _refuse_index(path, "arrays", type(recorded).__name__, "a dict of array names to entries")
    saved: Dict[str, _Saved] = {}
    needs: Dict[int, Dict[str, Tuple[str, Box]]] = {}  # file rank -> key -> (name, saved box)
    parts: Dict[int, List[Tuple[str, str, int, Box, Box]]] = {}  # file rank -> (name, key, request, box, common)
    wants: Dict[str, List[Box]] = {}
    for name, asked in requests.items():
        if name not in recorded:
            held = sorted(recorded)
            raise CheckpointError(f"{path!r} holds no array {name!r} (it holds {len(held)}: {held[:10]}"
                                  f"{' ...' if len(held) > 10 else ''})")
        saved[name] = _saved_array(path, name, recorded[name], world_size)
        wants[name] = [Box.full(saved[name].shape) if want is None else want for want, _ in asked]
        for j, (want, (_, dtype)) in enumerate(zip(wants[name], asked)):
            for rank, key, box, common in _plan_read(path, saved[name], name, want, dtype):
                needs.setdefault(rank, {})[key] = (name, box)
                parts.setdefault(rank, []).append((name, key, j, box, common))
    _check_file_sizes(path, world_size, needs, saved)
    out = {name: [np.empty(want.shape, dtype=saved[name].dtype) for want in boxes] for name, boxes in wants.items()}
    for rank in sorted(needs):
        file_name = slice_file(rank, world_size)
        file = member_path(path, file_name, f"slice file of rank {rank}")
        arrays = _read_entries(file, list(needs[rank]), f"checkpoint {file!r}")
        for key, (name, box) in needs[rank].items():
            array = arrays[key]
            if not isinstance(array, np.ndarray) or array.shape != box.shape or array.dtype != saved[name].dtype:
                raise CheckpointError(f"{path!r}: {file_name!r} holds {key!r} as "
                                      f"{getattr(array, 'dtype', type(array).__name__)} of shape "
                                      f"{getattr(array, 'shape', None)}; the index says {saved[name].dtype} of "
                                      f"shape {box.shape}")
        for name, key, j, box, common in parts[rank]:
            out[name][j][common.within(wants[name][j])] = arrays[key][common.within(box)]
    return out, index["extra"], digest


def load_slices(path: "str | os.PathLike[str]", wanted: Mapping[str, Any], group: Any = None
                ) -> Tuple[Dict[str, Any], Any]:
    """Collective: the boxes this rank wants, assembled from a ``save_slices`` checkpoint of any layout.

    Reads only the files holding a saved box that overlaps a wanted box, and
    only the entries it needs from them (each once); the ranks then agree
    that every rank succeeded and read the same checkpoint, and only then
    are destinations filled.

    Args:
        path: the directory ``save_slices`` wrote (on a filesystem every rank shares).
        wanted: name -> a ``Box`` (returned as a new numpy array of the
            checkpoint's dtype), or ``(Box, array)`` / ``(global_shape,
            offset, array)`` with a numpy or cupy destination of the box's
            shape and the checkpoint's dtype, filled in place; or a list of
            these (several boxes of one name, e.g. the pieces of a flat
            shard from ``flat_range_boxes`` with views of the shard as
            destinations).
        group: the ranks that take part (None: the default group).

    Returns:
        ``(arrays, extra)``: name -> the array (the destination itself where
        one was given), or for a list the list of them in the same order;
        and the ``extra`` saved with the checkpoint.

    Raises:
        CheckpointError: on every rank, if any rank wants a name the
            checkpoint lacks, a global shape or dtype other than the
            checkpoint's (naming both), a box outside its global shape, or
            finds a file or the index missing, malformed or corrupt; or if the
            ranks read different checkpoints. No destination is changed.
        NotAMemberError: this rank is not in ``group``.
    """
    path = os.fspath(path)
    pg = resolve_group(group).require_member("checkpoint load_slices")
    requests: Dict[str, Tuple[bool, List[Tuple[Box, Any]]]] = {}
    arrays: Dict[str, List[np.ndarray]] = {}
    extra: Any = None
    digest = bytes(32)
    problem: Optional[BaseException] = None
    try:
        if not isinstance(wanted, Mapping):
            raise CheckpointError(f"wanted must be a mapping of names to boxes, got {type(wanted).__name__}")
        requests = {name: _as_requests(name, value) for name, value in wanted.items()}
        arrays, extra, digest = _read_boxes(path, {
            name: [(box, None if dest is None else dest.dtype) for box, dest in asked]
            for name, (_, asked) in requests.items()})
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it before this rank raises
        problem = _as_checkpoint_error(exc, f"loading checkpoint {path!r} failed on group rank {pg.rank}")
    if pg.size > 1:
        _agree(pg, path, problem is not None, digest)
    if problem is not None:
        raise problem
    out: Dict[str, Any] = {}
    for name, (as_list, asked) in requests.items():
        results = []
        for (_, dest), array in zip(asked, arrays[name]):
            if dest is not None:
                dest[...] = array_module(dest).asarray(array)
            results.append(array if dest is None else dest)
        out[name] = results if as_list else results[0]
    return out, extra


def read_full(path: "str | os.PathLike[str]",
              names: Optional[Sequence[str]] = None) -> Tuple[Dict[str, np.ndarray], Any]:
    """The whole global arrays of a ``save_slices`` checkpoint, in this process alone (no group).

    For tools, and for loading into a model that runs in one process.

    Args:
        path: the checkpoint directory.
        names: the arrays to read; None: every array of the checkpoint.

    Returns:
        ``(arrays, extra)``: name -> the global numpy array, and the saved ``extra``.

    Raises:
        CheckpointError: a name the checkpoint lacks, or a file or the index
            missing, malformed or corrupt.
    """
    path = os.fspath(path)
    try:
        if names is None:
            index, _ = read_index(path, INDEX_FORMAT)
            recorded = index.get("arrays")
            if not isinstance(recorded, dict):
                _refuse_index(path, "arrays", type(recorded).__name__, "a dict of array names to entries")
            names = list(recorded)
        arrays, extra, _ = _read_boxes(path, {name: [(None, None)] for name in names})
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is a CheckpointError
        raise CheckpointError(f"reading checkpoint {path!r}: {type(exc).__name__}: {exc}") from exc
    return {name: got[0] for name, got in arrays.items()}, extra


__all__ = ["Box", "save_slices", "load_slices", "read_full", "plan_slices", "prepare_slices", "flat_range_boxes",
           "slice_file", "INDEX_FORMAT", "MAX_PIECES_PER_FILE"]
