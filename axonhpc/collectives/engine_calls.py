"""Nonblocking calls of the node's shared-memory engines: in flight until done, advanced by every wait.

[Note: calls in flight in the engine]
A call the engine carries is a state machine ([Note: a call as a state machine] in ``shm_engine.h``).
Made blocking, it runs to its end inside C. Made with ``async_op=True`` it is queued on its engine
(``Engine.progress`` runs an engine's calls one after another, in the order they were made, which is the
same on every rank) and returns a ``EngineWork`` at once, having gone as far as it could without waiting.
From then until every such call is done, this thread advances all of them, in every engine, whenever it
waits: its own ``wait()``s, its later engine calls (queued too, then waited for, so a blocking call never
waits inside C while another waits for this rank), and every wait over MPI (``backend_base.PROGRESS``;
a blocking MPI call is then made nonblocking and polled, which its check tells the other ranks, as in
[Note: calls waiting for their check, across groups]). So two groups of one node may be entered in
different orders by asynchronous calls, as MPI allows, and both complete.

Nothing advances a call while the thread computes: the copies are the calling rank's own work either way,
and there is no network card to overlap them with.
"""
from __future__ import annotations

import os
import threading
import time
from threading import get_ident
from typing import Any, List, Optional, Tuple

from ..backends import base as backend_base
from ..backends import mpi_work
from ..backends.base import Work
from ..errors import CollectiveMismatchError, CollectiveStallError, CollectiveTimeoutError, replacing
from ..settings import settings
from . import watchdog

# The engines with calls in flight, each with the ident of the thread that made them (a thread advances only its
# own).
BUSY: List[Tuple[Any, int]] = []
_LOCK = threading.Lock()

SPINS, YIELDS = 200, 2000  # polls of a wait before it yields the core, and before it sleeps (as the engine's)
MAX_SLEEP = 2e-4  # seconds: the longest nap between polls, as the engine's own waits


def busy_here() -> bool:
    """True if this thread has calls in flight in an engine."""
    me = get_ident()
    return any(thread == me for _, thread in list(BUSY))


def queue(engine: Any, method: str, *args: Any) -> Any:
    """Queue ``engine.method(*args)`` and start it: its ``EngineOp``."""
    op = getattr(engine, method)(*args, later=True)
    me = get_ident()
    with _LOCK:
        if not any(e is engine for e, _ in BUSY):
            BUSY.append((engine, me))
        if backend_base.PROGRESS[0] is None:
            backend_base.PROGRESS[0] = progress
    progress(SPINS)  # it goes as far as it can at once (a small one often to its end) before the caller goes on
    return op


def progress(spins: int = 0) -> None:
    """Advance this thread's calls in flight in every engine as far as they go without waiting (``spins``: busy
    polls in each engine first, see ``Engine.progress``); conclude those that ended."""
    me = get_ident()
    # An engine the watchdog gave a verdict is out of step with the others for good: its calls are dropped (their
    # waits raise the verdict).
    idle = [entry for entry in list(BUSY)
            if entry[1] == me and (entry[0].verdict is not None or entry[0].progress(spins))]
    if idle:
        with _LOCK:
            for entry in idle:
                if entry in BUSY:
                    BUSY.remove(entry)
            if not BUSY:
                if backend_base.PROGRESS[0] is progress:
                    backend_base.PROGRESS[0] = None
    if _ENDING:
        _conclude_ended()


def run(engine: Any, method: str, *args: Any) -> Any:
    """``engine.method(*args)`` as a blocking call: at once, or queued and waited for while calls are in flight
    (in an engine; calls waiting to be issued, [Note: calls waiting for their check, across groups]; or this
    thread's MPI requests, [Note: MPI requests in flight while the node's engine waits]).

    Returns what the method returns (``agree``'s answer; None for the others).
    """
    if not BUSY and backend_base.PROGRESS[0] is None and not (mpi_work.IN_FLIGHT and mpi_work.in_flight_here()):
        return getattr(engine, method)(*args)
    op = queue(engine, method, *args)
    wait_for(op, engine, None)
    return op.seen if method == "agree" else None


