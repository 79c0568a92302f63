"""Uneven inputs for DDP: ``Joiner``, the collaborator behind ``DistributedDataParallel.join``.

[Note: uneven inputs and join]
Every backward all-reduces every bucket, so a rank that runs out of data early would leave the others waiting.
Inside ``ddp.join()`` each forward first all-gathers two flags per rank (still active, will it synchronise).
A rank whose loop has ended shadows the others: it answers the flag exchange as joined, joins the buffer
broadcast and all-reduces zero gradients in plan order, so the active ranks' collectives always find a
partner. The sum is divided by the initial world size (PyTorch's default) or, on request, by the active ranks.
A joined rank steps the given optimizer with the gradients it received, so its state follows the others;
at the end the rank that ran the most iterations broadcasts its model, so all leave with one model.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import numpy as np

from ...collectives import all_gather
from ...errors import ConfigurationError
from ..replicate import broadcast_arrays

FORWARD, BACKWARD = 1, 2  # the phase a rank is at (or, joined, expects next) in the flag exchange
_PHASES = {FORWARD: "forward", BACKWARD: "backward"}


class JoinHost(Protocol):
    """What a ``Joiner`` asks of the DDP it serves (``DistributedDataParallel`` provides it)."""

    group: Any

    def _broadcast_buffers(self, src: int) -> None:
        """Copy group rank ``src``'s buffers into every rank, if the DDP broadcasts buffers (collective)."""

    def _reduce_zeros(self) -> None:
        """All-reduce zero gradients in plan order, as the active ranks' backward does (collective)."""

    def _model_arrays(self) -> List[Any]:
        """The parameters' and buffers' arrays, in the same order on every rank."""


class _JoinState:
    """What ``DistributedDataParallel.join`` tracks while it is open."""

    def __init__(self, divide_by_initial_world_size: bool, optimizer: Any):
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.optimizer = optimizer
        self.iterations = 0  # forwards this rank ran inside the context
        self.active = 0  # ranks active in the current iteration
        self.shadowed = 0  # iterations this rank shadowed after its own data ended


class Joiner:
    """Uneven inputs for one DDP (``host``): flags before each forward and backward, shadowing, the final model.

    Attributes:
        state: the open ``join``'s counters, or None outside ``join``.
        last: what the last ``join`` recorded (``DistributedDataParallel.last_join``).
    """

    def __init__(self, host: JoinHost):
        self._host = host
        self.state: Optional[_JoinState] = None
        self.last: Dict[str, Any] = {}

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool, enable: bool, optimizer: Any,
             comm_hook: bool) -> Iterator[None]:
        """``DistributedDataParallel.join`` (see its docstring); ``comm_hook``: the DDP has a communication hook."""
        if not enable:
            yield
            return
        if self.state is not None:
            raise ConfigurationError("ddp.join() is already open; it cannot be nested")
        if comm_hook and not divide_by_initial_world_size:
            raise ConfigurationError("join(divide_by_initial_world_size=False) needs the default reduction; a "
                                     "communication hook always averages over the whole group")
        self.state = _JoinState(bool(divide_by_initial_world_size), optimizer)
        try:
            yield
            self._shadow_until_all_joined()
            self._sync_final_model()
        finally:
            self.state = None

    @property
    def divides_by_active(self) -> bool:
        """Open with ``divide_by_initial_world_size=False``: the sums are divided by the active ranks."""
        return self.state is not None and not self.state.divide_by_initial_world_size

    def before_forward(self, training: bool) -> int:
        """Collective inside ``join``: exchange the forward flags; the group rank to take buffers from (0 outside)."""
        if self.state is None:
            return 0
        active, _ = self._exchange_flags(FORWARD, training)
        self.state.iterations += 1
        self.state.active = len(active)
        return int(active[0])

    def before_backward(self, syncing: bool) -> None:
        """Collective inside ``join``: exchange the backward flags (nothing outside)."""
        if self.state is not None:
            self._exchange_flags(BACKWARD, syncing)

    def _exchange_flags(self, phase: int, flag: bool, active: bool = True) -> Tuple[np.ndarray, bool]:
        """All-gather ``(phase, active, flag)`` of every rank; returns the active ranks and whether they set the flag.

        ``flag`` is "training mode" (forward) or "will synchronise" (backward). Every rank sees the same rows, so a
        disagreement raises on all of them together.
        """
        rows = all_gather(np.array([phase, int(active), int(active and flag)], dtype=np.int64), self._host.group)
        active_ranks = np.flatnonzero(rows[:, 1])
        if len(active_ranks) and len(set(rows[:, 0].tolist())) > 1:
            where = {k: _PHASES.get(int(row[0]), "?") for k, row in enumerate(rows)}
            raise ConfigurationError(
                f"inside ddp.join() the group ranks are at different points of an iteration ({where}): every "
                "forward in training mode must be followed by ddp.backward"
            )
        flagged = np.flatnonzero(rows[:, 2])
        if len(flagged) and not np.array_equal(flagged, active_ranks):
            what = "training mode in forward" if phase == FORWARD else "synchronising gradients in backward"
            raise ConfigurationError(
                f"inside ddp.join() the active group ranks {active_ranks.tolist()} must agree on {what}, "
                f"but only ranks {flagged.tolist()} do (no_sync or eval mode on the others)"
            )
        return active_ranks, bool(len(flagged))

    def _shadow_until_all_joined(self) -> None:
        """This rank's data has ended: answer the active ranks' collectives until none is left."""
        while True:
            active, training = self._exchange_flags(FORWARD, False, active=False)
            if len(active) == 0:
                return
            self.state.active = len(active)
            self.state.shadowed += 1
            self._host._broadcast_buffers(int(active[0]))
            if training:
                _, syncing = self._exchange_flags(BACKWARD, False, active=False)
                if syncing:
                    self._shadow_backward()

    def _shadow_backward(self) -> None:
        """All-reduce zero gradients in plan order, as a backward would; step the optimizer if given."""
        self._host._reduce_zeros()
        if self.state.optimizer is not None:
            self.state.optimizer.step()

    def _sync_final_model(self) -> None:
        """Every rank takes the parameters and buffers of the rank that ran the most iterations."""
        counts = all_gather(np.array([self.state.iterations], dtype=np.int64), self._host.group)[:, 0]
        self.last = {"iterations": counts.tolist(), "shadowed": self.state.shadowed}
        broadcast_arrays(self._host._model_arrays(), self._host.group, src=int(np.argmax(counts)))


__all__ = ["Joiner", "JoinHost"]
