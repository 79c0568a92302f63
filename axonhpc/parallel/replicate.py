"""Copy rank 0's arrays to every rank with one broadcast per dtype."""
from __future__ import annotations

from typing import Any, Sequence

from .._dtypes import dtype_groups
from ..collectives import broadcast
from ..buffers import flat_ops_for


def broadcast_arrays(arrays: Sequence[Any], group: Any, src: int = 0) -> None:
    """Overwrite ``arrays`` on every rank with ``src``'s values, in place.

    Arrays of one dtype travel packed in one flat message, so a model of many
    small tensors costs one broadcast per dtype, not one per tensor. The
    flat message lives where the arrays do (host or device, never mixed).
    """
    if not arrays:
        return
    ops = flat_ops_for(arrays, what="broadcast_arrays")
    for same in dtype_groups(arrays):
        flat = ops.pack(same)
        broadcast(flat, src=src, group=group)
        ops.unpack(flat, same)
