"""Copy rank 0's arrays to every rank with one broadcast per dtype."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from ..bucketing import pack, unpack
from ..collectives import broadcast


def broadcast_arrays(arrays: Sequence[Any], group: Any, src: int = 0) -> None:
    """Overwrite ``arrays`` on every rank with ``src``'s values, in place.

    Arrays of one dtype travel packed in one flat message, so a model of many
    small tensors costs one broadcast per dtype, not one per tensor.
    """
    by_dtype: Dict[str, List[Any]] = {}
    for a in arrays:
        by_dtype.setdefault(np.dtype(a.dtype).str, []).append(a)
    for key in sorted(by_dtype):
        same = by_dtype[key]
        flat = pack(same)
        broadcast(flat, src=src, group=group)
        unpack(flat, same)
