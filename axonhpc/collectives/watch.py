"""Waiting for a blocking collective under a timeout: stall reports and the names of the missing ranks.

[Note: no silent hangs]
A blocking collective under a timeout (``pg.timeout`` or ``ax.settings.timeout``) is waited for
here. When it expires the rank raises ``CollectiveTimeoutError`` naming the group, call, sequence
number and the arrived and missing ranks (from the backend's arrival notices). Under ``axonhpc
launch`` an uncaught one aborts the whole job, so the scheduler frees the nodes instead of holding
them for the rest of the allocation.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from ..backends import base as backend_base
from ..errors import CollectiveTimeoutError
from ..observe.log import get_logger
from . import flight, watchdog


def _who(arrivals: Any, pg: Any, missing: Optional[list] = None) -> str:
    """Who arrived and who did not (``missing``: known already), and where the missing ones are instead.

    From the notices alone, a peer known to send none (its timeout is off) is neither: it is "not known".
    """
    unknown = []
    if missing is None:
        missing, unknown = arrivals.missing(), arrivals.unknown()
    arrived = [g for g in pg.ranks if g not in missing and g not in unknown]
    text = f"arrived ranks: {arrived}; missing ranks: {missing}"
    if unknown:
        text += f"; not known: {unknown} (their timeout for this group is off, so they send no arrival notices)"
    elsewhere = {g: where for g, where in arrivals.elsewhere().items() if g in missing}
    if elsewhere:
        text += "; in another collective: " + ", ".join(f"rank {g} at {where}" for g, where in sorted(elsewhere.items()))
    return text


def wait(work: Any, timeout: Optional[float], label: Any, arrivals: Any, pg: Any) -> Any:
    """Wait for ``work`` (see the module note); returns its result.

    Raises:
        CollectiveTimeoutError: ``timeout`` seconds passed; the message names the missing ranks.
    """
    start = time.monotonic()
    key = watchdog.blocking(pg, getattr(label, "entry", None), label)  # the watchdog reports a stall here too
    try:
        return _wait(work, timeout, label, arrivals, pg, start)
    finally:
        watchdog.unblocked(key)


def _wait(work: Any, timeout: Optional[float], label: Any, arrivals: Any, pg: Any, start: float) -> Any:
    delay = 1e-5
    while not work.is_completed():
        elapsed = time.monotonic() - start
        decided = watchdog.verdict()  # this thread's
        if decided is not None:  # a deadlock, or a stall past settings.stall_timeout
            if arrivals is not None:
                arrivals.abandon()
            raise decided
        if timeout is not None and elapsed >= timeout:
            raise timed_out(work, timeout, label, arrivals, pg)
        progress = backend_base.PROGRESS[0]
        if progress is not None:  # another group's calls waiting for their check ([Note] in agreement)
            progress()
        time.sleep(delay)  # leave the core to the rank this one waits for (oversubscribed nodes)
        delay = min(delay * 2, 1e-3)
    if arrivals is not None:
        drain(arrivals, label)
    return work.wait()


def timed_out(work: Any, timeout: float, label: Any, arrivals: Any, pg: Any) -> Exception:
    """The error of a wait for ``work`` that timed out: the missing ranks named where notices tell them."""
    if arrivals is None:
        flight.dump(f"timeout in {label}", pg.world.rank)
        if label is not None:  # the caller's call, not the backend's step of it (an agreement check's all-reduce)
            work.label = label
        return work._timeout_error(timeout)
    who = _who(arrivals, pg)
    arrivals.abandon()
    flight.dump(f"timeout in {label}", pg.world.rank)
    return CollectiveTimeoutError(f"{label} timed out after {timeout:g} s on rank {pg.world.rank}; {who}")


def drain(arrivals: Any, label: Any) -> None:
    """The call completed: take in its arrival notices, and say once which peers send none."""
    silent = arrivals.drain()
    if silent and arrivals.global_ranks not in _warned:
        _warned.add(arrivals.global_ranks)
        get_logger(__name__).warning(
            "%s completed, but ranks %s sent no arrival notice: their timeout for this group is off while this "
            "rank's is on (the ranks' AXONHPC_TIMEOUT, ax.init(timeout=...) or pg.timeout differ), so a timeout "
            "here cannot name the missing ranks", label, silent)


_warned: set = set()  # the groups (their global ranks) already warned of


def arm(work: Any, timeout: float, label: Any, arrivals: Any, pg: Any) -> None:
    """Give the Work of an asynchronous call the group's ``timeout`` for ``wait()`` ([Note: no silent hangs]),
    with the timeout's message naming the missing ranks, and take in its arrival notices once it completes."""
    work.default_timeout = timeout
    work.explain_timeout = lambda waited: timed_out(work, waited, label, arrivals, pg)
    if arrivals is not None:
        work.then(lambda: drain(arrivals, label))


def engine_timed_out(exc: Exception, timeout: float, label: Any, arrivals: Any, pg: Any) -> CollectiveTimeoutError:
    """The error for a call the shared-memory engine gave up on, named like ``wait``'s.

    The engine's counters say who never arrived (a notice can be late: a rank waiting in the engine does
    not drive MPI's progress); the notices say where those ranks are instead.
    """
    who = _who(arrivals, pg, [pg.ranks[k] for k in getattr(exc, "missing", [])])
    arrivals.abandon()
    flight.dump(f"timeout in {label}", pg.world.rank)
    return CollectiveTimeoutError(f"{label} timed out after {timeout:g} s on rank {pg.world.rank} in the "
                                  f"shared-memory path; {who}")


__all__ = ["wait", "timed_out", "drain", "arm", "engine_timed_out"]
