"""Loading the boxes a rank wants from a sliced checkpoint of any layout, and whole arrays in one process.

[Note: reading only what is needed]
A load opens only the files holding a box that overlaps what this rank wants, and reads only the entries it
needs, each once. Destinations given to ``load_slices`` are filled only after every rank has read and checked
its part, so a failed load changes nothing on any rank.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import array_module, is_cupy_array
from ..errors import CheckpointError
from ..groups import resolve_group
from .archive import EntryRefused, open_archive
from .boxes import Box, as_piece, check_name, cover_problem
from .directory import MAX_WORLD_SIZE, check_save, index_int, member_path, read_index
from .format import MAX_META_BYTES, META_ENTRY, decode, parse_meta
from .io import loading
from .slice_index import INDEX_FORMAT, SavedArray, refuse_index, saved_array, slice_file


def _as_request(name: Any, value: Any, item: Optional[int] = None) -> Tuple[Box, Any]:
    """``(box, destination or None)`` from a Box, ``(Box, array)`` or ``(global_shape, offset, array)``."""
    if isinstance(value, Box):
        check_name(name, "wanted")
        return value, None
    box, dest = as_piece(name, value, "wanted", item)
    label = f"wanted {name!r}" + ("" if item is None else f" [{item}]")
    if isinstance(dest, np.ndarray) and not dest.flags.writeable:
        raise CheckpointError(f"{label}: the destination array is read-only")
    if not isinstance(dest, np.ndarray) and not is_cupy_array(dest):
        raise CheckpointError(f"{label}: a destination must be a numpy or cupy array, got {type(dest).__name__}")
    return box, dest


def _as_requests(name: Any, value: Any) -> Tuple[bool, List[Tuple[Box, Any]]]:
    """``(given as a list?, [(box, destination or None), ...])`` for one name of ``wanted``."""
    if isinstance(value, list):
        check_name(name, "wanted")
        return True, [_as_request(name, item, i) for i, item in enumerate(value)]
    return False, [_as_request(name, value)]


def _plan_read(path: str, saved: SavedArray, name: str, want: Box,
               dtype: Optional[np.dtype]) -> List[Tuple[int, str, Box, Box]]:
    """The saved boxes to read for ``want``: ``[(file rank, key, saved box, the part of it wanted)]``.

    Raises CheckpointError if the global shape or dtype differs from the checkpoint's, or the saved boxes do not
    cover ``want`` exactly once (a crafted index).
    """
    if want.global_shape != saved.shape:
        raise CheckpointError(f"{path!r}: array {name!r} has global shape {saved.shape} in the checkpoint; the "
                              f"requested global shape is {want.global_shape}")
    if dtype is not None and np.dtype(dtype) != saved.dtype:
        raise CheckpointError(f"{path!r}: array {name!r} is {saved.dtype} in the checkpoint; the destination is "
                              f"{np.dtype(dtype)}")
    parts = [(rank, key, box, common) for rank, key, box in saved.boxes
             if (common := box.intersect(want)) is not None]
    problem = cover_problem(want, [common for _, _, _, common in parts])
    if problem is not None:
        raise CheckpointError(f"{path!r}: the saved boxes of {name!r} do not cover the requested offset "
                              f"{want.offset} shape {want.shape} exactly once: {problem} (a corrupt or crafted "
                              f"index)")
    return parts


def _read_entries(path: str, names: Sequence[str], source: str, checked: Tuple[str, str, Optional[str]]
                  ) -> Dict[str, np.ndarray]:
    """The arrays ``names`` of one slice file, reading (and verifying) only those entries.

    ``checked``: ``(directory, file name, the index's save token)`` for ``check_save``.
    """
    with open_archive(path, source) as archive:
        if META_ENTRY not in archive.names:
            raise CheckpointError(f"{source}: not an axonhpc checkpoint (no {META_ENTRY!r} entry)")
        try:
            raw = archive.read(META_ENTRY, max_bytes=MAX_META_BYTES)
        except EntryRefused as exc:
            raise CheckpointError(f"{source}: entry {META_ENTRY!r} cannot be read ({exc})") from exc
        meta = parse_meta(raw, source)
        directory, file_name, save = checked
        check_save(directory, file_name, "slice file", save, meta.get("save"))
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
                      saved: Mapping[str, SavedArray]) -> None:
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

    ``requests``: name -> ``[(box or None, destination dtype or None), ...]``. Returns ``(arrays, extra,
    digest)``: name -> new host arrays, one per request; the saved ``extra``; the sha256 of the index metadata.
    """
    index, digest, save = read_index(path, INDEX_FORMAT)
    world_size = index_int(index, "world_size", path, 1, MAX_WORLD_SIZE)
    recorded = index.get("arrays")
    if not isinstance(recorded, dict):
        refuse_index(path, "arrays", type(recorded).__name__, "a dict of array names to entries")
    saved: Dict[str, SavedArray] = {}
    needs: Dict[int, Dict[str, Tuple[str, Box]]] = {}  # file rank -> key -> (name, saved box)
    parts: Dict[int, List[Tuple[str, str, int, Box, Box]]] = {}  # file rank -> (name, key, request, box, common)
    wants: Dict[str, List[Box]] = {}
    for name, asked in requests.items():
        if name not in recorded:
            held = sorted(recorded)
            raise CheckpointError(f"{path!r} holds no array {name!r} (it holds {len(held)}: {held[:10]}"
                                  f"{' ...' if len(held) > 10 else ''})")
        saved[name] = saved_array(path, name, recorded[name], world_size)
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
        arrays = _read_entries(file, list(needs[rank]), f"checkpoint {file!r}", (path, file_name, save))
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

    Args:
        path: the directory ``save_slices`` wrote (on a filesystem every rank shares).
        wanted: name -> a ``Box`` (returned as a new numpy array), or ``(Box, array)`` / ``(global_shape,
            offset, array)`` with a numpy or cupy destination filled in place; or a list of these (e.g. the
            pieces of a flat shard from ``flat_range_boxes``, with views of the shard as destinations).
        group: the ranks that take part (None: the default group).

    Returns:
        ``(arrays, extra)``: name -> the array (the destination where one was given; a list for a list), and
        the ``extra`` saved with the checkpoint.

    Raises:
        CheckpointError: on every rank, if any rank wants a name the checkpoint lacks, another global shape or
            dtype, or finds a file or the index missing or corrupt; or the ranks read different checkpoints.
            No destination is changed.
        NotAMemberError: this rank is not in ``group``.
    """
    path = os.fspath(path)
    pg = resolve_group(group).require_member("checkpoint load_slices")
    with loading(pg, path) as vote:
        try:
            if not isinstance(wanted, Mapping):
                raise CheckpointError(f"wanted must be a mapping of names to boxes, got {type(wanted).__name__}")
            requests = {name: _as_requests(name, value) for name, value in wanted.items()}
            arrays, extra, digest = _read_boxes(path, {
                name: [(box, None if dest is None else dest.dtype) for box, dest in asked]
                for name, (_, asked) in requests.items()})
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - raised as a CheckpointError, which every rank hears of
            raise CheckpointError(f"loading checkpoint {path!r} failed on group rank {pg.rank}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        vote.text = digest.hex()
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
    """``(arrays, extra)``: the whole global arrays of a ``save_slices`` checkpoint, in this process alone.

    For tools and one-process models; ``names=None`` reads every array. Raises CheckpointError for a missing name
    or a missing or corrupt file.
    """
    path = os.fspath(path)
    try:
        if names is None:
            index, _, _ = read_index(path, INDEX_FORMAT)
            recorded = index.get("arrays")
            if not isinstance(recorded, dict):
                refuse_index(path, "arrays", type(recorded).__name__, "a dict of array names to entries")
            names = list(recorded)
        arrays, extra, _ = _read_boxes(path, {name: [(None, None)] for name in names})
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is a CheckpointError
        raise CheckpointError(f"reading checkpoint {path!r}: {type(exc).__name__}: {exc}") from exc
    return {name: got[0] for name, got in arrays.items()}, extra


__all__ = ["load_slices", "read_full"]
