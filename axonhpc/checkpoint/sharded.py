"""Sharded FSDP checkpoints: every rank writes its own shard, any world size reads them back.

[Note: the directory]
``save_sharded(path, fsdp, optimizer)`` writes a directory::

    path/index.npz                      # world size, units, extra state (rank 0)
    path/shard-00000-of-00004.npz       # one per shard rank, written in parallel
    ...

Each shard file is an ordinary checkpoint file (``format``: no pickle, a
sha256 per array) holding ``fsdp.sharded_state_dict(optimizer)``: the values
and optimizer state of the shard's range ``[start, stop)`` of every flat
parameter. Under HYBRID_SHARD only the first replica of each shard writes.

The directory is written by the protocol of ``directory`` (a temporary
directory, every rank's file, then the index and an atomic switch), so a
crash leaves the previous checkpoint or the new one, never a mixture.

``load_sharded(path, fsdp, optimizer)`` reads the index, then on each rank
only the shard files whose ranges overlap the rank's own shards under the
current group (see ``parallel.fsdp_state``'s note on resharding), so a
checkpoint saved on N ranks loads on M.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

from ..bucketing import shard_bounds
from ..errors import CheckpointError
from .directory import read_index, save_directory
from .io import _agree, _read

INDEX_FORMAT = "axonhpc.fsdp.checkpoint/1"


def shard_file(shard_rank: int, shard_world_size: int) -> str:
    """File name of one shard: ``shard-00002-of-00004.npz``."""
    return f"shard-{shard_rank:05d}-of-{shard_world_size:05d}.npz"


def save_sharded(path: "str | os.PathLike[str]", fsdp: Any, optimizer: Any = None, extra: Any = None) -> None:
    """Collective: write a sharded checkpoint directory (see the module note).

    Args:
        path: the checkpoint directory; replaced if it exists.
        fsdp: the FullyShardedDataParallel.
        optimizer: the optimizer over ``fsdp.parameters()``, or None.
        extra: more plain state (epoch, rng states, ...); rank 0's is kept.

    Raises:
        CheckpointError: on every rank, if any rank could not write its file
            or rank 0 could not put the directory in place.
    """
    mine = None
    if fsdp.is_shard_writer:
        mine = (shard_file(fsdp.shard_rank, fsdp.shard_world_size), lambda: fsdp.sharded_state_dict(optimizer))
    save_directory(path, fsdp.group, mine,
                   lambda: {"format": INDEX_FORMAT, "shard_world_size": fsdp.shard_world_size,
                            "units": {u.name: int(u.numel) for u in fsdp.units}, "extra": extra})


def _needed_files(index: dict, fsdp: Any) -> List[int]:
    """Shard ranks of the saved files that overlap this rank's ranges."""
    saved_world = int(index["shard_world_size"])
    needed = set()
    for unit in fsdp.units:
        numel = int(index["units"].get(unit.name, -1))
        if numel != unit.numel:
            raise CheckpointError(f"the checkpoint's unit {unit.name!r} has {numel} elements, the model's "
                                  f"{unit.numel} (-1: not in the checkpoint)")
        lo, hi = unit.unpadded_range()
        for k in range(saved_world):
            start, stop, _ = shard_bounds(numel, k, saved_world)
            if max(lo, start) < min(hi, min(stop, numel)):
                needed.add(k)
    return sorted(needed)


def load_sharded(path: "str | os.PathLike[str]", fsdp: Any, optimizer: Any = None) -> Any:
    """Collective: load a sharded checkpoint into ``fsdp`` (and ``optimizer``), at any world size.

    Args:
        path: the directory ``save_sharded`` wrote.
        fsdp: the FullyShardedDataParallel (same model, any group size and strategy).
        optimizer: the optimizer over ``fsdp.parameters()``, or None.

    Returns:
        The ``extra`` state saved with it.

    Raises:
        CheckpointError: on every rank, if any rank could not read what it
            needs or the ranks read different checkpoints.
        StateDictError: the checkpoint does not match the model (raised on every rank).
    """
    path = os.fspath(path)
    pg = fsdp.group
    index: Any = None
    digest = bytes(32)
    problem: Optional[BaseException] = None
    try:
        index, digest = read_index(path, INDEX_FORMAT)
        saved_world = int(index["shard_world_size"])
        pieces = [_read(os.path.join(path, shard_file(k, saved_world)))[0] for k in _needed_files(index, fsdp)]
        apply = fsdp.prepare_load(pieces, optimizer)  # checks only: nothing changes yet
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it before this rank raises
        problem = exc
    if pg.size > 1:
        _agree(pg, path, problem is not None, digest)  # raises on every rank if any rank failed
    if problem is not None:
        raise problem
    apply()  # every rank read and checked its part: now all change together
    return index["extra"]


__all__ = ["save_sharded", "load_sharded", "shard_file"]
