"""The slow rank, named while the job runs: who arrives last at a group's collectives, and by how much.

[Note: arrivals]
Every ``settings.straggler_every`` collectives of a group (1000; 0: off) its ranks gather their
flight-recorder arrival times at the last ``COMPARED`` (100) calls, on rank 0's clock, to group rank
0. Per call the last rank is late by its time minus the next-latest's; a rank last by more than
``settings.straggler_margin`` in at least 80% of them is logged by name with its median lateness
and kept for ``summary``. A collective pays only a test of its sequence number; the comparison,
about 60 us, is deterministic (every rank completes the same calls in order), so it needs no
agreement check (``axonhpc bench allreduce --straggler-cost``). A rank whose last calls were
asynchronous issues them first (``agreement.flush``): a rank that made one of them blocking waits in
it, and would wait for good while this rank waited in the gather.
"""
from __future__ import annotations

import math

from typing import Any, Dict, Optional

import numpy as np

from ..observe.log import get_logger
from ..settings import settings
from . import agreement, flight
from .group_state import private_channel, state_of

SHARE = 0.8  # of the compared calls a rank must be last in to be named
COMPARED = 100  # calls compared each time (the flight recorder keeps 256 by default)


class Arrivals:
    """Group rank 0's lateness totals of one group since the last ``summary``."""

    __slots__ = ("last", "late", "calls", "named")

    def __init__(self, size: int) -> None:
        self.last = np.zeros(size, dtype=np.int64)  # calls in which each group rank was last by the margin
        self.late = np.zeros(size, dtype=np.float64)  # their summed lateness, seconds
        self.calls = 0  # calls compared since the last summary
        self.named: Optional[int] = None  # the group rank named in the last comparison, if any


def compare(pg: Any, done: int) -> None:
    """Collective over ``pg``: compare the ranks' arrivals at its last calls (``done``: calls completed so far)."""
    if pg.size == 1:
        return
    agreement.flush(pg)
    count = min(COMPARED, settings.straggler_every or COMPARED, done)  # windows never overlap
    mine = flight.arrival_times(pg, done - count, count) + pg.world.clock_offset
    channel = private_channel(pg, "arrivals")
    table = np.empty((pg.size, count), dtype=np.float64) if pg.rank == 0 else None
    # Nonblocking on every rank (MPI never matches a blocking gather with a nonblocking one): the wait polls
    # while a rank's asynchronous call of the group is still in flight in the node's engine, and advances it
    # for the ranks that made the call blocking and wait in it ([Note: calls in flight in the engine]).
    channel.gather(mine, table, 0, async_op=True).wait(math.inf)
    if pg.rank != 0:
        return
    table = table[:, ~np.isnan(table).any(axis=0)]  # calls some rank no longer holds
    calls = table.shape[1]
    if calls < 2:
        return
    columns = np.arange(calls)
    latest = np.argmax(table, axis=0)
    top = table[latest, columns]
    table[latest, columns] = -np.inf
    lateness = top - table.max(axis=0)
    counted = lateness > settings.straggler_margin
    window_last = np.bincount(latest[counted], minlength=pg.size)
    state = state_of(pg)
    arrivals = state.arrivals
    if arrivals is None:
        arrivals = state.arrivals = Arrivals(pg.size)
    arrivals.calls += calls
    arrivals.last += window_last
    arrivals.late += np.bincount(latest[counted], weights=lateness[counted], minlength=pg.size)
    worst = int(np.argmax(window_last))
    arrivals.named = worst if window_last[worst] >= SHARE * calls else None
    if arrivals.named is not None:
        late = float(np.median(lateness[counted & (latest == worst)]))
        get_logger("stragglers").warning(
            f"rank {pg.ranks[worst]} was the last to arrive in {window_last[worst]} of the last {calls} "
            f"collectives on group {pg.name}, by a median of {late * 1e3:.2f} ms: it holds the others back "
            f"(a slow node, a busy core, more work?)")


def summary(pg: Any, reset: bool = True) -> Dict[str, Any]:
    """Local: the lateness group rank 0 counted on ``pg`` since the last summary (empty on other ranks).

    Returns:
        ``{"calls": compared calls, "ranks": {world rank: {"last": calls it was last in by
        the margin, "share": their fraction, "late_ms": its mean lateness in them}}, "straggler":
        the world rank last in at least 80% of the calls (None if none)}``.
    """
    arrivals = state_of(pg).arrivals
    if arrivals is None or not arrivals.calls:
        return {"calls": 0, "ranks": {}, "straggler": None}
    ranks = {}
    for r in range(pg.size):
        if arrivals.last[r]:
            ranks[pg.ranks[r]] = {"last": int(arrivals.last[r]), "share": float(arrivals.last[r] / arrivals.calls),
                                  "late_ms": float(arrivals.late[r] / arrivals.last[r]) * 1e3}
    straggler = next((rank for rank, facts in ranks.items() if facts["share"] >= SHARE), None)
    out = {"calls": arrivals.calls, "ranks": ranks, "straggler": straggler}
    if reset:
        arrivals.last[:] = 0
        arrivals.late[:] = 0.0
        arrivals.calls = 0
    return out


__all__ = ["compare", "summary", "Arrivals", "SHARE", "COMPARED"]
