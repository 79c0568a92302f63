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

All files go into ``path.tmp-<token>`` first. Once every rank reports its
file written, rank 0 writes the index and renames the directory into place;
an existing checkpoint at ``path`` is first renamed aside and removed only
after the new one is in place, so a crash at any point leaves the previous
checkpoint (at ``path``, or at ``path.old-<token>`` for the instant between
the two renames) or the new one, never a mixture.

``load_sharded(path, fsdp, optimizer)`` reads the index, then on each rank
only the shard files whose ranges overlap the rank's own shards under the
current group (see ``parallel.fsdp_state``'s note on resharding), so a
checkpoint saved on N ranks loads on M.
"""
from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, List, Optional

import numpy as np

from ..bucketing import shard_bounds
from ..collectives import all_gather
from ..errors import CheckpointError
from .format import encode
from .io import _agree, _broadcast_text, _fsync_directory, _read, write_atomic

INDEX = "index.npz"
INDEX_FORMAT = "axonhpc.fsdp.checkpoint/1"


def shard_file(shard_rank: int, shard_world_size: int) -> str:
    """File name of one shard: ``shard-00002-of-00004.npz``."""
    return f"shard-{shard_rank:05d}-of-{shard_world_size:05d}.npz"


def _report(pg: Any, problem: Optional[BaseException], what: str) -> None:
    """Raise on every rank if any rank failed (its own error where it failed)."""
    flags = all_gather(np.array([problem is not None], dtype=np.uint8), group=pg).reshape(-1)
    failed = [r for r in range(pg.size) if flags[r]]
    if problem is not None:
        raise problem
    if failed:
        raise CheckpointError(f"{what} failed on group ranks {failed} (see the error raised there)")


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
    path = os.fspath(path)
    pg = fsdp.group
    token = _broadcast_text(uuid.uuid4().hex[:12] if pg.rank == 0 else None, pg) if pg.size > 1 \
        else uuid.uuid4().hex[:12]
    tmp = f"{path}.tmp-{token}"
    problem: Optional[BaseException] = None
    if pg.rank == 0:
        try:
            os.makedirs(tmp)
        except OSError as exc:
            problem = CheckpointError(f"cannot create checkpoint directory {tmp!r}: {exc}")
    _report(pg, problem, f"creating {tmp!r}")
    try:
        if fsdp.is_shard_writer:
            state = fsdp.sharded_state_dict(optimizer)
            write_atomic(os.path.join(tmp, shard_file(fsdp.shard_rank, fsdp.shard_world_size)), encode(state))
    except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
        problem = exc if isinstance(exc, CheckpointError) else CheckpointError(
            f"writing shard {fsdp.shard_rank} of {path!r} failed: {type(exc).__name__}: {exc}")
    try:
        _report(pg, problem, f"saving the shards of {path!r}")
    except CheckpointError:
        if pg.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if pg.rank == 0:
        try:
            units = {u.name: int(u.numel) for u in fsdp.units}
            index = {"format": INDEX_FORMAT, "shard_world_size": fsdp.shard_world_size, "units": units,
                     "extra": extra}
            write_atomic(os.path.join(tmp, INDEX), encode(index))
            _fsync_directory(tmp)
            old = f"{path}.old-{token}"
            if os.path.exists(path):
                os.rename(path, old)
            os.rename(tmp, path)
            _fsync_directory(os.path.dirname(os.path.abspath(path)))
            shutil.rmtree(old, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001
            problem = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"finishing checkpoint {path!r} failed on rank 0: {type(exc).__name__}: {exc}")
            shutil.rmtree(tmp, ignore_errors=True)
    _report(pg, problem, f"finishing {path!r}")


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
        index, digest = _read(os.path.join(path, INDEX))
        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
            raise CheckpointError(f"{path!r} is not an axonhpc sharded checkpoint (index format "
                                  f"{index.get('format') if isinstance(index, dict) else None!r})")
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
