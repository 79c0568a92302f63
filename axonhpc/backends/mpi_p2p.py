"""Point-to-point messages over MPI that carry their dtype: the wire tag, and waits that find a message of another dtype.

[Note: the dtype in the tag]
MPI matches a message by source and tag, and counts bytes: a message of 4 float64 received into 8 float32 fills
them with garbage and no error. So the MPI backend sends a message of user tag ``t`` and dtype ``d`` under the
tag ``t * DTYPE_TAGS + code(d)`` (``code``: 1 + the dtype's place in ``supported_dtypes()``). A receive of another
dtype posts another tag and does not match it; instead its wait looks, every ``CHECK_EVERY`` seconds, for a
message from the same source under the same user tag and any other code (``Iprobe``); unless its own message
turns out to have come first ([Note: the next message is not a mismatch]), it receives that one into scratch
(so the sender is not left waiting) and raises ``ShapeError`` naming both dtypes. A message of the right dtype is
matched as before, at no cost but the multiplication. User tags go up to ``(MPI_TAG_UB - 7) // DTYPE_TAGS``
(67 108 863 with the MPICH wheel, 268 435 455 with Open MPI's).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import numpy as np

from .._dtypes import dtype_places, supported_dtypes
from ..errors import InvalidArgumentError, ShapeError
from .mpi_work import load_mpi

DTYPE_TAGS = 8  # codes 1..7 for the supported dtypes (bfloat16 included), 0 unused
CHECK_EVERY = 0.01  # seconds between the looks for a message of another dtype while a receive waits


@functools.lru_cache(maxsize=None)
def _codes() -> dict:
    """dtype -> its code in a wire tag: 1 + its place in ``supported_dtypes()`` (the buffers were checked)."""
    return {dtype: 1 + k for dtype, k in dtype_places().items()}


def drop(message: Any, nbytes: int) -> None:
    """Receive a matched ``message`` of ``nbytes`` into scratch: refused, yet its sender is not left waiting."""
    MPI = load_mpi()
    message.Recv([np.empty(max(nbytes, 1), dtype=np.uint8), nbytes, MPI.BYTE])


def wire_tag(comm: Any, tag: int, dtype: np.dtype) -> int:
    """The MPI tag of user tag ``tag`` for a message of ``dtype``; InvalidArgumentError past ``MPI_TAG_UB``."""
    largest = largest_tag(comm)  # alike for every dtype
    if tag > largest:
        raise InvalidArgumentError(f"tag {tag} is too large: point-to-point tags go up to {largest} with this MPI "
                                   f"(its MPI_TAG_UB {_tag_ub}, shared by the {DTYPE_TAGS} dtype codes a tag carries)")
    return tag * DTYPE_TAGS + _codes()[dtype]


_largest_tag: Optional[int] = None
_tag_ub: Optional[int] = None


def largest_tag(comm: Any) -> int:
    """The largest user tag a point-to-point message carries with this MPI: ``(MPI_TAG_UB - 7) // DTYPE_TAGS``."""
    return _largest_tag if _largest_tag is not None else _find_largest_tag(comm)


def _find_largest_tag(comm: Any) -> int:
    """The largest user tag, ``(MPI_TAG_UB - 7) // DTYPE_TAGS``. ``MPI_TAG_UB`` is an attribute of COMM_WORLD (a
    communicator made by a shrink or a merge may not carry it); 32767 is what the standard guarantees."""
    global _largest_tag, _tag_ub
    MPI = load_mpi()
    value = comm.Get_attr(MPI.TAG_UB)
    if value is None:
        value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    _tag_ub = 32767 if value is None else int(value)
    _largest_tag = (_tag_ub - (DTYPE_TAGS - 1)) // DTYPE_TAGS
    return _largest_tag


def other_dtype(comm: Any, src: int, wire: int) -> Optional[int]:
    """The wire tag of a message from ``src`` waiting under ``wire``'s user tag with another dtype's code, or None.

    Only looked at (``Iprobe``), not taken: it may be the next message, sent after the one a receive waits for.
    """
    base = wire - wire % DTYPE_TAGS
    for code in range(1, DTYPE_TAGS):
        if base + code != wire and comm.Iprobe(src, base + code):
            return base + code
    return None


def refuse_other(comm: Any, src: int, other: int, buf: Any, where: Callable[[], str]) -> ShapeError:
    """Take the message waiting under ``other`` (from ``other_dtype``) into scratch, so its sender is not left
    waiting, and return the ``ShapeError`` naming both dtypes. ``where()``: the receive ("recv from rank 2 tag 5")."""
    MPI = load_mpi()
    status = MPI.Status()
    message = comm.Mprobe(src, other, status)
    got = status.Get_count(MPI.BYTE)
    drop(message, got)
    code = other % DTYPE_TAGS
    dtypes = supported_dtypes()
    theirs = dtypes[code - 1] if code <= len(dtypes) else f"dtype code {code}"
    return ShapeError(f"{where()}: the incoming message holds {got} bytes of {theirs}, but the receive buffer is "
                      f"{buf.size} elements of {buf.dtype} ({buf.nbytes} bytes; shape {tuple(buf.shape)}); the "
                      f"message was received and dropped")


class Looker:
    """``look()``: ``other_dtype`` at most every ``CHECK_EVERY`` seconds, for a receive that keeps waiting.

    [Note: the next message is not a mismatch]
    A message of another dtype under the same user tag is a mismatch only if it came first: under one MPI tag
    the receive would have matched it. Messages from one source reach the receiver in the order sent, so when
    ``look`` sees one, the message this receive waits for, if it was sent earlier, has arrived too; but MPI
    may have matched it in the very probe that showed the other (the elastic buddy copies send a uint8 flag,
    then a float64 array, under one tag: once in a few hundred runs the flag's receive saw the array). So
    ``look`` returns the other message's wire tag and leaves it where it is; the receive asks once more
    whether its own message is there (a matched probe, or a cancel that fails because the posted receive
    was matched) and refuses only if it is not.
    """

    def __init__(self, comm: Any, src: int, wire: int):
        self._comm, self._src, self._wire = comm, src, wire
        self._next = time.monotonic() + CHECK_EVERY

    def look(self) -> Optional[int]:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + CHECK_EVERY
        return other_dtype(self._comm, self._src, self._wire)


__all__ = ["DTYPE_TAGS", "CHECK_EVERY", "drop", "largest_tag", "wire_tag", "other_dtype", "refuse_other", "Looker"]
