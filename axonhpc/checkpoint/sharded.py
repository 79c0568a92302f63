"""Sharded FSDP checkpoints: every rank writes its own shard, any world size reads them back.

``save_sharded`` writes ``path/index.npz`` and one ``shard-<k>-of-<n>.npz`` per shard rank (under HYBRID_SHARD
only the first replica writes), by the protocol of ``directory``. ``load_sharded`` reads on each rank only the
shard files whose ranges overlap its own shards under the current group, so a checkpoint saved on N ranks loads
on M.
"""
from __future__ import annotations

import os
from typing import Any, List

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
    save_directory(path, fsdp.group, mine,
                   lambda: {"format": INDEX_FORMAT, "shard_world_size": fsdp.shard_world_size,
                            "units": {u.name: int(u.numel) for u in fsdp.units}, "extra": extra})


_MAX_NUMEL = 1 << 62  # elements of one unit; more is a corrupt index, not a model


def _needed_files(index: dict, fsdp: Any, path: str) -> List[int]:
    """Shard ranks of the saved files that overlap this rank's ranges (the index checked first)."""
    saved_world = index_int(index, "shard_world_size", path, 1, MAX_WORLD_SIZE)
    units = index.get("units")
    if not isinstance(units, dict):
        raise CheckpointError(f"{path!r}: the index records units={type(units).__name__}; expected a dict of unit "
                              f"names to element counts (a corrupt or crafted index)")
    needed = set()
    for unit in fsdp.units:
        numel = index_int(units, unit.name, path, 0, _MAX_NUMEL) if unit.name in units else -1
        if numel != unit.numel:
            raise CheckpointError(f"the checkpoint's unit {unit.name!r} has {numel} elements, the model's "
                                  f"{unit.numel} (-1: not in the checkpoint)")
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


__all__ = ["save_sharded", "load_sharded", "shard_file"]
