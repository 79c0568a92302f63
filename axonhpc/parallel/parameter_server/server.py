"""One server's state and its request loop (see the package notes on messages, deadlock freedom and failures)."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import numpy as np

from ...collectives import irecv, isend, recv
from ...errors import GROUP_FAILURES, CollectiveTimeoutError, ParameterServerError, PeerFailedError
from ...nn.parameter import Parameter
from .interrupts import HeldInterrupt
from .protocol import (ABORT, BARE, CLOSED, DONE, FAILED, HEADER, OK, POLL_MAX, POLL_MIN, PULL, PUSH, TAG_FINAL,
                       TAG_GRAD, TAG_PARAMS, TAG_REASON, TAG_REPLY, TAG_REQUEST, TAG_VERDICT, encode_reason)
from .slices import Slices
from .staleness import StalenessBound


def noted(error: BaseException, text: str) -> BaseException:
    """``error`` with ``text`` added as a note, shown under its traceback (Python 3.11 and later)."""
    if hasattr(error, "add_note"):
        error.add_note(text)
    return error


class ServerLoop:
    """One server's state and its request loop (see the package notes).

    [Note: a server's own failures]
    Whatever raises while a request is handled (the optimizer, a request the protocol does not know) fails this
    server, the first time or any later time: it goes into ``failures``, which every later ABORT reply and the
    verdict carry, and the server goes on answering ABORT until every worker has stopped, so that no worker and
    no other server waits for it; ``run`` raises the first such error at the end, noting the rest. Only when the
    messages themselves stop coming through (``GROUP_FAILURES``: a time limit, a dead peer's revoked
    communicator) does it leave early, and it tells whom it still can first. Workers that send nothing for the
    time limit are given up (a ``CollectiveTimeoutError`` naming them, raised at the end) and the others served.

    [Note: a server's last word]
    A server that stops listening to a worker before that worker has stopped (it gave the worker up after the time
    limit, or it leaves early: the messages stopped coming through, or a ``KeyboardInterrupt`` or another
    ``BaseException`` ended its loop) sends that worker, unasked, one ABORT marked CLOSED that carries the run's
    failures, and answers it nothing more. Only replies travel on TAG_REPLY and a worker waits for one after each
    pull and finish, so whenever it comes back it takes that ABORT as its next answer and raises
    ``PeerFailedError`` naming this server and its verdict; it sends the server nothing more, and its gradients
    in flight to it (``isend``) are dropped rather than waited for. A server that leaves early also sends the
    other servers its verdict, and re-raises a ``BaseException`` itself.
    """

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
        self.failures: List[str] = []  # why the run stopped, first first (see the note)
        self.errors: List[Exception] = []  # this server's own, first first: run() raises the first
        self.verdict_sent = False
        self.closed: set = set()  # workers sent this server's last word: answered nothing more (see the note)
        self.leaving = False  # this server leaves before every worker has stopped: every ABORT is its last word
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

    @property
    def failure(self) -> Optional[str]:
        """Why the run stopped, "; "-joined, first first; None while it runs."""
        return "; ".join(self.failures) if self.failures else None

    def _global(self, worker: int) -> int:
        return self.ps.group.ranks[worker]

    @property
    def name(self) -> str:
        """How messages name this server: "parameter server 0 (global rank 3)"."""
        return f"parameter server {self.index} (global rank {self.ps.group.ranks[self.ps.group.rank]})"

    # -- sending -------------------------------------------------------------------------------------
    def _isend(self, buf: Any, dst: int, tag: int) -> None:
        self.sends.append((isend(buf, dst, tag, self.comm), buf))

    def _reply_ok(self, worker: int, bare: bool = False) -> None:
        """OK and this server's slices; ``bare``: OK alone (a DONE that wants no parameters)."""
        self._isend(np.array([OK, self.version, 0, BARE if bare else 0], dtype=np.int64), worker, TAG_REPLY)
        for shard in [] if bare else self.shards:
            if shard.data.size:
                self._isend(shard.data.copy(), worker, TAG_PARAMS)

    def _reply_abort(self, worker: int, last: bool = False) -> None:
        """ABORT with the run's failures; ``last`` (or leaving): this server's last word to ``worker`` (see the
        note), after which it answers that worker nothing more."""
        if worker in self.closed:
            return  # it has this server's last word already, and takes it as its answer
        last = last or self.leaving
        if last:
            self.closed.add(worker)
        text = encode_reason(self.failure or "")
        self._isend(np.array([ABORT, self.version, text.size, CLOSED if last else 0], dtype=np.int64), worker,
                    TAG_REPLY)
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

    def _add_failure(self, text: str) -> None:
        """Record a failure. The first stops the updates and answers every waiting pull and final request with
        ABORT; a later one that says something new goes into every later ABORT and the verdict."""
        text = text.replace("\0", " ")  # "\0" separates the failures of a verdict
        if any(text in known or known in text for known in self.failures):
            return  # known already, or an account of a known one (a worker stopped by this or another server)
        self.failures.append(text)
        if len(self.failures) > 1:
            return
        for w in self.deferred + self.finals:
            self._reply_abort(w)
        self.deferred, self.finals = [], []
        self.round.clear()

    def _describe(self, exc: BaseException) -> str:
        """``exc`` as one of ``failures``: "parameter server 0 (global rank 3) failed: ValueError: ..."."""
        text = str(exc)
        if text.startswith(self.name):
            text = text[len(self.name):].lstrip(": ")
        return f"{self.name} failed: {type(exc).__name__}: {text}"

    def _fail(self, exc: Exception) -> None:
        """This server failed: every rank hears of it (ABORT replies, the verdict); ``run`` raises it at the end."""
        self.errors.append(exc)
        self._add_failure(self._describe(exc))

    def _handle(self, worker: int) -> None:
        kind, version, length, flag = (int(v) for v in self.headers[worker])
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
            if self.failure is not None:
                self._reply_abort(worker)
            elif flag:  # it wants the final parameters
                self.finals.append(worker)
            else:
                self._reply_ok(worker, bare=True)
            self._on_close(worker)
        elif kind == FAILED:
            text = np.zeros(length, dtype=np.uint8)
            if length:
                recv(text, worker, TAG_REASON, self.comm)
            self.open.discard(worker)
            if self.failure is None or not flag:  # flag: it passes on a server's ABORT, which the verdict brings too
                self._add_failure(f"worker {worker} (global rank {self._global(worker)}) failed: "
                                  f"{text.tobytes().decode('utf-8', 'replace')}")
            self._on_close(worker)
        else:
            self._post(worker)  # the header came whole: the worker's next request comes next
            raise ParameterServerError(f"{self.name}: unknown request kind {kind} from worker {worker} (global rank "
                                       f"{self._global(worker)})")

    def _loop(self, held: HeldInterrupt) -> None:
        timeout = self.comm.effective_timeout()
        delay, last = POLL_MIN, time.monotonic()
        while self.open:
            held.check()  # a Ctrl-C raises here, where no message is half sent (see interrupts)
            progressed = False
            for w in range(self.workers):
                work = self.requests[w]
                if work is not None and work.is_completed():
                    self.requests[w] = None
                    progressed = True
                    try:
                        self._handle(w)
                    except GROUP_FAILURES:
                        raise  # the messages stopped coming through: run() leaves
                    except Exception as exc:  # noqa: BLE001 - every rank hears of it, run() raises it at the end
                        self._fail(exc)
            self._reap_sends()
            now = time.monotonic()
            if progressed:
                delay, last = POLL_MIN, now
                continue
            if timeout is not None and now - last > timeout:
                self._give_up(timeout)
                delay, last = POLL_MIN, now
                continue
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    def _give_up(self, timeout: float) -> None:
        """Nothing came for ``timeout`` s: stop waiting for the open workers that are not waiting for a reply (a
        ``CollectiveTimeoutError`` naming them, raised at the end) and answer those that are with ABORT."""
        silent = sorted(w for w in self.open if w not in self.deferred)
        self.open.difference_update(silent)
        self._fail(CollectiveTimeoutError(
            f"{self.name} timed out after {timeout:g} s waiting for requests of open workers (those not waiting for "
            f"a reply themselves); missing ranks: {[self._global(w) for w in silent]}"))
        for w in silent:  # their next request may come after this server has left: the verdict waits for it
            self._reply_abort(w, last=True)

    def run(self, failure: Optional[str] = None) -> None:
        """Serve until every worker has sent DONE or FAILED (or was given up after the time limit); raise if the
        run failed: this server's first own error, noting the rest, else ``PeerFailedError`` saying why.

        ``failure``: this server failed before it served (``ParameterServer.abort``); then only what else failed
        is raised.
        """
        for w in range(self.workers):
            self._post(w)
        if failure is not None:
            self._add_failure(failure)
        given = list(self.failures)
        ended: Optional[Exception] = None
        try:
            with HeldInterrupt() as held:
                self._loop(held)
            # Every worker has stopped; the servers tell each other how their run ended before
            # anything else (see the note on shutdown): a server whose optimizer failed on the
            # last update would otherwise leave the others waiting for its slices.
            self._send_verdict()
            for text in self._receive_verdicts():
                self._add_failure(text)  # the first: the final pulls are answered with ABORT
            if self.failure is None:
                self._finish()
            timeout = self.comm.effective_timeout()
            for work, _ in self.sends:
                work.wait(timeout)
            self.sends = []
        except Exception as exc:  # noqa: BLE001 - told to whom it can be, then raised (below, not inside this handler)
            ended = exc
        except BaseException as exc:  # a KeyboardInterrupt, a SystemExit: every rank hears of it, then it goes on
            self._say_goodbye(f"{self.name} left: {type(exc).__name__}{': ' if str(exc) else ''}{exc}")
            if self.failures[1:] or self.errors:
                noted(exc, f"{self.name} stopped the run: {self.failure}")
            raise
        if ended is not None:
            self._leave(ended)
        if self.errors:
            self._raise_own()
        if self.failures != given:
            raise PeerFailedError(f"{self.name} stopped: {self.failure}")

    def _leave(self, exc: Exception) -> NoReturn:
        """The messages stopped coming through (a time limit, a dead peer, a failed send): tell whom this server
        still can (its last word to every open worker, its verdict to the other servers), then raise."""
        self.errors.append(exc)
        self._say_goodbye(self._describe(exc))
        self._raise_own()

    def _say_goodbye(self, text: str) -> None:
        """Leave before every worker has stopped: record ``text``, send every worker still open this server's last
        word (see the note) and the other servers its verdict."""
        self.leaving = True
        for tell in (lambda: self._add_failure(text), self._send_verdict, self._tell_open_workers):
            try:
                tell()
            except Exception:  # noqa: BLE001 - as far as it goes: a dead peer's revoked communicator tells all
                pass

    def _tell_open_workers(self) -> None:
        """This server's last word to every worker still open that has not had it."""
        for w in sorted(self.open):
            self._reply_abort(w)  # its last word: none is sent twice

    def _raise_own(self) -> NoReturn:
        """Raise this server's first error, with every failure of the run as a note when there is more to say."""
        first = self.errors[0]
        if self.failures != [self._describe(first)]:
            noted(first, f"{self.name} stopped the run: {self.failure}")
        raise first

    def _send_verdict(self) -> None:
        """Send every other server OK, or ABORT with this server's failures ("\\0"-separated); once."""
        if self.verdict_sent:
            return
        self.verdict_sent = True
        ps = self.ps
        text = encode_reason("\0".join(self.failures))
        header = np.array([ABORT if self.failures else OK, text.size, 0, 0], dtype=np.int64)
        for s in range(ps.num_servers):
            if s != self.index:
                self._isend(header, ps.server_rank(s), TAG_VERDICT)
                if text.size:
                    self._isend(text, ps.server_rank(s), TAG_REASON)

    def _receive_verdicts(self) -> List[str]:
        """Every other server's verdict (they send theirs as this one does): the failures they report, in server
        order."""
        ps = self.ps
        timeout = self.comm.effective_timeout()
        failed = []
        for s in range(ps.num_servers):
            if s == self.index:
                continue
            src = ps.server_rank(s)
            theirs = np.zeros(HEADER, dtype=np.int64)
            irecv(theirs, src, TAG_VERDICT, self.comm).wait(math.inf if timeout is None else timeout)
            if int(theirs[0]) == OK:
                continue
            reason = np.zeros(int(theirs[1]), dtype=np.uint8)
            if reason.size:
                recv(reason, src, TAG_REASON, self.comm)
            texts = [t for t in reason.tobytes().decode("utf-8", "replace").split("\0") if t]
            failed.extend(texts or [f"parameter server {s} (global rank {ps.group.ranks[src]}) failed"])
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
