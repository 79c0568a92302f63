"""Sharded FSDP checkpoints: every rank writes its own shard, any world size reads them back.

``save_sharded`` writes ``path/index.npz`` and one ``shard-<k>-of-<n>.npz`` per shard rank (under HYBRID_SHARD
only the first replica writes), by the protocol of ``directory``. ``load_sharded`` reads on each rank only the
shard files whose ranges overlap its own shards under the current group, so a checkpoint saved on N ranks loads
on M.
"""
from __future__ import annotations

import os
from typing import Any, List, Tuple

from ..buffers import shard_size
from ..errors import CheckpointError
from .directory import MAX_WORLD_SIZE, index_int, read_index, read_member, save_directory
from .io import loading

INDEX_FORMAT = "axonhpc.fsdp.checkpoint/2"  # /1: before save tokens (still read)


def shard_file(shard_rank: int, shard_world_size: int) -> str:
    """File name of one shard: ``shard-00002-of-00004.npz``."""
    return f"shard-{shard_rank:05d}-of-{shard_world_size:05d}.npz"


def save_sharded(path: "str | os.PathLike[str]", fsdp: Any, optimizer: Any = None, extra: Any = None) -> None:
    """Collective: write a sharded checkpoint directory of ``fsdp`` (and ``optimizer``).

    ``extra``: more plain state (epoch, rng states, ...); rank 0's is kept. Raises CheckpointError on every
    rank if any rank could not write its file or rank 0 could not put the directory in place.
    """
    mine = None
    if fsdp.is_shard_writer:
        mine = (shard_file(fsdp.shard_rank, fsdp.shard_world_size), lambda: fsdp.sharded_state_dict(optimizer))
    save_directory(path, fsdp.group, mine, lambda: sharded_index(fsdp, extra))


def sharded_index(fsdp: Any, extra: Any) -> dict:
    """The index of a sharded checkpoint of ``fsdp``: the saved layout, each unit's parameter shapes (to name the
    ones that differ from a model that loads it), and ``extra``."""
    return {"format": INDEX_FORMAT, "shard_world_size": fsdp.shard_world_size,
            "units": {u.name: int(u.numel) for u in fsdp.units},
            "shapes": {u.name: [[name, list(shape)] for name, shape in _model_shapes(u)] for u in fsdp.units},
            "extra": extra}


_MAX_NUMEL = 1 << 62  # elements of one unit; more is a corrupt index, not a model


def _model_shapes(unit: Any) -> List[Tuple[str, tuple]]:
    """``(name, shape)`` of each parameter of FSDP unit ``unit`` (its layout's: a sharded parameter holds none)."""
    return [(name, tuple(shape)) for name, shape in zip(unit.param_names, unit.flat.layout.shapes)]


def _shown(shapes: List[Tuple[str, tuple]], most: int = 6) -> str:
    text = ", ".join(f"{name} {shape}" for name, shape in shapes[:most])
    return text + (f" and {len(shapes) - most} more" if len(shapes) > most else "")


def _unit_mismatch(path: str, index: dict, unit: Any, numel: int) -> str:
    """The message for a unit whose element count differs: the parameters that differ, where the index records
    the saved shapes (older checkpoints do not: then the unit's counts and this model's parameters)."""
    mine = _model_shapes(unit)
    saved = index.get("shapes", {}).get(unit.name) if isinstance(index.get("shapes"), dict) else None
    try:
        theirs = [(str(name), tuple(int(d) for d in shape)) for name, shape in saved]
    except (TypeError, ValueError):
        theirs = None
    head = f"{path!r}: FSDP unit {unit.name!r} holds {numel} elements in the checkpoint, {unit.numel} in this model"
    if theirs is None:
        return f"{head} ({_shown(mine)}): a checkpoint of another model"
    saved_shapes, my_shapes = dict(theirs), dict(mine)
    differ = [f"{name}: {saved_shapes[name]} saved, {shape} here" for name, shape in mine
              if name in saved_shapes and saved_shapes[name] != shape]
    differ += [f"{name} {shape}: not in the checkpoint" for name, shape in mine if name not in saved_shapes]
    differ += [f"{name} {shape}: not in this model" for name, shape in theirs if name not in my_shapes]
    return f"{head}; parameters that differ: {'; '.join(differ[:6])}: a checkpoint of another model"


def _needed_files(index: dict, fsdp: Any, path: str) -> List[int]:
    """Shard ranks of the saved files that overlap this rank's ranges (the index checked first)."""
    saved_world = index_int(index, "shard_world_size", path, 1, MAX_WORLD_SIZE)
    units = index.get("units")
    if not isinstance(units, dict):
        raise CheckpointError(f"{path!r}: the index records units={type(units).__name__}; expected a dict of unit "
                              f"names to element counts (a corrupt or crafted index)")
    needed = set()
    for unit in fsdp.units:
        if unit.name not in units:
            raise CheckpointError(f"{path!r} holds no FSDP unit {unit.name!r} (this model's holds "
                                  f"{_shown(_model_shapes(unit))}); its units: {sorted(units)[:10]}: a checkpoint "
                                  f"of another model or another unit plan")
        numel = index_int(units, unit.name, path, 0, _MAX_NUMEL)
        if numel != unit.numel:
            raise CheckpointError(_unit_mismatch(path, index, unit, numel))
        # Saved shard k holds [k * chunk, (k + 1) * chunk) of the unit (shard_bounds), so the ones
        # overlapping [lo, hi) are found by division, whatever the saved world size.
        lo, hi = unit.unpadded_range()
        chunk = shard_size(numel, saved_world)
        if hi > lo and chunk > 0:
            needed.update(range(lo // chunk, (hi - 1) // chunk + 1))
    return sorted(needed)


def load_sharded(path: "str | os.PathLike[str]", fsdp: Any, optimizer: Any = None) -> Any:
    """Collective: load a sharded checkpoint into ``fsdp`` (and ``optimizer``), at any world size.

    Returns the ``extra`` state saved with it.

    Raises:
        CheckpointError: on every rank, if any rank could not read what it needs, the index is malformed, a
            shard file comes from another save than the index (a stitched directory), or the ranks read
            different checkpoints.
        StateDictError: the checkpoint does not match the model (raised on every rank).
    """
    path = os.fspath(path)
    pg = fsdp.group
    with loading(pg, path) as vote:  # raises on every rank if any rank failed
        index, digest, save = read_index(path, INDEX_FORMAT)
        vote.text = digest.hex()
        needed = _needed_files(index, fsdp, path)
        saved_world = index["shard_world_size"]
        pieces = [read_member(path, shard_file(k, saved_world), f"shard file {k}", save) for k in needed]
        apply = fsdp.prepare_load(pieces, optimizer)  # checks only: nothing changes yet
    apply()  # every rank read and checked its part: now all change together
    return index["extra"]


__all__ = ["save_sharded", "load_sharded", "shard_file", "sharded_index"]
