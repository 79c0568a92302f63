"""What the collective layer keeps for each process group, in one typed object.

A ``ProcessGroup`` is its ranks, its backend and its settings; it imports
nothing above itself. The collective layer needs a little state per group
besides: the fast path's choice of route, the private communicators of the
algorithms and of the debug mode, the agreement check's buffer and guess
of the next call, and the asynchronous calls still waiting for their
check. All of it lives in one
``GroupState``, which the group holds in its one attribute for this layer
(``pg.collective_state``) and knows nothing about; ``state_of`` makes it on
first use. Reading an attribute keeps the hot path as fast as it was when
these were loose entries of the group's ``__dict__``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional


class GroupState:
    """The collective layer's state of one group (see the module docstring)."""

    __slots__ = ("route", "channels", "check", "unissued", "arrivals")

    def __init__(self) -> None:
        self.route: Optional[tuple] = None  # shm_path.plain_route: (key, (engine, backend))
        self.channels: Dict[str, Any] = {}  # purpose -> private communicator (private_channel)
        # agreement's MPI check: (words, reduce_max, host, the guess of the next call: carried.Predictor)
        self.check: Optional[tuple] = None
        self.unissued: List[Any] = []  # agreement.CheckedWork calls waiting for their check, oldest first
        self.arrivals: Any = None  # stragglers.Arrivals: group rank 0's lateness totals


def state_of(pg: Any) -> GroupState:
    """The collective layer's state of ``pg``, made on first use."""
    state = pg.collective_state
    if state is None:
        state = pg.collective_state = GroupState()
    return state


def private_channel(pg: Any, purpose: str) -> Any:
    """A communicator with ``pg``'s ranks in ``pg``'s order, for ``purpose`` alone (collective on first use).

    Messages on it never meet the group's own, so an algorithm built from
    point-to-point steps ("ring") or the debug mode's fingerprint exchange
    ("debug") cannot be confused with the user's traffic.
    """
    channels = state_of(pg).channels
    channel = channels.get(purpose)
    if channel is None:
        channel = pg.backend.split(0, pg.rank)
        channel.global_ranks = pg.ranks
        channels[purpose] = channel
    return channel