def wait_for(op: Any, engine: Any, timeout: Optional[float], check: bool = True) -> bool:
    """Advance every call of this thread until ``op`` is done, then raise what it ended with (unless not
    ``check``).

    ``timeout``: seconds, after which False is returned; None: the engine's own timeout (none where it is 0),
    after which ``CollectiveTimeoutError`` names the ranks it waits for, as a blocking call's wait does.

    Raises:
        The watchdog's verdict, once it gave one to the engine (``Engine.abandon``).
    """
    if not _poll(lambda: op.done, op, engine, timeout):
        return False
    if check:
        op.result()
    return True


def forget_all() -> None:
    """Forget every call in flight, without waiting (``axonhpc.elastic``: their world lost a rank, its windows are
    abandoned); their waits raise the watchdog's verdict or wait no more than a group's timeout."""
    with _LOCK:
        BUSY.clear()
        _ENDING.clear()
        if backend_base.PROGRESS[0] is progress:
            backend_base.PROGRESS[0] = None


def _wait_noted(work: "EngineWork", done: Any) -> None:
    """``_poll`` until ``done()`` for ``work``'s call, seen by the watchdog as a wait in that call (a dead peer or a
    deadlock gets its verdict, which the engine raises)."""
    label = work.label
    pg = getattr(label, "group", None)
    key = watchdog.blocking(pg, getattr(label, "entry", None), label) if pg is not None else None
    ident = get_ident()
    mine = ident not in watchdog.engines
    if mine:
        watchdog.engines[ident] = work._engine
    try:
        _poll(done, work._op, work._engine, None)
    finally:
        if mine:
            watchdog.engines.pop(ident, None)
        watchdog.unblocked(key)


def _poll(done: Any, op: Any, engine: Any, timeout: Optional[float]) -> bool:
    """Advance this thread's calls (and MPI's waiting for their check) until ``done()``, waiting for ``op`` of
    ``engine``; see ``wait_for``."""
    start = time.monotonic()
    polls = 0
    nap = 2e-6
    while True:
        progress(SPINS if polls < YIELDS else 0)
        hook = backend_base.PROGRESS[0]
        if hook is not None and hook is not progress:
            hook()  # MPI's calls waiting for their check (``agreement.progress``)
        if mpi_work.IN_FLIGHT:
            mpi_work.advance_in_flight()  # [Note: MPI requests in flight while the node's engine waits]
        if done():
            return True
        verdict = engine.verdict
        if verdict is not None:
            raise verdict
        polls += 1
        if polls & 63 == 0:
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                return False
            if timeout is None and engine.timeout > 0 and waited >= engine.timeout:
                raise _lagging_error(op, f"shared-memory {op.what}", engine.timeout, "")
        if polls < SPINS:
            continue
        if polls < YIELDS:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(nap * 1.25, MAX_SLEEP)


def _lagging_error(op: Any, what: str, seconds: float, where: str) -> CollectiveTimeoutError:
    """``what`` timed out after ``seconds`` waiting for ``op``: the error, naming the ranks it waits for (``missing``:
    group ranks, as the engine's own timeout names them)."""
    missing = op.lagging()
    error = CollectiveTimeoutError(f"{what} timed out after {seconds:g} s{where}; missing ranks (of this node's "
                                   f"group): {missing}")
    error.missing = missing
    return error


