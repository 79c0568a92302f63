"""Copy rank 0's arrays to every rank with one broadcast per dtype."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

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
    by_dtype: Dict[str, List[Any]] = {}
    for a in arrays:
        by_dtype.setdefault(np.dtype(a.dtype).str, []).append(a)
    for key in sorted(by_dtype):
        same = by_dtype[key]
        flat = ops.pack(same)
        broadcast(flat, src=src, group=group)
        ops.unpack(flat, same)
