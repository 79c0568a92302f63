"""The watchdog: nothing hangs silently by default (a thread per process that watches the rank's collectives).

[Note: the watchdog]
A rank waiting in a collective its peers never join waits inside C (MPI or the shared-memory
engine), where none of its Python runs. So each process runs one daemon thread (started by
``ax.init()``, ``settings.watchdog`` on) that wakes four times a second and reads what the rank is
blocked in (``_blocked``: two dictionary stores around every blocking call).

- **A stall.** After ``settings.stall_report`` seconds (30) in one call, the rank writes its state
  (flight recorder, the call, the user's frame) to ``settings.flight_dir`` and asks every rank to do
  the same; each answers within a second, blocked or not ("rank 1 is not in a collective, at
  train.py:57"). The stalled ranks log one report: who waits where, who is elsewhere, who is silent.
- **A deadlock the waits prove.** A cycle of ranks, each blocked in a call the next has not entered
  and will not (two groups entered in different orders): every rank of it raises ``DeadlockError``.
- **A stall that does not end.** After ``settings.stall_timeout`` (10 minutes, as PyTorch's NCCL
  process groups) the rank raises ``CollectiveStallError`` with the report.

Raising needs the blocked call to return: the shared-memory engine is told to give up
(``Engine.abandon``); the general path with a timeout polls. A call blocked inside MPI cannot be
interrupted, so the watchdog logs the error and ends the job (``MPI_Abort``), except for a failed
peer in a fault-tolerant job, where it revokes the communicator (ULFM) so the call raises
``PeerFailedError`` on every rank and the survivors go on.

The same thread makes ``kill -USR1`` dump the flight recorder while the rank is blocked: the C
handler writes to a pipe the watchdog reads (``signal.set_wakeup_fd``); the Python handler would
run only once the blocked call returned.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ..backends import base as backend_base
from ..backends.failures import lost_while_waiting, node_peer_failed, revoke
from ..backends.shm import cached_engine
from ..errors import CollectiveStallError, DeadlockError, PeerFailedError
from ..observe.log import get_logger
from ..observe.tracing import write_json_atomic
from ..settings import settings
from . import flight

TICK = 0.25  # seconds between the watchdog's looks
ANSWER_WAIT = 2.0  # seconds a stalled rank gives the others to write their state before it reports
RECHECK = 5.0  # seconds between a stalled rank's later looks for a deadlock
# [Note: stall requests name their run]
# Jobs started from one folder share its flight folder (the default is the working directory's
# axonhpc-flight), and so may two jobs on one node. Each world's ranks draw one ``run_id`` together at
# init; the request and the answers carry it in their names, so a rank of another job never answers, and
# a stalled rank never reads another job's states (once a job's rank 1, blocked in its own group, answered
# another job's request and made that job's rank 0 raise a DeadlockError no wait of its own proved).
REQUEST = "stall-request-{run}.json"
STATE = "state-{run}-rank{rank:05d}.json"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# thread ident -> (group, flight entry or None, the call (its label)): what each thread is blocked in. The
# watchdog times each wait from when it first sees it (a quarter second late at most), so noting one costs
# the hot path a dictionary store and no clock (the fast path writes it inline).
_blocked: Dict[int, Tuple[Any, Optional[list], Any]] = {}
# thread -> the shared-memory engine it waits in, where that is not its group's own (an array's window)
engines: Dict[int, Any] = {}
get_ident = threading.get_ident


def blocking(pg: Any, entry: Optional[list], call: Any = None) -> Optional[int]:
    """Note that this thread now blocks in a collective of ``pg`` (its flight ``entry``; ``call``: its label);
    returns the key for ``unblocked``, None inside a call already noted (a blocking call's own wait)."""
    key = get_ident()
    if key in _blocked:
        return None
    if _dog is not None and key in _dog.verdicts:
        _dog.forget(key)  # a verdict ended this thread's earlier call; the process went on (axonhpc.elastic)
    _blocked[key] = (pg, entry, call)
    return key


def unblocked(key: Optional[int]) -> None:
    """The call noted by ``blocking`` returned (or raised)."""
    if key is not None:
        _blocked.pop(key, None)


def _observe_wait(work: Any) -> Optional[int]:
    """``Work.wait``'s hook: an asynchronous collective being waited for blocks like a blocking one."""
    label = getattr(work, "label", None)
    pg = getattr(label, "group", None)
    if pg is None:
        return None
    return blocking(pg, getattr(label, "entry", None), label)


def _call_text(pg: Any, entry: Optional[list], call: Any) -> str:
    if entry is not None:
        shape = entry[flight.SHAPE]
        what = f"{entry[flight.FIELDS.index('op')]} #{entry[flight.FIELDS.index('seq')]}"
        if entry[flight.DTYPE] is not None:
            what += f" {entry[flight.DTYPE]} {tuple(shape) if shape is not None else ''}".rstrip()
        return f"{what} on group {pg.name} {list(pg.ranks)}"
    return str(call) if call is not None else f"a collective on group {pg.name} {list(pg.ranks)}"


def user_location(thread_id: Optional[int] = None) -> str:
    """Where ``thread_id`` (default: the main thread) is in the user's code: its innermost frame outside axonhpc."""
    ident = threading.main_thread().ident if thread_id is None else thread_id
    frame = sys._current_frames().get(ident)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Watchdog(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="axonhpc-watchdog", daemon=True)
        self.reported: Dict[Tuple[int, float], float] = {}  # (thread, since) -> when its report is due
        self.first_seen: Dict[int, Tuple[Any, float]] = {}  # thread -> (the call it waits in, when first seen)
        self.answered = ""  # the last stall request this process wrote its state for
        self.next_request_look = 0.0
        self.verdicts: Dict[int, Exception] = {}  # thread ident -> the error its blocked call is to raise
        self.verdict_of: Dict[int, Any] = {}  # thread ident -> which call that verdict ended (see _since)
        self.wakeup: Optional[int] = None
        self._checked: Dict[Tuple[int, float], float] = {}

    # -- SIGUSR1 while blocked ------------------------------------------------------------------------
    def listen_for_signals(self) -> None:
        """Make the flight signal wake this thread (called from the main thread, where set_wakeup_fd must be)."""
        if not settings.flight_signal:
            return
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write)
        except ValueError:  # not the main thread, or an unusable fd
            os.close(read)
            os.close(write)
            return
        if previous != -1:  # another library (an event loop) uses the wakeup fd: leave it to it
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return
        self.wakeup = read

    def _signals(self) -> None:
        if self.wakeup is None:
            return
        try:
            data = os.read(self.wakeup, 512)
        except BlockingIOError:
            return
        number = getattr(signal, settings.flight_signal, None) if settings.flight_signal else None
        if number is not None and int(number) in data:
            flight.signal_dump(settings.flight_signal)

    # -- stalls -----------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            time.sleep(TICK)
            try:
                self._signals()
                if settings.watchdog:
                    self._look()
            except Exception as exc:  # noqa: BLE001 - the watchdog must never take the process down
                get_logger("watchdog").debug(f"watchdog: {type(exc).__name__}: {exc}")

    def _look(self) -> None:
        now = time.monotonic()
        self._answer_requests(now)
        for key, seen in list(_blocked.items()):
            pg, entry, call = seen
            since = self._since(key, pg, entry, call, now)
            if key in self.verdicts and self.verdict_of.get(key) is not seen:
                self.forget(key)  # the verdict was for a call that has ended
            if pg.backend.name == "local":  # run_local's thread ranks share this process: no watchdog there
                continue
            waited = now - since
            if settings.fault_tolerant and key not in self.verdicts and (
                    key in engines or cached_engine(pg.backend) is not None):
                dead, outside = lost_while_waiting(pg.world, pg.ranks)  # the engine's waits see no MPI error
                if dead or outside:
                    self._end(key, seen, node_peer_failed(dead, _call_text(pg, entry, call), outside))
                    continue
            mark = (key, since)
            if waited >= settings.stall_report and mark not in self.reported:
                self.reported[mark] = now + ANSWER_WAIT
                get_logger("watchdog").warning(
                    f"rank {pg.world.rank} has waited {waited:.0f} s in {_call_text(pg, entry, call)}, called at "
                    f"{user_location(key)}; asking every rank where it is (AXONHPC_STALL_REPORT)")
                self._request(pg)
            due = self.reported.get(mark)
            if due is not None and now >= due:
                first = due != self._checked.get(mark)
                self.reported[mark] = now + RECHECK  # the proof of a deadlock may need states that came late
                self._checked[mark] = self.reported[mark]
                if key not in self.verdicts:
                    self._report(key, seen, waited, log=first)
            timeout = settings.stall_timeout
            if timeout is not None and waited >= timeout and key not in self.verdicts:
                text = self._report(key, seen, waited, log=False)
                self._end(key, seen, CollectiveStallError(
                    f"rank {pg.world.rank} waited {waited:.0f} s in {_call_text(pg, entry, call)} "
                    f"(AXONHPC_STALL_TIMEOUT={timeout:g}); {text}"))

    def forget(self, key: int) -> None:
        """Drop thread ``key``'s verdict: the call it ended is over."""
        self.verdicts.pop(key, None)
        self.verdict_of.pop(key, None)

    def _since(self, key: int, pg: Any, entry: Optional[list], call: Any, now: float) -> float:
        """When this watchdog first saw thread ``key`` blocked in this very call (group, number and record tell
        calls apart)."""
        which = (id(pg), entry[3] if entry is not None else getattr(call, "seq", id(call)), id(entry))
        seen = self.first_seen.get(key)
        if seen is None or seen[0] != which:
            seen = self.first_seen[key] = (which, now)
        return seen[1]

    def _state_dir(self) -> str:
        return os.path.abspath(settings.flight_dir)

    def _request(self, pg: Any) -> None:
        """Ask every rank of the run (through the flight folder) to write where it is, and write this rank's state."""
        ident = f"{pg.world.rank}-{os.getpid()}-{time.time():.6f}"
        run = pg.world.run_id
        try:
            write_json_atomic(os.path.join(self._state_dir(), REQUEST.format(run=run)),
                              {"id": ident, "time": time.time()})
        except OSError:
            return
        self._write_state(pg.world.rank, run, ident)

    def _answer_requests(self, now: float) -> None:
        if now < self.next_request_look:
            return
        self.next_request_look = now + 1.0
        rank, run = flight.process_rank(), flight.process_run()
        if rank is None or run is None:
            return  # no world made by init in this process (run_local's ranks are not watched)
        path = os.path.join(self._state_dir(), REQUEST.format(run=run))
        try:
            with open(path) as f:
                request = json.load(f)
        except (OSError, ValueError):
            return
        if request.get("id") == self.answered or time.time() - float(request.get("time", 0)) > 60:
            return
        self._write_state(rank, run, request["id"])

    def _write_state(self, rank: int, run: str, request: str) -> None:
        self.answered = request
        now = time.monotonic()
        mine = [(pg, entry, call, self._since(key, pg, entry, call, now))
                for key, (pg, entry, call) in list(_blocked.items()) if pg.world.rank == rank]
        blocked = None
        if mine:
            pg, entry, call, since = mine[0]
            blocked = {"group": pg.name, "ranks": list(pg.ranks), "seq": None if entry is None else entry[3],
                       "call": _call_text(pg, entry, call), "waited": time.monotonic() - since}
        state = {"rank": rank, "pid": os.getpid(), "request": request, "time": time.time(), "blocked": blocked,
                 "where": user_location(), "entered": _entered(flight.records(rank))}
        try:
            write_json_atomic(os.path.join(self._state_dir(), STATE.format(run=run, rank=rank)), state)
        except OSError:
            pass

    def _states(self, run: str) -> Dict[int, dict]:
        """The states the ranks of run ``run`` wrote for this process's last request."""
        request = self.answered
        out: Dict[int, dict] = {}
        folder = self._state_dir()
        try:
            names = os.listdir(folder)
        except OSError:
            return out
        prefix = STATE.split("{rank")[0].format(run=run)
        for name in names:
            if name.startswith(prefix) and name.endswith(".json"):
                try:
                    with open(os.path.join(folder, name)) as f:
                        state = json.load(f)
                except (OSError, ValueError):
                    continue
                if state.get("request") == request:
                    out[int(state["rank"])] = state
        return out

    def _report(self, key: int, seen: tuple, waited: float, log: bool = True) -> str:
        pg = seen[0]
        states = self._states(pg.world.run_id)
        world_ranks = range(pg.world.world_size)
        lines = []
        for r in world_ranks:
            state = states.get(r)
            if state is None:
                lines.append(f"rank {r}: no answer (not reachable: stopped outside Python, on another file system, "
                             f"or dead)")
            elif state["blocked"]:
                b = state["blocked"]
                lines.append(f"rank {r} waits in {b['call']} (for {b['waited']:.0f} s), at {state['where']}")
            else:
                lines.append(f"rank {r} is not in a collective, at {state['where']}")
        text = ("who is where: " + "; ".join(lines) + ". A collective must be called by every rank of its group in "
                "the same order: one called only on some ranks (inside `if rank == 0:`) or groups entered in "
                "different orders never completes")
        cycle = _deadlock(states, pg.world.rank)
        if cycle:
            calls = "; ".join(f"rank {r} waits in {states[r]['blocked']['call']}, which rank {nxt} has not entered"
                              for r, nxt in zip(cycle, cycle[1:] + cycle[:1]))
            error = DeadlockError(f"deadlock: {calls} (each waits for the next, so none can go on). {text}")
            error.ranks = tuple(sorted(cycle))
            self._end(key, seen, error)
        elif log:
            get_logger("watchdog").warning(f"rank {pg.world.rank} still waits after {waited:.0f} s; {text}")
        return text

    def _end(self, key: int, seen: tuple, error: Exception) -> None:
        """End the blocked call ``seen`` (its note in ``_blocked``) with ``error``: the engine gives up at once; a
        call in MPI cannot, so the job ends.

        [Note: a verdict ends the call it was made for]
        A verdict takes time to make (ULFM's failed set, the other ranks' state files), and the thread goes on
        meanwhile: one rank of a pair whose third rank had died got, 2 600 all-reduces later, an error naming the
        call the look had seen. So a verdict is given only while the thread is still in that very call (each note
        is a tuple of its own), ``verdict()`` answers only that call, and the job is ended only while the
        thread still waits in it: a healthy later call is never ended with a stall found in an earlier one. The
        engine is told last; should its call return in the instant between, the next call it fails names
        itself (``delivered``).
        """
        pg = seen[0]
        if _blocked.get(key) is not seen:
            return  # that call ended: the next look judges the one the thread is in now
        self.verdicts[key] = error
        self.verdict_of[key] = seen
        error._axonhpc_call = seen  # which call its text names (see delivered)
        if _blocked.get(key) is not seen:
            self.forget(key)
            return
        for engine in {id(e): e for e in (engines.get(key), cached_engine(pg.backend)) if e is not None}.values():
            engine.abandon(error)
        deadline = time.monotonic() + 3.0
        while _blocked.get(key) is seen and time.monotonic() < deadline:
            time.sleep(0.05)
        still = _blocked.get(key) is seen
        comm = getattr(pg.backend, "comm", None)
        if still and settings.fault_tolerant and isinstance(error, PeerFailedError) and comm is not None:
            # Blocked inside MPI in a fault-tolerant job: revoking the communicator (ULFM) makes the call return
            # MPI_ERR_REVOKED on every rank, which it raises as PeerFailedError itself, and the survivors go on.
            # Aborting here ended a whole elastic job once in this session's three full runs of test_elastic
            # (rank 0 killed; rank 1 waited in a world all-gather inside MPI, which ULFM had not yet failed).
            from mpi4py import MPI

            revoke(MPI, comm)
            return
        if still:  # blocked inside MPI, which cannot be interrupted: end the job with the error
            get_logger("watchdog").error(f"{type(error).__name__} on rank {pg.world.rank}: {error}; the call waits "
                                         "inside MPI, which cannot be interrupted: aborting the job")
            sys.stderr.flush()
            time.sleep(1.0)
            pg.world.abort(1)


