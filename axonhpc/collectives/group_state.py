"""What the collective layer keeps for each process group, in one typed object.

A ``ProcessGroup`` imports nothing above itself, so the layer's per-group state (routes, private
communicators, the agreement buffer and guess, pending asynchronous calls) lives in one
``GroupState`` held in ``pg.collective_state``, made on first use by ``state_of``. One attribute read
keeps the hot path as fast as loose entries of the group's ``__dict__`` were.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional


class GroupState:
    """The collective layer's state of one group (see the module docstring)."""

    __slots__ = ("route", "p2p", "channels", "check", "unissued", "arrivals")

    def __init__(self) -> None:
        self.route: Optional[tuple] = None  # shm_path.plain_route: (key, (engine, backend))
        self.p2p: Optional[tuple] = None  # p2p._route: (key, backend or None, size, rank)
        self.channels: Dict[str, Any] = {}  # purpose -> private communicator (private_channel)
        # agreement's MPI check: (words, reduce_max, host, the guess of the next call: carried.Predictor)
        self.check: Optional[tuple] = None
        self.unissued: List[Any] = []  # agreement.CheckedWork calls waiting for their check, oldest first
        self.arrivals: Any = None  # stragglers.Arrivals: group rank 0's lateness totals

    def issue_unissued(self) -> None:
        """Issue every asynchronous call still waiting for its check, oldest first (``agreement.flush``).

        Before anything else goes over the group's communicator: a rank that made one of them blocking
        waits in it, and would wait for good while this rank waited in something else.
        """
        waiting = self.unissued
        while waiting:
            waiting[0]._start()


def state_of(pg: Any) -> GroupState:
    """The collective layer's state of ``pg``, made on first use."""
    state = pg.collective_state
    if state is None:
        state = pg.collective_state = GroupState()
    return state


def private_channel(pg: Any, purpose: str) -> Any:
    """A communicator with ``pg``'s ranks in ``pg``'s order, for ``purpose`` alone (collective on first use).

    Its messages never meet the group's own, so the "ring" steps or the "debug" fingerprints cannot be
    confused with the user's traffic.
    """
    channels = state_of(pg).channels
    channel = channels.get(purpose)
    if channel is None:
        channel = pg.backend.split(0, pg.rank)
        channel.global_ranks = pg.ranks
        channels[purpose] = channel
    return channel
