"""Saving global arrays held in pieces: the checks and the plan every rank computes alike, then the write.

[Note: what a save checks, and who writes]
The ranks all-gather a small description of their pieces and each computes the same plan (``plan_slices``),
so every check fails on every rank alike. Equal boxes are replicas: the lowest holder writes it (comparing
replicas would move every array through the network). Distinct boxes of a name must neither overlap (two
tensor-parallel shards sharing a row are a layout bug, not replicas) nor leave a hole. Empty boxes are never
written. The directory protocol is ``directory``'s, so a crash leaves the previous checkpoint whole.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import is_cupy_array
from ..errors import CheckpointError
from ..groups import resolve_group
from .boxes import Box, as_piece, check_name, cover_problem
from .directory import save_directory
from .io import gather_text
from .slice_index import INDEX_FORMAT, MAX_PIECES_PER_FILE, dtype_text, file_key, slice_file


def _too_many_pieces(count: int) -> str:
    return f"{count} pieces, more than MAX_PIECES_PER_FILE = {MAX_PIECES_PER_FILE} (of one name from one rank)"


def _checked_pieces(pieces: Mapping[str, Any]) -> List[Tuple[str, str, Box, Any]]:
    """Every piece this rank gives as ``(name, dtype text, box, array)``, in order, each checked; nothing copied."""
    if not isinstance(pieces, Mapping):
        raise CheckpointError(f"pieces must be a mapping of names to (box, array), got {type(pieces).__name__}")
    out = []
    for name, value in pieces.items():
        check_name(name, "piece")
        if isinstance(value, list):
            if len(value) > MAX_PIECES_PER_FILE:
                raise CheckpointError(f"piece {name!r}: a list of {_too_many_pieces(len(value))}")
            items: List[Tuple[Optional[int], Any]] = list(enumerate(value))
        else:
            items = [(None, value)]
        for item, piece in items:
            box, array = as_piece(name, piece, "piece", item)
            dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
            out.append((name, dtype_text(dtype, f"piece {name!r}"), box, array))
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
    """The one value every holder of ``name`` gives for ``what``; CheckpointError naming the ranks if they disagree."""
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


def plan_slices(table: Sequence[Sequence[Tuple[str, str, Box]]]) -> Tuple[Dict[int, List[str]], Dict[str, Any]]:
    """Who writes which box under which key, and the index entries, from every rank's ``(name, dtype, box)`` pieces.

    Raises:
        CheckpointError: holders disagree on a global shape or dtype, a rank gives too many pieces or one box
            twice, distinct boxes overlap or leave a hole, or two names collide on one key in a rank's file.
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
        problem = cover_problem(Box.full(shape), list(writer))
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
            key = file_key(name, piece)
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
                out.append((file_key(name, item[3] if len(item) == 4 else None), name, box))
    return out


def prepare_slices(path: str, pieces: Mapping[str, Any], pg: Any, extra: Any, copy: bool = False
                   ) -> Tuple[Optional[Tuple[str, Callable[[], Dict[str, np.ndarray]]]], Callable[[], Dict[str, Any]]]:
    """Collective: every check and the plan of a ``save_slices``, then ``(my_file or None, index function)``."""
    mine: List[Tuple[str, str, Box, Any]] = []
    problem: Optional[str] = None
    try:
        mine = _checked_pieces(pieces)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it in the exchange below
        problem = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        mine = []
    texts = gather_text(_describe(problem, mine), pg) if pg.size > 1 else [_describe(problem, mine)]
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
        pieces: global name -> ``(Box, array)`` or ``(global_shape, offset, array)``, or a list of them for
            several disjoint boxes (FSDP's flat shards). Equal boxes on several ranks are written once.
        extra: shared plain state; group rank 0's goes into the index.

    Raises:
        CheckpointError: on every rank alike, when the layout is refused (before anything is written), or any
            rank fails to write (the previous checkpoint is then left as it was).
        NotAMemberError: this rank is not in ``group``.
    """
    path = os.fspath(path)
    pg = resolve_group(group).require_member("checkpoint save_slices")
    my_file, index = prepare_slices(path, pieces, pg, extra)
    save_directory(path, pg, my_file, index)


__all__ = ["plan_slices", "prepare_slices", "save_slices"]
