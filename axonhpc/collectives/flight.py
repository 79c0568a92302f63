"""The flight recorder: every rank's last collectives, dumped when something goes wrong.

[Note: what is kept and when it is written]
Each collective appends a small record to a ring buffer of the last ``settings.flight_recorder``
calls (0: off): time (the dump carries the offset to rank 0's clock), group, sequence number, call,
dtype, shape, op, root, completion, and file:line in debug mode only (finding it costs a stack
walk). It is written atomically to ``<settings.flight_dir>/flight-<run>-rank<r>.json`` on a timeout, a
mismatch, an uncaught exception that aborts the job, and on ``settings.flight_signal`` (SIGUSR1,
which ``sbatch --signal`` can send; the handler chains to any earlier one). ``axonhpc doctor DIR``
merges the dumps and says which rank diverged first and which arrived last how often.

[Note: dumps name their run]
Jobs started from one folder share its flight folder (the default is the working directory's
axonhpc-flight), and so may two jobs on one node. A dump's name carries its world's ``run_id`` (drawn
by the ranks together at ``init``), so a second job's dumps never replace the first's, and
``axonhpc doctor DIR --run ID`` reads one run's (by default the newest). Versions before named them
``flight-rank<r>.json``; the doctor still reads those (their run is the id inside), and a world
without a ``run_id`` (a stand-in) is dumped under that name.
"""
from __future__ import annotations

import collections
import functools
import os
import signal
import threading
import time
from typing import Any, Deque, Dict, Optional

from ..observe.tracing import write_json_atomic
from ..settings import settings

_lock = threading.RLock()  # reentrant: the signal handler may interrupt a holder of it
# One ring buffer per world rank living in this process: one under MPI, several under run_local's threads.
_buffers: Dict[int, Deque[Dict[str, Any]]] = {}
_installed = False
_offsets: Dict[int, float] = {}  # world rank -> its clock's offset to rank 0's (``World.clock_offset``)
_worlds: Dict[int, Any] = {}  # world rank -> the world of its latest record: its run id and size go in the dump


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    """``str(dtype)``, remembered: numpy's costs about 10 us, more than the rest of a record."""
    return str(dtype)


# A record is a list in this order (cheaper to make than a dict: one is made per collective);
# ``records`` turns them into dicts. The caller marks its record done: ``entry[DONE] = True``.
FIELDS = ("t", "group", "ranks", "seq", "op", "dtype", "shape", "reduce", "root", "where", "done")
DTYPE, SHAPE, DONE = FIELDS.index("dtype"), FIELDS.index("shape"), FIELDS.index("done")


def record(pg: Any, op: str, x: Any, reduce: Optional[str], root: Optional[int], where: Optional[str]) -> Optional[list]:
    """Append one collective's record (see the module note); returns it, to be marked done later."""
    size = settings.flight_recorder
    if not size:
        return None
    world = pg.world
    rank = world.rank
    _worlds[rank] = world  # thread ranks of several run_local worlds share their numbers: the latest one's
    # The dtype object itself: its name is made when a dump is written (``str(dtype)`` costs ~10 us).
    entry = [time.time(), pg.name, pg.ranks, pg.seq, op, None if x is None else x.dtype,
             None if x is None else x.shape, reduce, root, where, False]
    buffer = _buffers.get(rank)
    if buffer is None or buffer.maxlen != size:
        with _lock:
            buffer = _buffers[rank] = collections.deque(_buffers.get(rank) or (), maxlen=size)
    buffer.append(entry)  # one C call under the GIL: no lock needed beside ``records``' one-call copy
    if not _installed:
        _install_signal()
    return entry


def arrival_times(pg: Any, first: int, count: int) -> Any:
    """This rank's arrival times (``time.time()``) at ``pg``'s collectives ``first .. first + count - 1``.

    NaN for a call the buffer no longer holds.
    """
    import numpy as np

    out = np.full(count, np.nan, dtype=np.float64)
    with _lock:
        entries = list(_buffers.get(pg.world.rank, ()))
    name, ranks = pg.name, pg.ranks
    seq_at, t_at, group_at, ranks_at = FIELDS.index("seq"), FIELDS.index("t"), FIELDS.index("group"), \
        FIELDS.index("ranks")
    for e in reversed(entries):  # newest first: an older world's group of the same name and ranks comes later
        k = e[seq_at] - first
        if 0 <= k < count and e[group_at] == name and e[ranks_at] == ranks and out[k] != out[k]:
            out[k] = e[t_at]
    return out