class EngineWork(Work):
    """An asynchronous collective in flight in the node's engine (see the module note).

    ``translate(error)``: the error to raise for the engine's own (its timeout, told in the group's terms).
    A disagreement of the ranks about the call is explained, on every rank, by its label's ``refuse``: as soon as
    a wait of this thread finds it (``progress``), since the other ranks may be explaining it already.
    """

    def __init__(self, op: Any, engine: Any, translate: Any, result: Any = None, group_calls: Optional[list] = None):
        super().__init__(result)
        self._op, self._engine, self._translate = op, engine, translate
        self._concluded = False
        self._failed: Optional[BaseException] = None  # what the call ended with: every later wait raises it
        # The group's calls that may still be refused (``GroupState.in_engine``): its next call waits for the check
        # of this one first (``raise_refused``), as over MPI, so a refused call is raised before anything else is
        # sent on the group and every rank stays in step.
        self._group_calls = group_calls if group_calls is not None else []
        self._group_calls.append(self)
        with _LOCK:
            _ENDING.append((self, get_ident()))

    def _test(self) -> bool:
        if not self._concluded:
            progress()
            if not self._op.done:
                return False
            self._conclude()
        self._raise_failed()
        return True

    def _block(self, timeout: Optional[float]) -> bool:
        if not self._concluded and self._failed is None and not self._op.done:
            ident = get_ident()
            watchdog.engines[ident] = self._engine  # the engine its verdict goes to (an array's window has its own)
            try:
                if not wait_for(self._op, self._engine, timeout, check=False):
                    return False
            except Exception as exc:  # noqa: BLE001 - a timeout or a verdict, kept for every later wait
                self._forget()
                self._fail(exc)
            finally:
                watchdog.engines.pop(ident, None)
        self._conclude()
        self._raise_failed()
        return True

    def labelled(self) -> None:
        """``core.run_call`` named the call: if it ended already (refused on its way in), conclude it now, so the
        other ranks, which may be explaining the refusal, are not left waiting while this rank goes on."""
        if self._op.done:
            self._conclude()

    def _raise_failed(self) -> None:
        """Raise what the call ended with, if anything: its group's next call need not any more."""
        if self._failed is not None:
            self._forget()
            raise self._failed

    def _forget(self) -> None:
        if self in self._group_calls:
            self._group_calls.remove(self)

    def _conclude(self) -> None:
        """The call is done: keep what it ended with, a mismatch explained with the other ranks (once)."""
        if self._concluded:
            return
        self._concluded = True
        with _LOCK:
            _ENDING[:] = [entry for entry in _ENDING if entry[0] is not self]
        try:
            self._op.result()
        except Exception as exc:  # noqa: BLE001 - kept for every wait
            try:
                self._fail(exc)
            except Exception:  # noqa: BLE001 - raised by the wait
                pass
        if self._failed is None:
            self._forget()

    def _fail(self, exc: Exception) -> None:
        """Keep ``exc`` in the call's terms (a mismatch as every rank's ``CollectiveMismatchError``, a timeout with
        the group's ranks) for every later wait, and raise it."""
        told: BaseException = exc
        try:
            if isinstance(exc, CollectiveMismatchError) and hasattr(self.label, "refuse"):
                self.label.refuse()  # raises the same error on every rank
            elif isinstance(exc, CollectiveTimeoutError) and not isinstance(exc, CollectiveStallError):
                told = replacing(self._translate(exc), exc, settings.debug)
        except CollectiveMismatchError as error:
            told = replacing(error, exc, settings.debug)
        if not isinstance(told, CollectiveStallError):  # a verdict names the call it ended (watchdog)
            self._failed = told
        raise told

    def _timeout_error(self, timeout: float) -> Exception:
        return _lagging_error(self._op, str(self.label), timeout, " in the shared-memory path")


def raise_refused(group_calls: List[EngineWork]) -> None:
    """Before a group's next call: wait until each of its calls in flight was found alike on every rank; raise the
    error of one that was not (``agreement.flush``). Each is raised here once, and by its own waits."""
    while group_calls:
        work = group_calls[0]
        op = work._op
        if not (op.checked or op.done):
            _wait_noted(work, lambda: op.checked or op.done)
        if op.done:
            work._conclude()
        if group_calls and group_calls[0] is work:
            del group_calls[0]
        if work._failed is not None:
            raise work._failed


# This thread's asynchronous calls not yet concluded, each with its thread: ``progress`` concludes those that
# ended (a refused one is explained with the other ranks at once: they may be waiting in the explanation).
_ENDING: List[Tuple[EngineWork, int]] = []
_CONCLUDING: set = set()  # threads concluding calls (an explanation's own waits progress, but conclude nothing)


def _conclude_ended() -> None:
    """Conclude this thread's calls that ended: one refused on the way is explained at once, with the other ranks."""
    me = get_ident()
    if me in _CONCLUDING:
        return
    _CONCLUDING.add(me)
    try:
        for work, thread in list(_ENDING):
            # A call is labelled as soon as its issue returns (``core.run_call``): until then it is left.
            if thread == me and work._op.done and hasattr(work.label, "refuse"):
                work._conclude()
    finally:
        _CONCLUDING.discard(me)


__all__ = ["BUSY", "busy_here", "queue", "progress", "run", "wait_for", "forget_all", "raise_refused",
           "EngineWork"]
