"""``shared_flats``: every bucket of a node-local group laid out in one shared-memory window of the node.

[Note: buckets in shared memory]
When the group is on one node, buckets in one shared window let an all-reduce read the other ranks' buckets in
place, with no copy in. The window is held for the life of the process (freeing it is collective), so small
gradients stay private. A ``/dev/shm`` too small for it is refused on every rank alike, and the caller keeps
private buckets with a warning.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from ..collectives import shared_memory_array
from ..collectives.shm_path import in_shared_memory
from ..errors import SharedMemoryError
from ..observe.log import get_logger


def shared_flats(buckets: List[List[Any]], group: Any, min_bytes: int) -> List[Any]:
    """One shared window of ``group`` holding every bucket, 64-byte aligned, or Nones (collective).

    Args:
        buckets: each bucket's Parameters, in plan order (identical on every rank).
        min_bytes: smaller buckets in all stay private (Nones, without a message).

    Returns each bucket's flat buffer in the window, or a None per bucket when the window is too small to be worth
    it, cannot be had (a warning), or is not shared memory.
    """
    sizes = []
    for params in buckets:
        nbytes = sum(int(p.data.nbytes) for p in params)
        sizes.append(-(-nbytes // 64) * 64)
    if sum(sizes) < min_bytes:
        return [None] * len(buckets)
    try:
        raw = shared_memory_array(sum(sizes), np.uint8, group)
    except SharedMemoryError as exc:  # raised on every rank alike: all keep private buckets
        get_logger("ddp").warning(f"DDP keeps its gradient buckets in private memory: {exc}")
        return [None] * len(buckets)
    if not in_shared_memory(raw, group):
        return [None] * len(buckets)
    flats, offset = [], 0
    for params, size in zip(buckets, sizes):
        dtype = np.dtype(params[0].dtype)
        count = sum(int(p.size) for p in params)
        flats.append(raw[offset:offset + count * dtype.itemsize].view(dtype))
        offset += size
    return flats


__all__ = ["shared_flats"]