def records(rank: int) -> list:
    """A copy of world rank ``rank``'s buffer as dicts, oldest first."""
    with _lock:
        entries = list(_buffers.get(rank, ()))  # one C call: no append lands in the middle of it
    out = []
    for e in entries:
        d = dict(zip(FIELDS, e))
        d["ranks"] = list(d["ranks"])
        d["dtype"] = None if d["dtype"] is None else _dtype_name(d["dtype"])
        out.append(d)
    return out


def dump(reason: str, rank: Optional[int] = None) -> Optional[str]:
    """Write a rank's buffer (None: every rank's in this process) to ``settings.flight_dir``.

    Returns:
        The path of the last file written, or None (off, nothing recorded, or unwritable).
    """
    if not settings.flight_recorder:
        return None
    with _lock:
        # The ranks whose last call is newest are written last: buffers an earlier run_local world of this
        # process left (ranks 3, 4 of a 5-rank world before this 3-rank one) are not the newest dumps in
        # the folder, which the doctor reads by default.
        ranks = sorted(_buffers, key=lambda r: (_buffers[r][-1][0] if _buffers[r] else 0.0, r)) \
            if rank is None else [rank]
    path = None
    for r in ranks:
        path = _write(r, reason) or path
    return path


def _dump_name(run: Optional[str], rank: int) -> str:
    """The file name of world rank ``rank``'s dump in run ``run`` ([Note: dumps name their run])."""
    return f"flight-rank{rank:05d}.json" if run is None else f"flight-{run}-rank{rank:05d}.json"


def _write(rank: int, reason: str) -> Optional[str]:
    world = _worlds.get(rank)
    run, world_size = getattr(world, "run_id", None), getattr(world, "world_size", None)
    path = os.path.join(settings.flight_dir, _dump_name(run, rank))
    try:
        write_json_atomic(path, {"rank": rank, "pid": os.getpid(), "reason": reason, "time": time.time(),
                                 "run": run, "world_size": world_size, "clock_offset": _offsets.get(rank, 0.0),
                                 "records": records(rank)})
    except OSError:
        return None  # a dump must never turn one failure into another
    return path


_last_signal_dump = [0.0]  # when (time.monotonic) a signal last made a dump


def signal_dump(name: str) -> Optional[str]:
    """Dump every rank of this process for the signal ``name`` and say where (the folder is the working
    directory's by default)."""
    _last_signal_dump[0] = time.monotonic()
    path = dump(f"signal {name}")
    if path is not None:
        from ..observe.log import get_logger

        directory = os.path.dirname(os.path.abspath(path))
        with _lock:
            runs = {getattr(_worlds.get(r), "run_id", None) for r in _buffers}
        run = process_run() or (runs.pop() if len(runs) == 1 else None)  # run_local's threads: one world's
        get_logger("flight").warning(f"{name}: wrote the flight recorder to {path} (AXONHPC_FLIGHT_DIR; merge every "
                                     f"rank's with: axonhpc doctor {directory}"
                                     + (f" --run {run})" if run is not None else ")"))
    return path


_rank = [None]  # the world rank ``init`` gave this process
_run = [None]  # and its world's ``run_id``


def process_rank() -> Optional[int]:
    """This process's world rank: ``init``'s, else the one whose records it keeps (None with several:
    ``run_local``'s threads)."""
    if _rank[0] is not None:
        return _rank[0]
    with _lock:
        ranks = list(_buffers)
    return ranks[0] if len(ranks) == 1 else None


def process_run() -> Optional[str]:
    """The ``run_id`` of the world ``init`` made in this process (None before it, and for ``run_local``)."""
    return _run[0]


def install(world: Any = None) -> None:
    """The flight signal's handler from ``init`` on (the watchdog calls it): a rank that has not made a
    collective yet answers a signal too."""
    if world is not None:
        _rank[0] = world.rank
        _run[0] = getattr(world, "run_id", None)
        _offsets[world.rank] = world.clock_offset  # the dumps carry it: doctor compares the ranks' times
        _worlds.setdefault(world.rank, world)  # a dump before any collective names the world too
    _install_signal()


def _install_signal() -> None:
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    from ..groups import runtime

    runtime.BEFORE_ABORT.append(dump)
    name = settings.flight_signal
    if not name:
        return
    number = getattr(signal, name)
    previous = signal.getsignal(number)

    def handler(signum: int, frame: Any) -> None:
        if time.monotonic() - _last_signal_dump[0] > 5.0:  # the watchdog dumped already while the rank was blocked
            signal_dump(name)
        if callable(previous):
            previous(signum, frame)

    signal.signal(number, handler)


__all__ = ["record", "records", "dump", "signal_dump", "process_rank", "process_run", "FIELDS", "DTYPE", "SHAPE",
           "DONE"]

