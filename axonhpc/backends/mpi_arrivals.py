"""Which ranks have entered a timed collective of the MPI backend: ``Arrivals``, notices on a side communicator."""
from __future__ import annotations

import time
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np

from .mpi_work import poll
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
        self._done = {r: False for r in self.peers}  # True once the peer's notice has come
        self._cancelled: set = set()  # peers whose receive was cancelled: no notice came, none will be counted
        self._drained: Optional[List[int]] = None  # drain()'s answer, once drained

    def _poll(self) -> None:
        for r, request in self._recvs.items():
            if not self._done[r] and r not in self._cancelled and request.Test():
                self._done[r] = True

    def missing(self) -> List[int]:
        """Global ranks whose notice for this collective has not arrived (this rank is never among them), but for
        peers known to send none (``unknown``)."""
        self._poll()
        return [self.global_ranks[r] for r in self.peers
                if (self._done[r] and self._other(r)) or (not self._done[r] and r not in self._silent)]

    def unknown(self) -> List[int]:
        """Global ranks of peers known to send no notices (their timeout is off) and with none for this collective:
        whether they have entered it cannot be told."""
        self._poll()
        return [self.global_ranks[r] for r in self.peers if not self._done[r] and r in self._silent]

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

        Drained once: a call whose agreement check and data call both complete under the same notices (each
        waited for by ``watch.wait``) gets the first answer again, without waiting or cancelling anything.
        """
        if self._drained is not None:
            return self._drained
        MPI = load_mpi()
        awaited = [request for r, request in self._recvs.items() if r not in self._silent] + self._sends
        if poll(lambda: MPI.Request.Testall(awaited), time.monotonic() + patience) and not self._silent:
            self._drained = []
            return self._drained
        self._poll()
        quiet = [r for r in self.peers if not self._done[r]]
        self._silent.difference_update(r for r in self.peers if self._done[r])
        self._silent.update(quiet)  # not waited for again: one such wait is enough to tell
        self.abandon()
        self._drained = [self.global_ranks[r] for r in self.peers if not self._done[r]]
        return self._drained

    def abandon(self) -> None:
        """Cancel the receives that never completed (after a timeout: the job is ending; or a peer that sends none).

        A cancelled receive completes too, so it is completed here (a local wait, MPI says) and its peer counted
        as arrived only if the notice came before the cancellation took effect; ``_poll`` never tests it again.
        """
        MPI = load_mpi()
        status = MPI.Status()
        for r, request in self._recvs.items():
            if self._done[r] or r in self._cancelled:
                continue
            request.Cancel()
            try:
                request.Wait(status)
            except MPI.Exception:  # a failed peer (fault-tolerant jobs): nothing will come from it
                self._cancelled.add(r)
                continue
            if status.Is_cancelled():
                self._cancelled.add(r)
            else:
                self._done[r] = True
                if r in self._silent:
                    self._silent.discard(r)


__all__ = ["Arrivals"]
