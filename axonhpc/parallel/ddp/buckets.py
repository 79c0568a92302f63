"""DDP's gradient buckets: ``Bucket`` (one flat bucket and its reduction's state) and the node's shared window.

What goes into which bucket, and when a bucket is reduced, is the wrapper's
(see its notes on bucket order, overlap and the shared window); this module
holds the memory: each bucket's flat buffer with its gradients as views, and
``shared_flats``, which lays every bucket out in one shared-memory window of
the node.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from ...buffers import FlatBucket, FlatOps
from ...collectives import shared_memory_array
from ...collectives.shm_path import in_shared_memory
from ...errors import SharedMemoryError
from ...observe.log import get_logger


class Bucket:
    """One flat bucket of gradients (a ``FlatBucket``) and the state of its current reduction.

    Args:
        index: its place in the all-reduce order.
        params: its Parameters (one dtype).
        names: their names.
        ops: the flat-buffer operations of the model's memory.
        flat: its buffer in the node's shared window, or None for one in the model's memory.
    """

    def __init__(self, index: int, params: List[Any], names: List[str], ops: FlatOps, flat: Any = None):
        self.index = index
        self.params = params
        self.names = names
        # In the node's shared window when ``flat`` is given (its all-reduce reads the other ranks'
        # buckets in place), else in the model's memory; each gradient a view of it either way.
        bucket = FlatBucket([p.shape for p in params], params[0].dtype, ops, flat)
        self.flat, self.views = bucket.flat, bucket.views
        self.pending = len(params)
        self.ready = [False] * len(params)
        self.work = None
        self.launched = False
        self.done = False  # its reduction was seen complete during backward

    def reset(self) -> None:
        """Forget the last reduction: every gradient pending again."""
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)
        self.work = None
        self.launched = False
        self.done = False


def shared_flats(buckets: List[List[Any]], group: Any, min_bytes: int) -> List[Any]:
    """One shared window of ``group`` holding every bucket, 64-byte aligned, or Nones (collective).

    Args:
        buckets: each bucket's Parameters, in plan order (identical on every rank).
        group: the DDP's process group.
        min_bytes: smaller buckets in all stay private (Nones, without a message).

    Returns:
        Each bucket's flat buffer (its dtype, its elements) in the window, or a
        None per bucket when the window is too small to be worth it, cannot be
        had (a warning), or is not shared memory.
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


__all__ = ["Bucket", "shared_flats"]
