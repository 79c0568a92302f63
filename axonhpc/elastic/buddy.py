"""Buddy copies: each dp rank keeps its left neighbour's FSDP shards and optimizer state, step by step.

[Note: a copy kept by replaying the step]
An FSDP (or ZeRO) shard lives on one rank only, so a rank that dies takes its
parameters and optimizer state with it. Here dp rank ``r`` keeps a copy of
rank ``r - 1``'s (mod the dp size): the shards and their optimizer state,
received once when the copies are set up. After that it never receives them
again: each step the source sends its averaged gradient shards (the bytes of
its shards, not three times that) and the keeper runs the same optimizer, with
the same hyperparameters, on its copy. Adam's update is element-wise, so the
copy stays equal to the source's state.

The gradients travel in the step's first, communicating half (``exchange``),
the copy's update in its second, local half (``step``); see
``elastic.loop`` for why that split makes the state after a failure the
same on every survivor. Cost per rank: one more shard and optimizer state in
memory (for AdamW, three times the shard's bytes), a send and a receive of the
gradient shard per step, and the optimizer's work done twice.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from ..collectives import irecv, isend
from ..errors import ConfigurationError
from ..nn.parameter import Parameter

_TAG_STATE, _TAG_GRAD = 0x7E1, 0x7E2


def _twin(optimizer: Any, params: List[Any]) -> Any:
    """A new optimizer of ``optimizer``'s class and settings over ``params``."""
    kwargs = dict(optimizer.hyperparameters())
    if hasattr(optimizer, "fused"):
        kwargs["fused"] = optimizer.fused
    return type(optimizer)(params, **kwargs)


class BuddyCopies:
    """The copy this rank keeps of its left dp neighbour's shards (``source``), and the exchange of gradients.

    Args:
        shards: this rank's flat shard Parameters, in the optimizer's order.
        optimizer: the optimizer over them.
        group: the dp group the shards are split over (at least 2 ranks).

    Collective over ``group`` (the set-up sends this rank's shards and state to its keeper).
    """

    def __init__(self, shards: List[Any], optimizer: Any, group: Any):
        if group.size < 2:
            raise ConfigurationError(f"buddy copies need at least 2 dp ranks, this group has {group.size}")
        for p in shards:
            if not isinstance(p.data, np.ndarray):
                raise ConfigurationError(f"buddy copies keep host arrays; a shard is a {type(p.data).__name__} "
                                         f"(device shards are not supported here yet)")
        self.group = group
        self.source = (group.rank - 1) % group.size
        self.keeper = (group.rank + 1) % group.size
        self.shards = list(shards)
        self.optimizer = optimizer
        self.copies = [Parameter(np.empty_like(p.data)) for p in self.shards]
        self.copy_optimizer = _twin(optimizer, self.copies)
        self._present = np.zeros(len(self.shards), dtype=np.uint8)
        self._received = np.zeros(len(self.shards), dtype=np.uint8)
        self._send_state()

    def _swap(self, mine: List[np.ndarray], theirs: List[np.ndarray], tag: int) -> None:
        """Send ``mine`` to the keeper and receive ``theirs`` from the source (matching arrays)."""
        works = [irecv(b, self.source, tag, self.group) for b in theirs]
        works += [isend(np.ascontiguousarray(a), self.keeper, tag, self.group) for a in mine]
        for work in works:
            work.wait()

    def _send_state(self) -> None:
        """The set-up: the shards and every array of their optimizer state, to the keeper."""
        index = {id(p): i for i, p in enumerate(self.optimizer.params)}
        states = [self.optimizer.state[index[id(p)]] for p in self.shards]
        mine: List[np.ndarray] = [p.data for p in self.shards]
        theirs: List[np.ndarray] = [c.data for c in self.copies]
        copy_states: List[Dict[str, Any]] = []
        for state, copy in zip(states, self.copies):
            fresh: Dict[str, Any] = {}
            for key, value in sorted(state.items()):
                if hasattr(value, "shape") and np.shape(value) == copy.data.shape:
                    fresh[key] = np.empty_like(value)
                    mine.append(value)
                    theirs.append(fresh[key])
                else:
                    fresh[key] = value  # a scalar (Adam's step): the same on every rank
            copy_states.append(fresh)
        self._swap(mine, theirs, _TAG_STATE)
        self.copy_optimizer.state = copy_states

    def exchange(self) -> None:
        """Collective (the step's communicating half): send this rank's gradient shards, receive the source's."""
        for i, p in enumerate(self.shards):
            self._present[i] = p.grad is not None
        self._swap([self._present], [self._received], _TAG_GRAD)
        self._swap([p.grad for p in self.shards if p.grad is not None],
                   [self._incoming(i) for i in range(len(self.copies)) if self._received[i]], _TAG_GRAD)

    def _incoming(self, i: int) -> np.ndarray:
        copy = self.copies[i]
        if copy.grad is None:
            copy.grad = np.empty_like(copy.data)
        return copy.grad

    def step(self) -> None:
        """Local (the step's second half): the source's optimizer step, replayed on the copy."""
        for i, copy in enumerate(self.copies):
            if not self._received[i]:
                copy.grad = None
        for key, value in self.optimizer.hyperparameters().items():
            setattr(self.copy_optimizer, key, value)
        self.copy_optimizer.step()

    def nbytes(self) -> int:
        """Bytes this rank holds for the copy: the shards and their optimizer state (not the gradient buffers)."""
        state = sum(int(v.nbytes) for s in self.copy_optimizer.state for v in s.values() if hasattr(v, "nbytes"))
        return int(sum(c.data.nbytes for c in self.copies)) + state


def shard_parameters(model: Any) -> Optional[List[Any]]:
    """The flat shard Parameters of a model sharded with FSDP (``model.engine.units``), or None if it is not."""
    engine = getattr(model, "engine", None)
    units = getattr(engine, "units", None)
    if not getattr(model, "fsdp", False) or units is None:
        return None
    return [unit.shard for unit in units]


__all__ = ["BuddyCopies", "shard_parameters"]
