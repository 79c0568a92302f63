"""Spans of work on this rank: what ``ax.timeline`` records.

[Note: recording spans]
A ``Recorder`` holds one rank's spans ``(name, lane, start, end, args)`` in ``perf_counter`` seconds
since its origin. Code asks ``active()`` and adds a span when there is one, so recording off costs
one lookup and a ``None`` test. A recorder is installed for the thread (each ``run_local`` rank has
its own) and, for a one-rank process, process-wide, so spans from other threads (a completion
callback) land on the same rank. Lanes (compute, comm, buckets) become a rank's rows in the trace.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..errors import InvalidArgumentError

LANES = ("compute", "comm", "buckets")
RANK_FILE_FORMAT = "axonhpc-timeline-rank/1"
Span = Tuple[str, str, float, float, Dict[str, Any]]


class _ThreadRecorder(threading.local):
    """This thread's recorder; None by default (a class default: a lookup raises nothing)."""

    recorder: Optional["Recorder"] = None


_local = _ThreadRecorder()
_process: Optional["Recorder"] = None
EVER_INSTALLED = False  # no recorder has been installed yet: hot paths skip ``active()``


class Recorder:
    """The spans of one rank since ``origin`` (a ``time.perf_counter`` reading, 0 in the trace)."""

    def __init__(self, rank: int, origin: Optional[float] = None):
        self.rank = int(rank)
        self.origin = time.perf_counter() if origin is None else float(origin)
        self.wall_origin = time.time() - (time.perf_counter() - self.origin)
        self.spans: List[Span] = []
        self.parent: Optional["Recorder"] = None  # also receives every span (a whole-run recorder)
        self._lock = threading.Lock()

    def add(self, name: str, lane: str, start: float, end: float, **args: Any) -> None:
        """Record one span; ``start``/``end`` are ``time.perf_counter`` readings."""
        if lane not in LANES:
            raise InvalidArgumentError(f"unknown timeline lane {lane!r}; use one of {LANES}")
        with self._lock:
            self.spans.append((name, lane, start - self.origin, end - self.origin, args))
        if self.parent is not None:
            self.parent.add(name, lane, start, end, **args)

    def snapshot(self) -> List[Span]:
        """A copy of the spans recorded so far."""
        with self._lock:
            return list(self.spans)


def active() -> Optional[Recorder]:
    """The recorder of this thread (or of this process), or None when nothing records."""
    return getattr(_local, "recorder", None) or _process


def install(recorder: Optional[Recorder], process_wide: bool) -> Tuple[Optional[Recorder], Optional[Recorder]]:
    """Make ``recorder`` active for this thread, and for every thread if ``process_wide``.

    Returns:
        The previous ``(thread, process)`` recorders, for ``restore``.
    """
    global _process, EVER_INSTALLED
    EVER_INSTALLED = EVER_INSTALLED or recorder is not None
    previous = (getattr(_local, "recorder", None), _process)
    _local.recorder = recorder
    if process_wide:
        _process = recorder
    return previous


def restore(previous: Tuple[Optional[Recorder], Optional[Recorder]]) -> None:
    """Put back the recorders ``install`` replaced."""
    global _process
    _local.recorder, _process = previous


@contextlib.contextmanager
def span(name: str, lane: str = "compute", **args: Any) -> Iterator[None]:
    """Record the body as one span, if a recorder is active."""
    recorder = active()
    if recorder is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        recorder.add(name, lane, start, time.perf_counter(), **args)


def span_until_done(work: Any, start: float, name: str, lane: str, **args: Any) -> None:
    """Record a span from ``start`` until ``work`` (a ``Work``) is seen complete, if a recorder is active."""
    recorder = active()
    if recorder is None:
        return
    work.then(lambda: recorder.add(name, lane, start, time.perf_counter(), **args))


def write_json_atomic(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary name and a rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)


def write_rank_file(path: str, recorder: Recorder) -> None:
    """One rank's spans with its wall-clock origin (merged by ``timeline.merge_files``)."""
    write_json_atomic(path, {"format": RANK_FILE_FORMAT, "rank": recorder.rank,
                             "wall_origin": recorder.wall_origin, "spans": recorder.snapshot()})


def record_run(rank: int, directory: str) -> Recorder:
    """Record this process's spans from now on; at exit write ``directory/timeline-rank<r>.json``.

    ``ax.init`` calls this when the setting ``timeline_dir`` is set.
    """
    recorder = Recorder(rank)
    install(recorder, True)
    atexit.register(write_rank_file, os.path.join(directory, f"timeline-rank{rank:05d}.json"), recorder)
    return recorder


__all__ = ["Recorder", "LANES", "RANK_FILE_FORMAT", "active", "install", "restore", "span", "span_until_done",
           "write_json_atomic", "write_rank_file", "record_run"]
