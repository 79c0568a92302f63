"""Parameters shared between pipeline stages (a tied embedding and output projection): ``TiedParameters``.

[Note: tied parameters]
A Parameter that several stages use gets a gradient from each of them. Stages on one rank add into the one
Parameter. Stages on different ranks each hold their own copy (every rank built the whole list of stage
modules), so after the backward each copy holds only the part of its own stages. As Megatron does with its
embedding group, the ranks that hold a tied Parameter sum its gradient over a group of just those ranks after
the backward: every copy then holds the whole gradient, and the optimizer, which every one of those ranks runs
over it with the same state, keeps the copies equal. At construction the copies take the values of the lowest
of those ranks, so they also start equal.

Only the step's own part is summed. A gradient a tied Parameter held before the step (steps accumulated
without zeroing, or a Parameter no optimizer zeroes) is the same on every owner already: summed with the rest it
would count once per owner. ``set_aside`` takes it out as the step starts and ``sum_gradients`` adds it back to
the sum, into the same array.

``stage_modules`` is the same list on every rank, so every rank finds the same ties by identity with no
message; their description is part of the constructor's comparison, so ranks that disagree raise before the
groups are made. ``Pipeline.from_stages`` gives each rank only its own stages: ties between ranks cannot be
seen there (ties between stages of one rank still are).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ..._dtypes import array_module
from ...backends import ReduceOp
from ...collectives import all_reduce
from ..replicate import broadcast_arrays


def unique_parameters(modules: Sequence[Any]) -> List[Any]:
    """The Parameters of ``modules``, in order, each shared Parameter once."""
    seen: set = set()
    out = []
    for module in modules:
        for q in module.parameters():
            if id(q) not in seen:
                seen.add(id(q))
                out.append(q)
    return out


def find_ties(stage_modules: Sequence[Any], size: int) -> List[Tuple[Tuple[int, ...], Any, List[str]]]:
    """The Parameters held by stages on more than one of ``size`` ranks (stage s on rank s % size).

    Returns:
        ``(owner ranks, Parameter, ["stage{s}.{name}", ...])`` per such Parameter, in stage order; local, the
        same on every rank for the same list. Stages given as None (``from_stages``) are skipped.
    """
    uses: Dict[int, Tuple[Any, List[int], List[str]]] = {}
    for s, module in enumerate(stage_modules):
        if module is None:
            continue
        for name, q in module.named_parameters():
            param, stages, names = uses.setdefault(id(q), (q, [], []))
            stages.append(s)
            names.append(f"stage{s}.{name}")
    ties = []
    for param, stages, names in uses.values():
        owners = tuple(sorted({s % size for s in stages}))
        if len(owners) > 1:
            ties.append((owners, param, names))
    return ties


def describe_ties(ties: List[Tuple[Tuple[int, ...], Any, List[str]]]) -> str:
    """One line naming every tie and its ranks, for the constructor's comparison and for errors."""
    if not ties:
        return "tied parameters: none"
    return "tied parameters: " + "; ".join(f"{' = '.join(names)} {tuple(param.shape)} on ranks {list(owners)}"
                                          for owners, param, names in ties)


class TiedParameters:
    """This rank's Parameters that stages on other ranks share, and a group of their holders per set of ranks.

    Collective over ``group`` when there are ties (one split per set of owner ranks, then a broadcast of the
    values from the lowest owner inside each); nothing is sent when there are none.
    """

    def __init__(self, group: Any, ties: List[Tuple[Tuple[int, ...], Any, List[str]]]):
        by_owners: Dict[Tuple[int, ...], List[Any]] = {}
        for owners, param, _ in ties:
            by_owners.setdefault(owners, []).append(param)
        self.sets: List[Tuple[Any, List[Any]]] = []  # (group of the owners, their shared Parameters)
        for owners in sorted(by_owners):  # the same order on every rank: the splits pair up
            mine = group.rank in owners
            sub = group.split(0 if mine else None, group.rank, name=f"tied{list(owners)} of {group.name}")
            if mine:
                params = by_owners[owners]
                broadcast_arrays([q.data for q in params], sub)  # from the lowest owner (key = pipeline rank)
                self.sets.append((sub, params))

    def held_elsewhere(self) -> set:
        """Ids of this rank's tied Parameters that a lower rank also holds: a sum over the ranks counts them there."""
        return {id(q) for sub, params in self.sets if sub.rank != 0 for q in params}

    def set_aside(self) -> None:
        """As a step starts: take out what this rank's tied Parameters' gradients hold (see the note)."""
        self._before = {}
        for _, params in self.sets:
            for q in params:
                if q.grad is not None:
                    self._before[id(q)] = q.grad
                    q.grad = None

    def put_back(self) -> None:
        """A step that failed: add what was set aside back to the step's part, as an untied Parameter keeps it."""
        for _, params in self.sets:
            for q in params:
                self._add_before(q)
        self._before = {}

    def _add_before(self, q: Any) -> None:
        before = getattr(self, "_before", {}).pop(id(q), None)
        if before is None:
            return
        if q.grad is not None:
            before += q.grad
        q.grad = before  # the gradient stays the array it was

    def sum_gradients(self) -> None:
        """Collective over each set's owners: every copy of a tied Parameter gets the sum of their gradients in this
        step, added to what it held before it (``set_aside``)."""
        for sub, params in self.sets:
            for q in params:
                xp = array_module(q.data)
                if q.grad is None:  # no stage of this rank used it in this step: it adds nothing
                    q.grad = xp.zeros_like(q.data)
                buf = xp.ascontiguousarray(q.grad)
                all_reduce(buf, ReduceOp.SUM, sub)
                if buf is not q.grad:  # the gradient stays the same array, updated in place
                    q.grad[...] = buf
                self._add_before(q)
        self._before = {}


__all__ = ["TiedParameters", "describe_ties", "find_ties", "unique_parameters"]
