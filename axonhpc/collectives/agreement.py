"""Every collective is compared across the ranks before data is used, with no flag set.

[Note: always-on agreement]
Ranks that disagree about a collective must never get numbers: MPI and the shared-memory engine would
reduce garbage or wait forever. So each call carries a descriptor (``_shm.describe``), compared as cheaply
as the transport allows:

- **On one node** the engine compares it inside the call ([Note: agreement on every call] in ``_shm.pyx``).
  A call the engine does not carry first takes one data-free engine step marked "elsewhere", so a rank
  going to MPI while another goes to the engine is caught too.
- **Across nodes** one fixed-length MAX all-reduce of ``[d, -d]`` comes first: the results are ``d`` and
  ``-d`` exactly when every rank sent ``d``. Its latency is saved back on small all-reduces (``carried``).

[Note: a refusal on one rank]
A check that fails on one rank alone must not leave the others waiting. So the refusing rank still takes
part in the agreement step with a "refused" descriptor; the others raise ``CollectiveRefusedError`` naming
it while it raises its own error. A call that passes its checks pays nothing for this. On any other
difference every rank raises the same ``CollectiveMismatchError`` naming every rank's call.

[Note: blocking and nonblocking twins]
MPI never matches a blocking collective with a nonblocking one: ``MPI_Allreduce`` on one rank and
``MPI_Iallreduce`` on another wait forever, under MPICH and Open MPI alike (measured here, 3 to 10^5
elements). A rank makes a call that MPI carries nonblocking when it was asked with ``async_op=True``, or
when it waits under a timeout, and ranks may well differ there: one overlaps a reduction with its work,
another waits for it. So the check says how each rank will make the call, and where one makes it
nonblocking every rank does (a blocking caller then waits at once), the rest of the call unchanged:

- the MPI check reduces a ninth word with the others, 1 from a rank that goes nonblocking;
- in the node's engine the way is a bit of the descriptor that the comparison leaves out and ORs
  (``_shm.Engine.agree``).

The check's own MPI call is therefore nonblocking on every rank (``MPI_Iallreduce`` of 72 bytes: as fast
as the blocking one under MPICH here, about 1 us slower under Open MPI), and so is the fused call of
``carried``, which is the check too: with the group's timeout on some ranks only, a blocking fused call
on the others never met the timed ranks' polled one.
"""
from __future__ import annotations

import threading
import time
from threading import current_thread, get_ident
from typing import Any, Callable, Dict, List, NoReturn, Optional, Set, Tuple

import numpy as np

from .._dtypes import is_cupy_array
from .._ext import _shm
from ..backends import base as backend_base
from ..backends.base import ReduceOp, Work
from ..errors import CollectiveMismatchError, CollectiveStallError, CollectiveTimeoutError, everywhere, replacing
from ..settings import settings
from . import carried, engine_calls, fingerprint, flight, shm_path, watch
from .group_state import state_of

Desc = Tuple[int, int, int, int]
EngineMismatch = _shm.EngineMismatch

# What ``check`` and ``compare`` return: how the call goes on.
AS_PLANNED = 0  # as the rank would make it
CARRIED = 1  # the check carried it (``carried``): nothing is left to do
NONBLOCKING = 2  # another rank makes it nonblocking: make it nonblocking too, then wait ([Note: blocking and nonblocking twins])


def describe(op: str, x: Any = None, reduce: Optional[str] = None, root: Optional[int] = None,
             elsewhere: bool = False) -> Desc:
    """The descriptor of a call of collective ``op`` on the caller's array ``x`` (None: a call without one)."""
    root = -1 if root is None else root
    if x is None:
        return _shm.describe(op, None, (), reduce, root, False, elsewhere)
    return _shm.describe(op, x.dtype, x.shape, reduce, root, is_cupy_array(x), elsewhere)


