"""One worker's side of the parameter server: ``Worker``, its requests and the servers' replies.

A worker rank's ``ParameterServer`` delegates ``pull``, ``push``, ``step``,
``finish``, ``abort`` and ``stats`` here (a server rank's run ``ServerLoop``).
See the package notes on messages, deadlock freedom and failures.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...collectives import irecv, isend, recv, send
from ...errors import ParameterServerError, PeerFailedError, ShapeError
from .protocol import (BARE, CLOSED, DONE, FAILED, HEADER, NAME, OK, PULL, PUSH, TAG_GRAD, TAG_PARAMS, TAG_REASON,
                       TAG_REPLY, TAG_REQUEST, encode_reason)
from .slices import Slices


class Worker:
    """One worker's state and its conversation with every server.

    Args:
        ps: the ParameterServer it belongs to (its roles, mode, group and ``server_rank``).
        comm: the private communicator of the parameter server.
        slices: the flat vectors of the model's parameters, after ``allocate``.
        params: the model's Parameters, in registration order.

    Attributes:
        closed: DONE or FAILED was sent to every server (after ``finish`` or ``abort``).
    """

    def __init__(self, ps: Any, comm: Any, slices: Slices, params: List[Any]) -> None:
        self.ps = ps
        self.comm = comm
        self.slices = slices
        self.params = params
        self.grad_flats = slices.zeros()
        self.versions = [0] * ps.num_servers  # version of each server's slice last pulled
        self.pulled = False  # a pull since the last push
        self.closed = False  # DONE or FAILED sent to every server
        self.aborted: Optional[str] = None  # why the servers stopped this worker
        self.gone: set = set()  # servers that sent their last word: nothing more is sent to them
        # Gradients sent to each server and not yet known received: a server's answer (other than its last word)
        # comes after it has read them, so they are waited for then; its last word drops them.
        self.in_flight: List[List[Tuple[Any, Any]]] = [[] for _ in range(ps.num_servers)]
        self.counts = {"pushes": 0, "pulls": 0, "pull_wait_s": 0.0}

    def _require_open(self, what: str) -> None:
        if self.aborted is not None:
            raise PeerFailedError(self.aborted)
        if self.closed:
            raise ParameterServerError(f"{NAME}.{what}() on worker {self.ps.worker_index} after finish() or abort()")

    # -- messages ----------------------------------------------------------------------------------
    def _send_request(self, server: int, kind: int, version: int = 0, reason: str = "", flag: bool = False) -> None:
        """One request; ``flag``: DONE wants the final parameters, FAILED passes on a server's ABORT."""
        text = encode_reason(reason) if reason else None
        header = np.array([kind, version, 0 if text is None else text.size, int(flag)], dtype=np.int64)
        dst = self.ps.server_rank(server)
        send(header, dst, TAG_REQUEST, self.comm)
        if text is not None and text.size:
            send(text, dst, TAG_REASON, self.comm)

    def _receive_reply(self, server: int) -> Tuple[bool, int, str]:
        """One server's answer: (OK?, its version, its reason if it aborted); an OK fills the slices' ``values``,
        unless BARE. An ABORT marked CLOSED is the server's last word (see ``server``'s note): it has left or
        given this worker up, so nothing more is sent to it and the gradients in flight to it are dropped."""
        src = self.ps.server_rank(server)
        header = np.zeros(HEADER, dtype=np.int64)
        # A reply may be long in coming (a pull waiting for the bound); waiting with a finite
        # (or infinite) limit polls with back-off instead of spinning in MPI_Recv, which on an
        # oversubscribed node would take the core from the very server being waited for.
        timeout = self.comm.effective_timeout()
        limit = math.inf if timeout is None else timeout
        irecv(header, src, TAG_REPLY, self.comm).wait(limit)
        status, version, length, flags = (int(v) for v in header)
        sent, self.in_flight[server] = self.in_flight[server], []
        if status != OK and flags == CLOSED:
            self.gone.add(server)
        else:
            for work, _ in sent:
                work.wait(limit)
        if status == OK:
            for part in [] if flags == BARE else self.slices.parts(self.slices.values, server):
                if part.size:
                    recv(part, src, TAG_PARAMS, self.comm)
            return True, version, ""
        text = np.zeros(length, dtype=np.uint8)
        if length:
            recv(text, src, TAG_REASON, self.comm)
        return False, version, text.tobytes().decode("utf-8", "replace")

    def _server_name(self, server: int) -> str:
        return f"parameter server {server} (global rank {self.ps.group.ranks[self.ps.server_rank(server)]})"

    def _stopped_by(self, server: int, reason: str) -> str:
        """Close this worker on every server after ``server`` answered ABORT; the error's text."""
        message = f"{self._server_name(server)} stopped the run: {reason}"
        if not self.closed:
            self.closed = True
            for s in range(self.ps.num_servers):
                if s not in self.gone:
                    self._send_request(s, FAILED, reason=f"stopped after {message}", flag=True)
        self.aborted = message
        return message

    def _collect(self, servers: List[int]) -> None:
        """Receive the replies of ``servers`` in order; on an ABORT close everywhere (once every reply is in, so
        that no server whose last word came is sent more), then raise."""
        failure = None
        for s in servers:
            ok, version, reason = self._receive_reply(s)
            if ok:
                self.versions[s] = version
            elif failure is None:
                failure = (s, reason)
        if failure is not None:
            raise PeerFailedError(self._stopped_by(*failure))

    # -- ParameterServer's worker methods (see their docstrings there) ---------------------------------
    def pull(self) -> None:
        """``ParameterServer.pull`` on this worker."""
        self._require_open("pull")
        started = time.perf_counter()
        if self.ps.mode == "sync":
            for s in range(self.ps.num_servers):
                self._send_request(s, PULL)
            self._collect(list(range(self.ps.num_servers)))
        else:  # one server at a time, in order (see the note on deadlock freedom)
            for s in range(self.ps.num_servers):
                self._send_request(s, PULL)
                self._collect([s])
        self.slices.load_values()
        self.pulled = True
        self.counts["pulls"] += 1
        self.counts["pull_wait_s"] += time.perf_counter() - started

    def push(self) -> None:
        """``ParameterServer.push`` on this worker."""
        self._require_open("push")
        if not self.pulled:
            raise ParameterServerError(f"{NAME}.push() on worker {self.ps.worker_index} without a pull() since the "
                                       "last push: call ps.pull() before the first forward and use ps.step() "
                                       "(push, then pull) after each backward")
        if all(p.grad is None for p in self.params):
            raise ParameterServerError(f"{NAME}.push() on worker {self.ps.worker_index}: no parameter has a "
                                       "gradient; run backward first")
        for i, p in enumerate(self.params):
            if p.grad is not None and tuple(p.grad.shape) != tuple(p.data.shape):
                raise ShapeError(f"{NAME}.push: parameter {i} has a gradient of shape {tuple(p.grad.shape)}, "
                                 f"the parameter has {tuple(p.data.shape)}")
        self.slices.pack_grads(self.grad_flats)  # None as zeros
        for s in range(self.ps.num_servers):
            self._send_request(s, PUSH, version=self.versions[s])
            dst = self.ps.server_rank(s)
            # Not waited for here: a server that has left never reads them (see ``in_flight``).
            self.in_flight[s] = [(isend(part, dst, TAG_GRAD, self.comm), part)
                                 for part in self.slices.parts(self.grad_flats, s) if part.size]
        self.pulled = False
        self.counts["pushes"] += 1

    def finish(self, pull: bool) -> None:
        """``ParameterServer.finish`` on this worker."""
        if self.aborted is not None:
            raise PeerFailedError(self.aborted)
        if self.closed:
            return
        for s in range(self.ps.num_servers):
            self._send_request(s, DONE, flag=pull)
        self.closed = True
        # Each server answers (OK alone when no parameters are wanted), so a failed run, or a server that gave
        # this worker up, raises here too.
        self._collect(list(range(self.ps.num_servers)))
        if pull:
            self.slices.load_values()

    def abort(self, reason: str) -> None:
        """``ParameterServer.abort`` on this worker: FAILED with ``reason`` to every server, unless closed."""
        if self.closed:
            return
        self.closed = True
        for s in range(self.ps.num_servers):
            if s not in self.gone:
                self._send_request(s, FAILED, reason=reason)

    def stats(self) -> Dict[str, Any]:
        """``ParameterServer.stats`` on this worker."""
        return {"role": "worker", "worker_index": self.ps.worker_index, "mode": self.ps.mode,
                "pushes": self.counts["pushes"], "pulls": self.counts["pulls"],
                "versions": list(self.versions), "pull_wait_s": self.counts["pull_wait_s"]}


__all__ = ["Worker"]
