"""NCCL point-to-point messages announced over the host, so that a receive knows which message NCCL will give it.

[Note: envelopes]
NCCL matches the sends and receives between two ranks in the order they are issued. It has no tags, and it
trusts both sides' counts and datatypes: a receive posted for another message than the next one, or of another
dtype or size, takes the wrong bytes without an error, or hangs. MPI would have matched by tag and raised. So
the NCCL backend announces each message over the host, on a communicator split for the purpose:

- a send posts its envelope (user tag, dtype code, element count: ``FIELDS`` int64) to its peer when it is
  called, before its NCCL send can be issued;
- a receive takes the envelopes from its peer in the order sent (MPI does not let messages of one source and
  tag overtake each other), one per receive, in the order the receives were called. The NCCL receives from
  that peer are issued in that same order, so the envelope a receive takes describes the message NCCL will
  hand it.
- A blocking receive checks its envelope before its NCCL receive is issued: it waits for the sender to have
  called its send, as a blocking MPI receive waits for its sender (having issued the queued messages first if
  any is a send and the envelope is not there yet: the peer may need it to get as far as its own send). A
  non-blocking one is checked when its Work is waited on, before the wait for the data (so a size mismatch
  raises instead of hanging), or when ``is_completed`` finds its data there.

An envelope with another tag raises ``UsageError``: the receives came in another order than the sends, which
MPI's tags would sort out and NCCL cannot. Another dtype or size raises ``ShapeError``. Both name the two
sides. The sender's NCCL send is then left unmatched, so the job cannot go on past the error (under
``AXONHPC_ABORT_ON_EXCEPTION``, the default of ``axonhpc launch``, it ends).

Costs: one host message of 24 bytes per device message. (Point-to-point messages are not captured in CUDA
graphs: ``collectives.p2p`` refuses them in a capture.)
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, Callable, Deque, Dict, Optional

import numpy as np

from .._dtypes import dtype_places, supported_dtypes
from ..errors import ShapeError, UsageError
from .base import Backend

FIELDS = 3  # user tag, dtype code, element count
TAG = 0  # every envelope travels under one tag, so that MPI keeps them in the order sent


def dtype_code(dtype: Any) -> int:
    """The dtype's place in ``supported_dtypes()`` (-1 for one outside it, which NCCL would have refused)."""
    return dtype_places().get(np.dtype(dtype), -1)


def dtype_name(code: int) -> str:
    dtypes = list(supported_dtypes())
    return str(dtypes[code]) if 0 <= code < len(dtypes) else f"dtype code {code}"


class Expected:
    """A receive's claim on the next envelope from ``src``: checked once, by ``Envelopes.check``."""

    def __init__(self, buf: Any, src: int, tag: int):
        self.buf, self.src, self.tag = buf, src, tag
        self.checked = False
        self.error: Optional[Exception] = None


class Envelopes:
    """The envelopes of one NCCL communicator's messages, over ``host``: a host communicator of the same ranks,
    used for nothing else. ``world_rank(r)`` names a rank in errors."""

    def __init__(self, host: Backend, world_rank: Callable[[int], int]):
        self.host = host
        self._world_rank = world_rank
        self._sent: Deque = deque()  # (Work, envelope) of envelopes in flight
        self._expected: Dict[int, Deque[Expected]] = defaultdict(deque)  # per source, in call order

    def announce(self, buf: Any, dst: int, tag: int) -> None:
        """Post the envelope of a send of ``buf`` to ``dst`` under ``tag`` (before its NCCL send is issued)."""
        envelope = np.array([tag, dtype_code(buf.dtype), buf.size], dtype=np.int64)
        self._sent.append((self.host.send(envelope, dst, TAG, async_op=True), envelope))
        while self._sent and self._sent[0][0].is_completed():
            self._sent.popleft()

    def expect(self, buf: Any, src: int, tag: int) -> Expected:
        """Claim the next envelope from ``src`` for a receive into ``buf`` (called in the receives' call order)."""
        expected = Expected(buf, src, tag)
        self._expected[src].append(expected)
        return expected

    def check(self, expected: Expected, before_wait: Optional[Callable[[], None]] = None) -> None:
        """Take the envelopes from ``expected.src`` up to its own, in order, and check each against its receive.

        ``before_wait()`` runs before the first wait for an envelope that has not arrived (the backend issues its
        queued sends: a peer may need one of them before it can send this envelope).

        Raises:
            UsageError: the envelope has another tag (receives called in another order than the sends).
            ShapeError: it describes another dtype or number of elements.
        """
        queue = self._expected[expected.src]
        while not expected.checked:
            first = queue.popleft()
            first.checked = True
            envelope = np.empty(FIELDS, dtype=np.int64)
            work = self.host.recv(envelope, first.src, TAG, async_op=True)
            if not work.is_completed():
                if before_wait is not None:
                    before_wait()
                    before_wait = None
                work.wait()
            first.error = self._problem(first, *(int(v) for v in envelope))
        if expected.error is not None:
            raise expected.error

    def _problem(self, expected: Expected, tag: int, code: int, count: int) -> Optional[Exception]:
        buf, peer = expected.buf, self._world_rank(expected.src)
        theirs = f"{count} elements of {dtype_name(code)}"
        where = f"recv from rank {peer} tag {expected.tag}"
        unmatched = "; its NCCL send is left unmatched, so the job cannot go on"
        if tag != expected.tag:
            return UsageError(
                f"{where}: the next device array rank {peer} sent this rank has tag {tag} ({theirs}). NCCL hands "
                f"over the device arrays two ranks exchange in the order they were sent, whatever their tags: "
                f"receive them in that order (host arrays travel over MPI, which matches by tag){unmatched}")
        if code != dtype_code(buf.dtype) or count != buf.size:
            return ShapeError(
                f"{where}: the incoming message holds {theirs}, but the receive buffer is {buf.size} elements of "
                f"{buf.dtype} ({buf.nbytes} bytes; shape {tuple(buf.shape)}){unmatched}")
        return None

    def free(self) -> None:
        self.host.free()  # envelopes still in flight complete normally (MPI frees the communicator after them)


__all__ = ["Envelopes", "Expected", "FIELDS", "TAG", "dtype_code"]
