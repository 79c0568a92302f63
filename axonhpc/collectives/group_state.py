"""What the collective layer keeps for each process group, in one typed object.

A ``ProcessGroup`` imports nothing above itself, so the layer's per-group state (routes, private
communicators, the agreement buffer and guess, pending asynchronous calls) lives in one
``GroupState`` held in ``pg.collective_state``, made on first use by ``state_of``. One attribute read
keeps the hot path as fast as loose entries of the group's ``__dict__`` were.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

_PRUNE = 64  # started calls kept before the finished and forgotten ones are dropped
weak = weakref.ref


class GroupState:
    """The collective layer's state of one group (see the module docstring)."""

    __slots__ = ("route", "p2p", "channels", "check", "unissued", "in_engine", "arrivals", "started", "prune_at")

    def __init__(self) -> None:
        self.route: Optional[tuple] = None  # shm_path.plain_route: (key, (engine, backend))
        self.p2p: Optional[tuple] = None  # p2p._route: (key, backend or None, size, rank)
        self.channels: Dict[str, Any] = {}  # purpose -> private communicator (private_channel)
        # agreement's MPI check: (words, reduce_max, host, the guess of the next call: carried.Predictor)
        self.check: Optional[tuple] = None
        self.unissued: List[Any] = []  # agreement.CheckedWork calls waiting for their check, oldest first
        # engine_calls.EngineWork calls in flight in the node's engine that may still be refused, oldest first
        self.in_engine: List[Any] = []
        self.arrivals: Any = None  # stragglers.Arrivals: group rank 0's lateness totals
        # Weak references to the Works of asynchronous calls started on the group, which ``complete`` waits for
        # (one the caller dropped is gone: nothing can wait for it after the group is destroyed).
        self.started: List[Any] = []
        self.prune_at = _PRUNE

    def issue_unissued(self) -> None:
        """Issue every asynchronous call still waiting for its check, oldest first (``agreement.flush``).

        Before anything else goes over the group's communicator: a rank that made one of them blocking
        waits in it, and would wait for good while this rank waited in something else.
        """
        waiting = self.unissued
        while waiting:
            waiting[0]._start()

    def note_started(self, work: Any) -> None:
        """Remember an asynchronous call's ``work`` until it is seen finished (``complete`` waits for it).

        ``p2p``'s fast path does the same inline (a method call is a third of the cost).
        """
        started = self.started
        started.append(weak(work))
        if len(started) >= self.prune_at:
            self.prune()

    def prune(self) -> None:
        """Forget the started calls that finished or that nobody holds any more (amortised: at most twice as many
        are kept as were live at the last prune)."""
        kept = [ref for ref in self.started if not getattr(ref(), "_finished", True)]
        self.started = kept
        self.prune_at = max(_PRUNE, 2 * len(kept))

    def complete(self) -> None:
        """Issue the calls waiting for their check, then wait for every started call still held, oldest first
        (``ProcessGroup.destroy``: nothing may reach the group's communicators once they are freed).

        Raises:
            CollectiveTimeoutError: a call did not complete within its group's timeout, as its ``wait`` raises.
        """
        self.issue_unissued()
        for ref in self.started:
            work = ref()
            # A call whose check failed was never issued (its error was raised already): nothing to wait for.
            if work is not None and getattr(work, "_failed", None) is None:
                work.wait()
        self.started = []

    def free(self) -> None:
        """Free the private channels (collective over the group, in the order they were made) and forget the
        routes and checks that hold the group's backend (``ProcessGroup.destroy``, after ``complete``)."""
        for channel in self.channels.values():
            channel.free()
        self.channels.clear()
        self.route = self.p2p = self.check = None


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
