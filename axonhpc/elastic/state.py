"""The whole model and optimizer state, put together in memory from the pieces the survivors hold.

[Note: one holder per piece]
Every survivor offers the pieces it holds (``checkpoint.model_slices.state_pieces``:
a key, the block of the global array, the values): its own, and for FSDP the
buddy copies of ranks that were lost. The offers are gathered as text; each
distinct piece is then sent once, by the lowest rank that offers it (a DDP
replica's pieces by one rank, not by all), in one broadcast per sending rank.
Every rank ends with the whole arrays, and ``missing`` says which elements no
survivor held: such a state cannot be trained on.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..checkpoint.boxes import Box
from ..checkpoint.io import gather_text
from ..collectives import broadcast
from ..errors import ConfigurationError

Piece = Tuple[str, Box, Any]  # key, block of the global array, values


def _offer(pieces: Sequence[Piece]) -> str:
    return json.dumps([[key, np.asarray(a).dtype.str, box.global_shape, box.offset, box.shape]
                       for key, box, a in pieces])


def gather_state(group: Any, pieces: Sequence[Piece]) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
    """Collective over ``group``: the whole arrays the pieces make up, on every rank.

    Returns:
        ``(whole, missing)``: key -> global array, and key -> how many of its
        elements no rank held (absent when none).

    Raises:
        ConfigurationError: a piece that is not a host (numpy) array.
    """
    for key, _, a in pieces:
        if not isinstance(a, (np.ndarray, np.generic)):
            raise ConfigurationError(f"rebuilding after a failure moves host arrays; {key!r} is a "
                                     f"{type(a).__name__} (device arrays are not supported here yet)")
    offers = [json.loads(text) for text in gather_text(_offer(pieces), group)]
    sender: Dict[Tuple[str, tuple, tuple], int] = {}
    for rank, offer in enumerate(offers):
        for key, _, global_shape, offset, shape in offer:
            sender.setdefault((key, tuple(offset), tuple(shape)), rank)
    whole: Dict[str, np.ndarray] = {}
    seen: Dict[str, np.ndarray] = {}
    for offer in offers:
        for key, dtype, global_shape, _, _ in offer:
            if key not in whole:
                whole[key] = np.zeros(tuple(global_shape), dtype=np.dtype(dtype))
                seen[key] = np.zeros(tuple(global_shape), dtype=bool)
    for rank, offer in enumerate(offers):
        chosen = [i for i, (key, _, _, offset, shape) in enumerate(offer)
                  if sender[(key, tuple(offset), tuple(shape))] == rank]
        if not chosen:
            continue
        sizes = [int(np.prod(offer[i][4], dtype=np.int64)) * np.dtype(offer[i][1]).itemsize for i in chosen]
        buffer = np.empty(sum(sizes), dtype=np.uint8)
        if rank == group.rank:
            at = 0
            for i, size in zip(chosen, sizes):
                buffer[at:at + size] = np.ascontiguousarray(pieces[i][2]).reshape(-1).view(np.uint8)
                at += size
        if buffer.size:
            broadcast(buffer, src=rank, group=group)
        at = 0
        for i, size in zip(chosen, sizes):
            key, dtype, global_shape, offset, shape = offer[i]
            box = Box(tuple(global_shape), tuple(offset), tuple(shape))
            whole[key][box.slices] = buffer[at:at + size].view(np.dtype(dtype)).reshape(box.shape)
            seen[key][box.slices] = True
            at += size
    missing = {key: int(mask.size - np.count_nonzero(mask)) for key, mask in seen.items() if not mask.all()}
    return whole, missing


def describe_missing(missing: Dict[str, int], limit: int = 4) -> str:
    """'model/wte.weight (512 elements), ...' for an error message."""
    shown = [f"{key} ({count} element{'s' if count != 1 else ''})" for key, count in sorted(missing.items())[:limit]]
    more = len(missing) - limit
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def state_bytes(pieces: Sequence[Piece]) -> int:
    """Bytes of the values of ``pieces``."""
    return int(sum(np.asarray(a).nbytes for _, _, a in pieces))


__all__: List[str] = ["gather_state", "describe_missing", "state_bytes", "Piece"]
