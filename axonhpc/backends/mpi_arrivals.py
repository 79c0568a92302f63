"""Which ranks have entered a timed collective of the MPI backend: ``Arrivals``, notices on a side communicator."""
from __future__ import annotations

import time
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np

from .mpi_p2p import poll
from .mpi_work import load_mpi


# The operations a notice can name (by CRC-32 of the name), for messages.
_NOTICE_OPS = {zlib.crc32(name.encode()): name for name in (
    "all_reduce", "reduce_scatter", "broadcast", "all_gather", "gather", "scatter", "barrier")}


class Arrivals:
    """Which ranks have entered one timed collective: notices on a side communicator.

    [Note: naming the missing ranks]
    MPI cannot say which ranks have not joined a collective. So before a timed blocking collective every
    rank sends an 8-byte notice with its sequence number to every peer over a private duplicate
    communicator and posts a receive for each peer's; the wait tests those alongside the collective. A
    rank whose notice is missing at timeout has not entered; one with another number is in a different
    collective. Afterwards the receives are drained at once. Cost: 2 (P - 1) tiny messages per timed
    collective, nothing without a timeout.
    """

    TAG_SPACE = 30000

    def __init__(self, side, seq: int, op: str, rank: int, global_ranks: Sequence[int], silent: Optional[set] = None):
        MPI = load_mpi()
        self._silent = set() if silent is None else silent  # the communicator's peers known to send no notices
        self.seq = int(seq)
        self.op = op
        self.global_ranks = tuple(global_ranks)
        self.peers = [r for r in range(len(self.global_ranks)) if r != rank]
        tag = self.seq % self.TAG_SPACE
        self._note = np.array([self.seq, zlib.crc32(op.encode())], dtype=np.int64)
        self._sends = [side.Isend([self._note, MPI.INT64_T], dest=r, tag=tag) for r in self.peers]
        self._boxes = {r: np.full(2, -1, dtype=np.int64) for r in self.peers}
        self._recvs = {r: side.Irecv([self._boxes[r], MPI.INT64_T], source=r, tag=tag) for r in self.peers}
        self._done = {r: False for r in self.peers}

    def _poll(self) -> None:
        for r, request in self._recvs.items():
            if not self._done[r] and request.Test():
                self._done[r] = True

    def missing(self) -> List[int]:
        """Global ranks whose notice for this collective has not arrived (this rank is never among them)."""
        self._poll()
        return [self.global_ranks[r] for r in self.peers if not self._done[r] or self._other(r)]

    def _other(self, r: int) -> bool:
        return (int(self._boxes[r][0]), int(self._boxes[r][1])) != (self.seq, int(self._note[1]))

    def elsewhere(self) -> Dict[int, str]:
        """Global rank -> "#seq op" of peers whose notice names another collective than this one."""
        self._poll()
        return {self.global_ranks[r]: f"#{int(self._boxes[r][0])} {_NOTICE_OPS.get(int(self._boxes[r][1]), 'another op')}"
                for r in self.peers if self._done[r] and self._other(r)}

    def drain(self, patience: float = 5.0) -> List[int]:
        """After the collective completed: receive every notice and finish the sends; returns the peers without one.

        A peer that waits under a timeout sends its notice before it enters, so once the collective is complete
        its notice is at most in flight. One that has not come within ``patience`` seconds is from a peer that
        sends none (its group has no timeout there): that receive is cancelled, its global rank returned, and
        that peer not waited for again until a notice of its comes. Polled, not ``MPI_Waitall``: a wait inside
        MPI could not be ended.
        """
        MPI = load_mpi()
        awaited = [request for r, request in self._recvs.items() if r not in self._silent] + self._sends
        if poll(lambda: MPI.Request.Testall(awaited), time.monotonic() + patience):
            if not self._silent:
                return []
        self._poll()
        quiet = [r for r in self.peers if not self._done[r]]
        self._silent.difference_update(r for r in self.peers if self._done[r])
        self._silent.update(quiet)  # not waited for again: one such wait is enough to tell
        self.abandon()
        return [self.global_ranks[r] for r in quiet]

    def abandon(self) -> None:
        """After a timeout: cancel the receives that never completed (the job is ending)."""
        for r, request in self._recvs.items():
            if not self._done[r]:
                request.Cancel()


__all__ = ["Arrivals"]
