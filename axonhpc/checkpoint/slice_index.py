"""The index and the files of a sliced checkpoint: names, keys, dtype text and the checked reading of an entry.

[Note: the index]
``index.npz`` holds::

    {"format": "axonhpc.sliced/2", "world_size": <group size at save>,
     "arrays": {name: {"shape": [7, 5], "dtype": "<f8",
                       "boxes": [[file rank, [offset...], [shape...]], ...]}},
     "extra": <rank 0's extra>}

Version 2 adds the save token in the metadata of the index and of every file (``checkpoint.directory``'s
note); version 1 indexes still load, unchecked. A rank that writes one box of a name stores it under the key
``name`` (the first checkpoints of the format have only these, and still load); k > 1 boxes go under
``name#0`` ... ``name#<k-1>`` and are recorded as ``[file rank, offset, shape, i]``. File names are computed, never read from the index, and every integer is
checked before use; a load also checks, before allocating, that the bytes it expects from each file are no
more than the file holds, so a crafted index cannot make a reader allocate more than the checkpoint holds.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, NoReturn, Optional, Tuple

import numpy as np

from ..errors import CheckpointError
from .boxes import Box
from .format import MAX_NDIM

INDEX_FORMAT = "axonhpc.sliced/2"  # /1: before save tokens (still read)
MAX_DIM = 1 << 62  # elements along one axis; more is a corrupt index, not a model
MAX_PIECES_PER_FILE = 4096  # pieces of one name from one rank (a flat shard needs at most 2 * ndim - 1)
_PLAIN_KINDS = "biufc"  # what a checkpoint file stores as it is (see ``format``)


def _ml_dtypes_name(dtype: np.dtype) -> Optional[str]:
    return dtype.name if getattr(dtype.type, "__module__", "") == "ml_dtypes" else None


def dtype_text(dtype: np.dtype, what: str) -> str:
    """How the index records ``dtype``: ``"<f4"``, or an ml_dtypes name such as ``"bfloat16"``.

    Raises CheckpointError for a dtype a checkpoint cannot store (object, string, structured).
    """
    ml_name = _ml_dtypes_name(dtype)
    if ml_name is not None:
        return ml_name
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"{what}: arrays of dtype {dtype} cannot be checkpointed (only bool, integer, "
                              f"float, complex and ml_dtypes arrays)")
    return dtype.str


def _parse_dtype(text: Any, what: str) -> np.dtype:
    """The dtype the index records as ``text``; CheckpointError if unknown or ml_dtypes is missing."""
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


def slice_file(rank: int, world_size: int) -> str:
    """File name of the boxes group rank ``rank`` wrote: ``slices-00002-of-00004.npz``."""
    return f"slices-{rank:05d}-of-{world_size:05d}.npz"


def file_key(name: str, piece: Optional[int]) -> str:
    """The key of a box in its slice file: the name, or ``name#<piece>`` for one of several (see [Note: the index])."""
    return name if piece is None else f"{name}#{piece}"


def refuse_index(path: str, where: str, value: Any, expected: str) -> NoReturn:
    """Raise the CheckpointError of a malformed index value, naming where it is and what it is."""
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
    raise CheckpointError(f"{path!r}: the index records {where}={shown}; expected {expected} (a corrupt or "
                          f"crafted index)")


def _index_ints(path: str, where: str, value: Any, length: int, high: int) -> Tuple[int, ...]:
    """``value`` checked to be a list of ``length`` ints from 0 to ``high``."""
    if (not isinstance(value, list) or len(value) != length
            or not all(type(v) is int and 0 <= v <= high for v in value)):
        refuse_index(path, where, value, f"a list of {length} integers from 0 to {high}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class SavedArray:
    """One array as the (checked) index records it."""

    shape: Tuple[int, ...]
    dtype: np.dtype
    boxes: Tuple[Tuple[int, str, Box], ...]  # (file rank, key in that file, box)


def saved_array(path: str, name: str, entry: Any, world_size: int) -> SavedArray:
    """The index entry of ``name``, every value checked before use (CheckpointError naming a bad one)."""
    where = f"arrays[{name!r}]"
    if not isinstance(entry, dict) or not {"shape", "dtype", "boxes"} <= set(entry):
        refuse_index(path, where, entry, "a dict with 'shape', 'dtype' and 'boxes'")
    raw_shape = entry["shape"]
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_NDIM:
        refuse_index(path, f"{where}.shape", raw_shape, f"a list of at most {MAX_NDIM} integers")
    shape = _index_ints(path, f"{where}.shape", raw_shape, len(raw_shape), MAX_DIM)
    dtype = _parse_dtype(entry["dtype"], f"{path!r}: array {name!r}")
    most = world_size * MAX_PIECES_PER_FILE
    if not isinstance(entry["boxes"], list) or len(entry["boxes"]) > most:
        refuse_index(path, f"{where}.boxes", entry["boxes"], f"a list of at most {most} boxes")
    boxes = []
    pieces: Dict[int, set] = {}  # file rank -> its piece numbers (None: its one unnumbered box)
    for i, item in enumerate(entry["boxes"]):
        at = f"{where}.boxes[{i}]"
        if not isinstance(item, list) or len(item) not in (3, 4):
            refuse_index(path, at, item, "[file rank, offset, shape] or [file rank, offset, shape, piece]")
        rank = _index_ints(path, f"{at} file rank", [item[0]], 1, world_size - 1)[0]
        offset = _index_ints(path, f"{at} offset", item[1], len(shape), MAX_DIM)
        extent = _index_ints(path, f"{at} shape", item[2], len(shape), MAX_DIM)
        piece = _index_ints(path, f"{at} piece", [item[3]], 1, MAX_PIECES_PER_FILE - 1)[0] if len(item) == 4 \
            else None
        numbers = pieces.setdefault(rank, set())
        if (any(o + s > g for o, s, g in zip(offset, extent, shape)) or piece in numbers
                or (numbers and (piece is None or None in numbers))):
            refuse_index(path, at, item, f"a box inside the global shape {shape}, one per file, or numbered "
                                         f"pieces [file rank, offset, shape, i] with each (file rank, i) once")
        numbers.add(piece)
        boxes.append((rank, file_key(name, piece), Box(shape, offset, extent)))
    return SavedArray(shape, dtype, tuple(boxes))


__all__ = ["INDEX_FORMAT", "MAX_DIM", "MAX_PIECES_PER_FILE", "slice_file"]