def _entered(records: List[dict]) -> Dict[str, int]:
    """The last sequence number this rank entered on each group, keyed ``name|ranks``."""
    out: Dict[str, int] = {}
    for r in records:
        key = f"{r['group']}|{','.join(map(str, r['ranks']))}"
        out[key] = max(out.get(key, -1), int(r["seq"]))
    return out


def _deadlock(states: Dict[int, dict], me: int) -> Optional[List[int]]:
    """A cycle of blocked ranks through ``me``, each waiting in a call the next has not entered; or None."""
    def waits_for(r: int) -> List[int]:
        b = states[r]["blocked"]
        if not b or b["seq"] is None:
            return []
        key = f"{b['group']}|{','.join(map(str, b['ranks']))}"
        return [q for q in b["ranks"] if q != r and q in states and states[q]["blocked"]
                and states[q]["entered"].get(key, -1) < b["seq"]]

    if me not in states or not states[me]["blocked"]:
        return None
    path: List[int] = [me]
    seen = {me}

    def walk(r: int) -> Optional[List[int]]:
        for q in waits_for(r):
            if q == me:
                return list(path)
            if q not in seen:
                seen.add(q)
                path.append(q)
                found = walk(q)
                if found:
                    return found
                path.pop()
        return None

    return walk(me)