def node_engine(pg: Any) -> Optional[Any]:
    """The group's shared-memory engine when it has one (one node, shared memory on), with the group's timeout."""
    if settings.shm_collectives == "off":
        return None
    engine = shm_path.engine_for(pg.backend, settings.shm_slot_bytes, settings.shm_slots, pg.on_one_node)
    if engine is not None:
        shm_path.set_timeout(engine, pg)
    return engine


def check(pg: Any, seq: int, op: str, x: Any = None, reduce: Optional[str] = None, root: Optional[int] = None,
          arrivals: Any = None, label: Any = None, engine: Any = None, carry: Optional[ReduceOp] = None,
          nonblocking: bool = False) -> int:
    """Compare a call the shared-memory engine will not carry, before it starts; how it goes on: ``AS_PLANNED``,
    ``CARRIED`` (it carried ``carry``) or ``NONBLOCKING``. ``nonblocking``: this rank makes the call nonblocking.

    Raises:
        CollectiveMismatchError: on every rank, if any rank's call differs.
        CollectiveTimeoutError: a rank did not come within the group's timeout.
    """
    return compare(pg, seq, op, lambda elsewhere: describe(op, x, reduce, root, elsewhere),
                   lambda: refuse(pg, seq, op, x, reduce, root), arrivals, label, engine,
                   None if carry is None else (x, carry), nonblocking)


def compare(pg: Any, seq: int, op: str, desc_of: Callable[[bool], Desc], mismatch: Callable[[], None],
            arrivals: Any = None, label: Any = None, engine: Any = None,
            carry: Optional[Tuple[Any, ReduceOp]] = None, nonblocking: bool = False) -> int:
    """``check`` for any descriptor: ``desc_of(elsewhere)`` gives this rank's, ``mismatch()`` raises on a difference."""
    if pg.size == 1 or not settings.check_collectives:
        return AS_PLANNED
    if engine is None:
        engine = node_engine(pg)
    if engine:
        try:
            if engine_calls.run(engine, "agree", desc_of(True), nonblocking) and not nonblocking:
                return NONBLOCKING
        except EngineMismatch as exc:
            explain_mismatch(mismatch, exc)
        except CollectiveStallError:
            raise  # the watchdog's verdict, which says all there is to say
        except CollectiveTimeoutError as exc:
            if arrivals is None:
                raise replacing(shm_path.timed_out(exc, engine, pg, op), exc, settings.debug)
            raise replacing(watch.engine_timed_out(exc, pg.effective_timeout(), label, arrivals, pg), exc,
                            settings.debug)
        return AS_PLANNED
    return _mpi_compare(pg, seq, op, desc_of(False), mismatch, arrivals, label, carry, nonblocking=nonblocking)


def check_all_reduce(pg: Any, seq: int, x: np.ndarray, reduce: str, op: ReduceOp) -> int:
    """``check`` of the fast path's blocking in-place all-reduce over MPI (the group has no engine)."""
    if pg.size == 1 or not settings.check_collectives:
        return AS_PLANNED
    predictor = _mpi_check(pg)[3]
    done, tried = carried.quick(pg, predictor, x, op)
    if done:
        return CARRIED
    mismatch = lambda: refuse(pg, seq, "all_reduce", x, reduce, None)  # noqa: E731
    desc = describe("all_reduce", x, reduce)
    if tried is None:
        return _mpi_compare(pg, seq, "all_reduce", desc, mismatch, carry=(x, op))
    return _mpi_compare(pg, seq, "all_reduce", desc, mismatch, tried=tried)


_UNTRIED = object()


def _timeout_label(pg: Any, seq: int, op: str, timeout: Optional[float], label: Any = None) -> Any:
    """What a timed-out check names: the caller's ``label``, else the call; nothing without a timeout (no
    text is made on the untimed path)."""
    if label is not None or timeout is None:
        return label
    return f"{fingerprint.call_name(op, seq, pg)} (agreement check)"


