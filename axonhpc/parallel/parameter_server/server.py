"""One server's state and its request loop (see the package notes on messages, deadlock freedom and failures)."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...collectives import irecv, isend, recv
from ...errors import CollectiveTimeoutError, ParameterServerError, PeerFailedError
from ...nn.parameter import Parameter
from .protocol import (ABORT, DONE, FAILED, HEADER, OK, POLL_MAX, POLL_MIN, PULL, PUSH, TAG_FINAL, TAG_GRAD,
                       TAG_PARAMS, TAG_REASON, TAG_REPLY, TAG_REQUEST, TAG_VERDICT, encode_reason)
from .slices import Slices
from .staleness import StalenessBound


class ServerLoop:
    """One server's state and its request loop (see the module notes)."""

    def __init__(self, ps: Any, comm: Any, slices: Slices, shards: List[Parameter]) -> None:
        self.ps = ps
        self.comm = comm
        self.slices = slices
        self.index = ps.server_index
        self.workers = ps.num_workers
        self.shards = shards
        self.sync = ps.mode == "sync"
        self.bound = None if self.sync else StalenessBound(ps.max_staleness)
        self._version = 0  # sync: rounds applied
        self.base = [0] * self.workers  # sync: version each worker last pulled
        self.histogram: Dict[int, int] = {}
        self.max_observed = 0
        self.open = set(range(self.workers))
        self.headers = [np.zeros(HEADER, dtype=np.int64) for _ in range(self.workers)]
        self.requests: List[Any] = [None] * self.workers
        self.grads = [[sh.data.copy() for sh in shards] for _ in range(self.workers)]  # receive buffers
        self.round: set = set()  # sync: workers whose gradient is in the current update
        self.deferred: List[int] = []  # pulls that wait, in arrival order
        self.finals: List[int] = []  # DONE requests waiting for the final parameters
        self.sends: List[Tuple[Any, Any]] = []  # (Work, buffer) of replies in flight
        self.failure: Optional[str] = None
        self.pushes = [0] * self.workers
        self.pulls = [0] * self.workers
        self.applied = [0] * self.workers
        self.deferred_pulls = 0
        self.deferred_gradients = 0

    @property
    def version(self) -> int:
        """Updates applied so far."""
        return self._version if self.bound is None else self.bound.version

    def _record(self, worker: int, staleness: int) -> None:
        self.applied[worker] += 1
        self.histogram[staleness] = self.histogram.get(staleness, 0) + 1
        self.max_observed = max(self.max_observed, staleness)

    def stats(self) -> Dict[str, Any]:
        """This server's counters: its index, mode, staleness bound, version and what it has served."""
        return {"role": "server", "server_index": self.index, "mode": self.ps.mode,
                "max_staleness": self.ps.max_staleness, "version": self.version,
                "gradients": sum(self.applied), "max_staleness_observed": self.max_observed,
                "staleness_histogram": dict(sorted(self.histogram.items())),
                "pushes": list(self.pushes), "pulls": list(self.pulls), "applied": list(self.applied),
                "deferred_pulls": self.deferred_pulls, "deferred_gradients": self.deferred_gradients,
                "failure": self.failure}

    def _global(self, worker: int) -> int:
        return self.ps.group.ranks[worker]

    @property
    def name(self) -> str:
        """How messages name this server: "parameter server 0 (global rank 3)"."""
        return f"parameter server {self.index} (global rank {self.ps.group.ranks[self.ps.group.rank]})"

    # -- sending -------------------------------------------------------------------------------------
    def _isend(self, buf: Any, dst: int, tag: int) -> None:
        self.sends.append((isend(buf, dst, tag, self.comm), buf))

    def _reply_ok(self, worker: int) -> None:
        self._isend(np.array([OK, self.version, 0, 0], dtype=np.int64), worker, TAG_REPLY)
        for shard in self.shards:
            if shard.data.size:
                self._isend(shard.data.copy(), worker, TAG_PARAMS)

    def _reply_abort(self, worker: int) -> None:
        text = encode_reason(self.failure or "")
        self._isend(np.array([ABORT, self.version, text.size, 0], dtype=np.int64), worker, TAG_REPLY)
        if text.size:
            self._isend(text, worker, TAG_REASON)

    def _reap_sends(self) -> None:
        self.sends = [(work, buf) for work, buf in self.sends if not work.is_completed()]

    # -- updates ----------------------------------------------------------------------------------------
    def _apply(self, contributors: List[int], scale: int) -> None:
        """Sum the contributors' gradients in worker order, divide by ``scale``, take one optimizer step."""
        for d, shard in enumerate(self.shards):
            total = shard.grad
            total[...] = self.grads[contributors[0]][d]
            for w in contributors[1:]:
                total += self.grads[w][d]
            total /= scale
        self.ps.optimizer.step()

    def _complete_round(self) -> None:
        """Sync: once every open worker has pushed, apply their mean and answer the waiting pulls."""
        if not self.round or not self.open <= self.round:
            return
        members = sorted(self.round)
        self._apply(members, len(members))
        for w in members:
            self._record(w, self._version - self.base[w])
        self._version += 1
        self.round.clear()
        waiting, self.deferred = self.deferred, []
        for w in sorted(waiting):
            self._sync_reply(w)

    def _apply_ready(self) -> None:
        """Async: apply every buffered gradient the bound allows, oldest first."""
        while True:
            w = self.bound.ready()
            if w is None:
                return
            self._apply([w], self.workers)
            _, staleness = self.bound.apply(w)
            self._record(w, staleness)

    def _answer_deferred(self) -> None:
        """Async: answer the waiting pulls the bound now allows, in arrival order."""
        still = []
        for w in self.deferred:
            if self.bound.can_pull(w):
                self.bound.pull(w)
                self._reply_ok(w)
            else:
                still.append(w)
        self.deferred = still

    # -- requests ----------------------------------------------------------------------------------------
    def _post(self, worker: int) -> None:
        self.requests[worker] = irecv(self.headers[worker], worker, TAG_REQUEST, self.comm)

    def _sync_reply(self, worker: int) -> None:
        self.base[worker] = self._version
        self._reply_ok(worker)

    def _on_push(self, worker: int, version: int) -> None:
        base = self.base[worker] if self.sync else self.bound.push(worker)
        if base != version:
            raise ParameterServerError(f"server {self.index}: worker {worker} pushed a gradient of version "
                                       f"{version}, its last pull here was version {base}")
        if self.sync:
            self.round.add(worker)
            self._complete_round()
            return
        self._apply_ready()
        if worker in self.bound.buffered():
            self.deferred_gradients += 1
        self._answer_deferred()

    def _on_pull(self, worker: int) -> None:
        if self.sync:
            if worker in self.round:
                self.deferred.append(worker)
                self.deferred_pulls += 1
            else:
                self._sync_reply(worker)
            return
        self.deferred.append(worker)
        self._answer_deferred()
        if worker in self.deferred:
            self.deferred_pulls += 1

    def _on_close(self, worker: int) -> None:
        self.open.discard(worker)
        if self.failure is not None:
            return
        if self.sync:
            self._complete_round()
        else:
            self.bound.close(worker)
            self._apply_ready()
            self._answer_deferred()

    def _start_abort(self, reason: str) -> None:
        """Stop updating; answer every waiting pull and final request with ABORT."""
        if self.failure is not None:
            return
        self.failure = reason
        for w in self.deferred + self.finals:
            self._reply_abort(w)
        self.deferred, self.finals = [], []
        self.round.clear()

    def _handle(self, worker: int) -> None:
        kind, version, length, want_final = (int(v) for v in self.headers[worker])
        if kind == PUSH:
            for buf in self.grads[worker]:
                if buf.size:
                    recv(buf, worker, TAG_GRAD, self.comm)
            self._post(worker)
            self.pushes[worker] += 1
            if self.failure is None:
                self._on_push(worker, version)
        elif kind == PULL:
            self._post(worker)
            self.pulls[worker] += 1
            if self.failure is not None:
                self._reply_abort(worker)
            else:
                self._on_pull(worker)
        elif kind == DONE:
            if want_final:
                if self.failure is not None:
                    self._reply_abort(worker)
                else:
                    self.finals.append(worker)
            self._on_close(worker)
        elif kind == FAILED:
            text = np.zeros(length, dtype=np.uint8)
            if length:
                recv(text, worker, TAG_REASON, self.comm)
            self._start_abort(f"worker {worker} (global rank {self._global(worker)}) failed: "
                              f"{text.tobytes().decode('utf-8', 'replace')}")
            self._on_close(worker)
        else:
            raise ParameterServerError(f"server {self.index}: unknown request kind {kind} from worker {worker}")

    def _loop(self) -> None:
        timeout = self.comm.effective_timeout()
        delay, last = POLL_MIN, time.monotonic()
        while self.open:
            progressed = False
            for w in range(self.workers):
                work = self.requests[w]
                if work is not None and work.is_completed():
                    self.requests[w] = None
                    self._handle(w)
                    progressed = True
            self._reap_sends()
            now = time.monotonic()
            if progressed:
                delay, last = POLL_MIN, now
                continue
            if timeout is not None and now - last > timeout:
                missing = sorted(self._global(w) for w in self.open if w not in self.deferred)
                raise CollectiveTimeoutError(
                    f"{self.name} timed out after {timeout:g} s waiting for requests of open workers (those not "
                    f"waiting for a reply themselves); missing ranks: {missing}")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    def run(self, failure: Optional[str] = None) -> None:
        """Serve until every worker has sent DONE or FAILED; raise if the run failed."""
        for w in range(self.workers):
            self._post(w)
        if failure is not None:
            self._start_abort(failure)
        own: Optional[BaseException] = None
        while True:
            try:
                self._loop()
                break
            except CollectiveTimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - the workers are told, then it is re-raised
                if own is not None or self.failure is not None:
                    raise
                own = exc
                self._start_abort(f"{self.name} failed: {type(exc).__name__}: {exc}")
        timeout = self.comm.effective_timeout()
        # Every worker has stopped; the servers tell each other how their run ended before
        # anything else (see the note on shutdown): a server whose optimizer failed on the
        # last update would otherwise leave the others waiting for its slices.
        failed = self._verdicts()
        if self.failure is None and failed:
            self._start_abort(failed[0])  # the final pulls are answered with ABORT
        if self.failure is None:
            self._finish()
        for work, _ in self.sends:
            work.wait(timeout)
        self.sends = []
        if own is not None:
            raise own
        if self.failure is not None and failure is None:
            raise PeerFailedError(f"{self.name} stopped: {self.failure}")

    def _verdicts(self) -> List[str]:
        """Collective over the servers: send every other server OK or ABORT (with this server's failure);
        returns the failures the others reported, in server order."""
        ps = self.ps
        others = [s for s in range(ps.num_servers) if s != self.index]
        text = encode_reason(self.failure or "")
        header = np.array([OK if self.failure is None else ABORT, text.size, 0, 0], dtype=np.int64)
        for s in others:
            self._isend(header, ps.server_rank(s), TAG_VERDICT)
            if text.size:
                self._isend(text, ps.server_rank(s), TAG_REASON)
        timeout = self.comm.effective_timeout()
        failed = []
        for s in others:
            src = ps.server_rank(s)
            theirs = np.zeros(HEADER, dtype=np.int64)
            irecv(theirs, src, TAG_VERDICT, self.comm).wait(math.inf if timeout is None else timeout)
            if int(theirs[0]) == OK:
                continue
            reason = np.zeros(int(theirs[1]), dtype=np.uint8)
            if reason.size:
                recv(reason, src, TAG_REASON, self.comm)
            failed.append(reason.tobytes().decode("utf-8", "replace")
                          or f"parameter server {s} (global rank {ps.group.ranks[src]}) failed")
        return failed

    def _finish(self) -> None:
        """Normal end: answer the final pulls, swap slices with the other servers, load the model."""
        for w in self.finals:
            self._reply_ok(w)
        self.finals = []
        ps = self.ps
        for s in range(ps.num_servers):
            if s != self.index:
                for shard in self.shards:
                    if shard.data.size:
                        self._isend(shard.data.copy(), ps.server_rank(s), TAG_FINAL)
        for part, shard in zip(self.slices.parts(self.slices.values, self.index), self.shards):
            part[...] = shard.data
        for s in range(ps.num_servers):
            if s != self.index:
                for part in self.slices.parts(self.slices.values, s):
                    if part.size:
                        recv(part, ps.server_rank(s), TAG_FINAL, self.comm)
        self.slices.load_values()

__all__ = ["ServerLoop"]