_dog: Optional[_Watchdog] = None


def install(world: Any = None) -> None:
    """The flight signal's handler and, with ``settings.watchdog``, the watchdog of this process: from ``init``
    on, so a rank that has made no collective yet answers too.
    """
    flight.install(world)
    if settings.watchdog and threading.current_thread() is threading.main_thread():
        start()


def start() -> None:
    """Start the watchdog of this process (once; from the main thread)."""
    global _dog
    if _dog is not None:
        return
    _dog = _Watchdog()
    _dog.listen_for_signals()
    backend_base.WAIT_OBSERVER = (_observe_wait, unblocked)
    _dog.start()


def verdict(key: Optional[int] = None) -> Optional[Exception]:
    """The error the watchdog decided this thread's blocked call raises (for waits that poll), or None: one
    decided for an earlier call is not this one's ([Note: a verdict ends the call it was made for])."""
    if _dog is None:
        return None
    key = threading.get_ident() if key is None else key
    error = _dog.verdicts.get(key)
    if error is None or _dog.verdict_of.get(key) is not _blocked.get(key):
        return None
    return error


def delivered(error: BaseException) -> None:
    """``error`` ends this thread's call now (raised by the node's engine): if it is a watchdog's
    ``PeerFailedError`` whose text names another call, make it name this one. An abandoned engine fails every
    later call with the same error; the peer is still gone, but the call is not the one first judged."""
    named = getattr(error, "_axonhpc_call", None)
    seen = _blocked.get(get_ident())
    if named is None or seen is None or named is seen or not isinstance(error, PeerFailedError):
        return
    error._axonhpc_call = seen
    error.args = (node_peer_failed(list(error.lost), _call_text(*seen), getattr(error, "outside", ())).args[0],)


def _register() -> None:
    from ..groups import runtime

    if install not in runtime.AFTER_INIT:
        runtime.AFTER_INIT.append(install)


_register()

__all__ = ["blocking", "unblocked", "install", "start", "verdict", "delivered", "user_location"]