def _mpi_compare(pg: Any, seq: int, op: str, desc: Desc, mismatch: Callable[[], None], arrivals: Any = None,
                 label: Any = None, carry: Optional[Tuple[Any, ReduceOp]] = None, tried: Any = _UNTRIED,
                 nonblocking: bool = False) -> int:
    """``compare`` over MPI: the fused call the group expects (``carried``), unless ``tried`` says it was made
    (and did not carry the call), then the check of fixed length, with the ranks' ways of making the call."""
    words, reduce_max, host, predictor = _mpi_check(pg)
    timeout = pg.effective_timeout()
    what = _timeout_label(pg, seq, op, timeout, label)
    if tried is _UNTRIED:
        done, tried = carried.attempt(pg, predictor, desc, carry, timeout, what, arrivals)
        if done:
            return CARRIED
    _put(desc, words, nonblocking)
    if timeout is None:
        if backend_base.PROGRESS[0] is None:
            reduce_max()
        else:  # polled ([Note: calls waiting for their check, across groups])
            host.all_reduce(words, ReduceOp.MAX, True).wait()
    else:
        watch.wait(host.all_reduce(words, ReduceOp.MAX, True), timeout, what, arrivals, pg)
    if not _shm.words_agree(desc, words):
        predictor.forget()
        mismatch()
    predictor.record(desc, tried)
    return NONBLOCKING if words[_WAY] and not nonblocking else AS_PLANNED


_WAY = 2 * len(describe("barrier"))  # the MPI check's word after the descriptor and its negation: 1 if nonblocking


def _put(desc: Desc, words: np.ndarray, nonblocking: bool) -> None:
    """Fill the MPI check's ``words``: the descriptor, its negation, and this rank's way of making the call."""
    _shm.put_words(desc, words[:_WAY])
    words[_WAY] = 1 if nonblocking else 0


def explain_mismatch(mismatch: Callable[[], None], engine_error: BaseException) -> NoReturn:
    """The engine refused a call (``EngineMismatch``, its own words): raise what ``mismatch()`` raises in its
    place, the error every rank raises, without the engine's chained to it (debug mode keeps it)."""
    try:
        mismatch()
    except CollectiveMismatchError as error:
        raise replacing(error, engine_error, settings.debug)
    raise engine_error  # mismatch always raises; should it not, the engine's error stands


def start_check(pg: Any, seq: int, op: str, x: Any = None, reduce: Optional[str] = None,
                root: Optional[int] = None) -> Optional[Tuple[Work, Callable[[], None]]]:
    """The check of an asynchronous call: ``(work, verify)`` to finish later, or None once it is done.

    For host arrays only: a GPU call is checked before it is queued (see ``core.run_call``).
    """
    if pg.size == 1 or not settings.check_collectives:
        return None
    engine = node_engine(pg)
    if engine is not None:
        return _start_engine_check(pg, op, engine, describe(op, x, reduce, root, True),
                                   lambda: refuse(pg, seq, op, x, reduce, root))
    return _start_mpi_check(pg, describe(op, x, reduce, root), lambda: refuse(pg, seq, op, x, reduce, root))


class _EngineCheck(Work):
    """The engine's agreement step of an asynchronous call that MPI carries, queued on the group's engine and
    advanced by every wait of the thread ([Note: calls in flight in the engine] in engine_calls.py): the call
    returns at once, as over MPI, instead of waiting in the step for ranks that may be in other calls first."""

    def __init__(self, op: Any, engine: Any):
        super().__init__(None)
        self._op, self._engine = op, engine

    def _test(self) -> bool:
        if not self._op.done:
            engine_calls.progress()
        return self._op.done

    def _block(self, timeout: Optional[float]) -> bool:
        return engine_calls.wait_for(self._op, self._engine, timeout, check=False)


def _start_engine_check(pg: Any, op: str, engine: Any, desc: Desc,
                        mismatch: Callable[[], None]) -> Tuple[Work, Callable[[], None]]:
    """The engine's check of an asynchronous call, started: ``(work, verify)`` as ``_start_mpi_check``'s."""
    step = engine_calls.queue(engine, "agree", desc, True)

    def verify() -> None:
        try:
            step.result()
        except EngineMismatch as exc:
            explain_mismatch(mismatch, exc)
        except CollectiveStallError:
            raise  # the watchdog's verdict, which says all there is to say
        except CollectiveTimeoutError as exc:
            raise replacing(shm_path.timed_out(exc, engine, pg, op), exc, settings.debug)

    return _EngineCheck(step, engine), verify


def _start_mpi_check(pg: Any, desc: Desc, mismatch: Callable[[], None]) -> Tuple[Work, Callable[[], None]]:
    """The MPI check of an asynchronous call, started: ``(work, verify)``; ``verify()`` calls ``mismatch()`` on a
    difference. A fused call the group expects is started first, with a "no" (``carried.vote_no``): like the
    check, it is not waited for here (the ranks that make the call blocking may be in other calls first)."""
    predictor = _mpi_check(pg)[3]
    fused, tried = carried.vote_no(pg, predictor)
    words = np.zeros(_WAY + 1, dtype=np.int64)  # its own: several asynchronous checks may be in flight
    _put(desc, words, True)

    def verify() -> None:
        if not _shm.words_agree(desc, words):
            predictor.forget()
            mismatch()
        predictor.record(desc, tried)

    check = pg.backend.host_side().all_reduce(words, ReduceOp.MAX, True)
    return (check if fused is None else _Both(fused, check)), verify


class _Both(Work):
    """Two operations in flight, done when both are (an asynchronous call's fused vote and its check)."""

    def __init__(self, first: Work, second: Work):
        super().__init__(None)
        self._works = (first, second)

    def _test(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def _block(self, timeout: Optional[float]) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for work in self._works:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not work._block(left):
                return False
            work._finish()
        return True


class CheckedWork(Work):
    """An asynchronous collective issued once its (nonblocking) agreement check is done.

    MPI needs every rank to start the group's collectives in one order, so the next collective first issues
    every call still waiting for its check (``flush``), whatever order the waits come in.
    """

    def __init__(self, pg: Any, pending: Tuple[Work, Callable[[], None]], issue: Callable[[], Work]):
        super().__init__()
        self._check, self._verify = pending
        self._issue = issue
        self._inner: Optional[Work] = None
        self._failed: Optional[BaseException] = None  # why the call was never issued: every later wait raises it
        state = state_of(pg)
        self._waiting = state.unissued
        if not self._waiting:
            with _PENDING_LOCK:
                _forget_done()
                _PENDING.append((state, current_thread(), pg.world))
                backend_base.PROGRESS[0] = progress
        self._waiting.append(self)

    def _start(self) -> None:
        self._waiting.remove(self)
        if not self._waiting:
            _prune()
        me, group = get_ident(), id(self._waiting)
        starting = _STARTING.setdefault(me, set())
        starting.add(group)  # the hook must not issue this group's next call meanwhile: it would overtake this one
        try:
            self._check.wait()
            self._verify()  # raises CollectiveMismatchError on every rank on a difference
            self._inner = self._issue()
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            starting.discard(group)
            if not starting:
                _STARTING.pop(me, None)

    def _test(self) -> bool:
        if self._inner is None:
            if self._failed is not None:
                raise self._failed
            if not self._check._test():
                return False
            flush_before(self)
        return self._inner._test()

    def _block(self, timeout: Optional[float]) -> bool:
        start = time.monotonic()
        if self._inner is None:
            if self._failed is not None:
                raise self._failed
            if not self._check._block(timeout):
                return False
            flush_before(self)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self._inner._block(left)

    def _timeout_error(self, timeout: float) -> Exception:
        # The step waited for (the check, or the call once issued) says what the backend knows of the missing
        # ranks; the call is named by its label, with the array's dtype and shape.
        step = self._inner or self._check
        step.label = _call_text(self.label)
        return step._timeout_error(timeout)

    def _finish(self) -> None:
        if not self._finished:
            self._inner._finish()
            self._result = self._inner._result
            super()._finish()


def _call_text(label: Any) -> str:
    """A call as a timeout names it: the label (call, number, group) and the array's dtype and shape, if any."""
    x = getattr(label, "call", (None,))[0]
    if x is None or not hasattr(x, "dtype"):
        return str(label)
    return f"{label} ({x.dtype}{' on device' if is_cupy_array(x) else ''}, shape {tuple(x.shape)})"


def flush(pg: Any) -> None:
    """Issue every asynchronous call of the group still waiting for its check (before any other collective); raise
    the error of one the ranks disagreed about, as the node's engine found it too (``engine_calls.raise_refused``)."""
    state = pg.collective_state
    if state is not None:
        if state.unissued:
            state.issue_unissued()
        if state.in_engine:
            engine_calls.raise_refused(state.in_engine)


# [Note: calls waiting for their check, across groups]
# A nonblocking call is issued once its check is done. Its own group's next call issues it first
# (``flush``), but a rank can go on to a blocking call on another group while a rank that made the call
# blocking waits in it: over MPI each would wait for the other for good. So while any call waits
# unissued (``_PENDING``), every wait polls instead of blocking inside MPI and calls ``progress`` each
# round (``backend_base.PROGRESS``), which issues the calls whose check is done, in their groups' order;
# a blocking call over MPI on another group is made nonblocking (``still_waiting_elsewhere``, after one
# round of ``progress``: mostly the checks are back by then and nothing changes), which its check tells the
# other ranks, and the fast path leaves it to the general one. The node's engine runs a call and its check
# at once and waits inside C, so a call it carries is left as it is.

# The GroupStates with calls waiting for their check, each with the thread that made them and their world
# (the thread ranks of ``run_local`` share this process: each issues only its own), oldest first. A call
# never waited for whose check never comes back (its world ended first) stays, and harms no other world.
_PENDING: List[Tuple[Any, threading.Thread, Any]] = []
_PENDING_LOCK = threading.Lock()
# Thread ident -> the groups (their lists of waiting calls, by id) whose next call that thread is issuing
# (``CheckedWork._start``): ``progress`` issues none of those groups' calls meanwhile, which would overtake it,
# and goes on issuing the other groups' ready calls, which the ranks that made them blocking may wait in.
_STARTING: Dict[int, Set[int]] = {}


def _forget_done() -> None:
    """Forget the groups with no call waiting any more, and those of threads that ended (under the lock)."""
    _PENDING[:] = [entry for entry in _PENDING if entry[0].unissued and entry[1].is_alive()]


def _prune() -> None:
    """``_forget_done``, and no more polling once nothing waits (but the engines' calls in flight)."""
    with _PENDING_LOCK:
        _forget_done()
        if not _PENDING:
            backend_base.PROGRESS[0] = engine_calls.progress if engine_calls.BUSY else None


def elsewhere(pg: Any, own_too: bool = False) -> bool:
    """This thread made a call of another group of ``pg``'s world (or of ``pg`` too, with ``own_too``: a
    message is not ordered with the group's collectives) that waits unissued for its check."""
    me, own, world = current_thread(), getattr(pg, "collective_state", None), getattr(pg, "world", None)
    return any(thread is me and of is world and (own_too or state is not own)
               for state, thread, of in list(_PENDING))


def still_waiting_elsewhere(pg: Any, own_too: bool = False) -> bool:
    """``elsewhere``, after one round of ``progress``: usually the calls' checks are back by the next call, and
    it may take its fast path."""
    if not elsewhere(pg, own_too):
        return False
    progress()
    return bool(_PENDING) and elsewhere(pg, own_too)


def progress() -> None:
    """Issue this thread's calls waiting for their check whose check is done, oldest first in each group (a
    wait's hook)."""
    if engine_calls.BUSY:
        engine_calls.progress()
    starting = _STARTING.get(get_ident(), ())
    me = current_thread()
    for state, thread, _ in list(_PENDING):
        if thread is not me or id(state.unissued) in starting:
            continue
        waiting = state.unissued
        while waiting:
            head = waiting[0]
            try:
                if not head._check._test():
                    break
            except Exception as exc:  # noqa: BLE001 - its check failed: never issued, its wait raises this
                waiting.remove(head)
                head._failed = exc
                if not waiting:
                    _prune()
                break
            try:
                head._start()
            except Exception:  # noqa: BLE001 - kept by the call (``_failed``), raised where it is waited for
                break


def flush_before(work: "CheckedWork") -> None:
    """Issue ``work`` and every call of its group started before it, in the order they were started."""
    while work._inner is None:
        if work._failed is not None:
            raise work._failed
        work._waiting[0]._start()


def _mpi_check(pg: Any) -> Tuple[np.ndarray, Any, Any, carried.Predictor]:
    """The group's MPI check, made once: its buffer (nine int64), a MAX all-reduce of it (a nonblocking MPI call,
    waited for), the backend, and the guess of the next call (``carried``)."""
    state = state_of(pg)
    cached = state.check
    if cached is None:
        host = pg.backend.host_side()  # a host/device dispatch backend: its MPI side
        words = np.zeros(_WAY + 1, dtype=np.int64)
        cached = state.check = (words, host.reducer(words, ReduceOp.MAX, nonblocking=True), host,
                                carried.Predictor(pg.size))
    return cached


def refuse_locally(pg: Any, op: str, problem: BaseException, nonblocking: bool = False) -> NoReturn:
    """Tell the group this rank refused ``op`` (with a nonblocking step if the others take one), then raise ``problem``."""
    flush(pg)
    entry = flight.record(pg, op, None, None, None, "refused")
    seq = pg.seq
    reason = f"{type(problem).__name__}: {problem}"
    try:
        if pg.debug_enabled():  # the others' debug exchange, made before their call is numbered
            fingerprint.check(pg, op, seq=seq, refused=reason)
    except CollectiveMismatchError:
        raise problem from None
    pg.seq += 1
    timeout = pg.effective_timeout()
    checked = pg.size > 1 and settings.check_collectives
    label = f"{fingerprint.call_name(op, seq, pg)} (telling the group of a refusal)"
    # The others announce their call under a timeout and wait for this rank's notice once their check is done:
    # it is sent as for the call it stands for (it is in their check; with no check it is not in the call).
    arrivals = pg.backend.announce(seq, op) if checked and timeout is not None else None
    try:
        def mismatch() -> None:
            fingerprint.check(pg, op, seq=seq, refused=reason)

        if nonblocking and node_engine(pg) is None and checked:
            work, verify = _start_mpi_check(pg, describe("refused"), mismatch)
            watch.wait(work, timeout, label, arrivals, pg)
            verify()
        else:
            compare(pg, seq, op, lambda elsewhere: describe("refused", elsewhere=elsewhere), mismatch, arrivals,
                    label)
        heard = True
    except CollectiveMismatchError:
        heard = True  # the others raise CollectiveRefusedError naming this rank
    except CollectiveTimeoutError:
        heard = False  # nobody came to hear it
    if heard and arrivals is not None:
        watch.drain(arrivals, label)  # at once where the check took them in already
    if entry is not None:
        entry[flight.DONE] = True
    raise problem


def refuse(pg: Any, seq: int, op: str, x: Any, reduce: Optional[str], root: Optional[int]) -> None:
    """The ranks disagreed about call ``seq``: raise the same ``CollectiveMismatchError`` on every rank."""
    fingerprint.check(pg, op, x, reduce, root, seq=seq)
    raise everywhere(CollectiveMismatchError(
        f"collective mismatch on group {pg.name}: every rank called {fingerprint.describe_call(op, x, reduce, root)} "
        f"(call #{seq}), but not in the same way: some ranks ran it through the node's shared memory and others "
        f"through MPI (the AXONHPC_SHM_* settings differ between the ranks), or an array in a shared window "
        f"lies at another offset on some ranks"), pg.ranks)


__all__ = ["AS_PLANNED", "CARRIED", "NONBLOCKING", "describe", "check", "check_all_reduce", "compare", "explain_mismatch", "start_check", "CheckedWork", "refuse", "refuse_locally",
           "node_engine",
           "EngineMismatch"]
