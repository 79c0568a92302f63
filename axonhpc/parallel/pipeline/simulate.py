"""Replay pipeline schedules without communication: timing, bubbles, deadlocks, memory.

[Note: the model]
Each rank runs its list in order, one action at a time; an action starts once the rank's previous action and
every dependency have finished (communication is free, sends never block). ``F`` of stage s on micro-batch i
needs ``F`` of stage s - 1 on i; ``B`` of stage s on i needs ``F`` of stage s on i and, unless s is last,
``B`` of stage s + 1 on i. Start times are a pure function of the lists and costs. A deadlock is actions
left but none able to start: a receive whose send waits, through a chain, on the stuck rank, or that no
rank has at all.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ...errors import ConfigurationError
from .schedules import BACKWARD, FORWARD, Action

Cost = Union[float, int, Sequence[float], Callable[[int], float]]


@dataclasses.dataclass(frozen=True)
class StuckAction:
    """The next action of a rank that cannot start in a deadlocked schedule.

    Attributes:
        waiting_for: the dependencies that never finished.
        owners: for each dependency, ``(rank, position in that rank's list)`` or ``None`` if no rank has it.
    """

    rank: int
    action: Action
    waiting_for: Tuple[Action, ...]
    owners: Tuple[Optional[Tuple[int, int]], ...]

    def __str__(self) -> str:
        parts = []
        for dep, owner in zip(self.waiting_for, self.owners):
            where = "which no rank runs" if owner is None else f"(rank {owner[0]}, position {owner[1]})"
            parts.append(f"{dep} {where}")
        return f"rank {self.rank} stuck at {self.action} waiting for " + ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What ``simulate_pipeline`` found.

    Attributes:
        makespan: end time of the last action that ran.
        bubble_fraction: ``1 - sum(busy_time) / (num_ranks * makespan)`` (0.0 if nothing ran).
        deadlock: True if some actions could never start.
        timelines: per rank, ``(action, start, end)`` of every action that ran, in order.
        busy_time: per rank, the summed cost of the actions that ran.
        peak_activations: per rank, the most micro-batches forwarded but not yet backwarded.
        stuck: on deadlock, the next action of every rank that did not finish.
    """

    makespan: float
    bubble_fraction: float
    deadlock: bool
    num_ranks: int
    timelines: Tuple[Tuple[Tuple[Action, float, float], ...], ...]
    busy_time: Tuple[float, ...]
    peak_activations: Tuple[int, ...]
    stuck: Tuple[StuckAction, ...]

    @property
    def start_times(self) -> Dict[Action, float]:
        """Start time of every action that ran."""
        return {a: s for timeline in self.timelines for a, s, _ in timeline}

    @property
    def end_times(self) -> Dict[Action, float]:
        """End time of every action that ran."""
        return {a: e for timeline in self.timelines for a, _, e in timeline}

    @property
    def deadlock_description(self) -> str:
        """One line per stuck rank naming what it waits for ("" without deadlock)."""
        return "; ".join(str(s) for s in self.stuck)


def _cost_function(name: str, cost: Cost) -> Callable[[int], float]:
    if callable(cost):
        fn = cost
    elif isinstance(cost, (int, float)) and not isinstance(cost, bool):
        fn = lambda stage, c=float(cost): c  # noqa: E731
    elif isinstance(cost, Sequence) and not isinstance(cost, str):
        table = list(cost)

        def fn(stage: int) -> float:
            if stage >= len(table):
                raise ConfigurationError(f"{name} lists {len(table)} stage costs but stage {stage} is used")
            return table[stage]
    else:
        raise ConfigurationError(f"{name} must be a number, a per-stage sequence or a callable, got {cost!r}")

    def checked(stage: int) -> float:
        value = fn(stage)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigurationError(f"{name} for stage {stage} must be a finite number >= 0, got {value!r}")
        return value

    return checked


def _dependencies(action: Action, num_stages: int) -> Tuple[Action, ...]:
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD:
        return (Action(s - 1, FORWARD, i),) if s > 0 else ()
    deps = [Action(s, FORWARD, i)]
    if s + 1 < num_stages:
        deps.append(Action(s + 1, BACKWARD, i))
    return tuple(deps)


def simulate_pipeline(
    actions_by_rank: Sequence[Sequence[Action]],
    forward_cost: Cost = 1.0,
    backward_cost: Cost = 2.0,
) -> SimulationResult:
    """Simulate a pipeline schedule with zero-latency communication (see the module note).

    Args:
        forward_cost: time of one forward: a number, a sequence indexed by stage, or ``stage -> time``.
        backward_cost: time of one backward, in the same forms.

    Raises:
        ConfigurationError: an entry is not an Action, an action appears twice, or a cost is negative, not
            finite or missing for a stage.
    """
    lists: List[List[Action]] = []
    owner: Dict[Action, Tuple[int, int]] = {}
    for r, actions in enumerate(actions_by_rank):
        row = list(actions)
        for pos, a in enumerate(row):
            if not isinstance(a, Action):
                raise ConfigurationError(f"rank {r} position {pos}: expected an Action, got {a!r}")
            if a in owner:
                r0, p0 = owner[a]
                raise ConfigurationError(
                    f"action {a} appears twice: rank {r0} position {p0} and rank {r} position {pos}"
                )
            owner[a] = (r, pos)
        lists.append(row)
    num_stages = 1 + max((a.stage for a in owner), default=-1)
    fcost = _cost_function("forward_cost", forward_cost)
    bcost = _cost_function("backward_cost", backward_cost)

    end: Dict[Action, float] = {}
    free = [0.0] * len(lists)
    nxt = [0] * len(lists)
    timelines: List[List[Tuple[Action, float, float]]] = [[] for _ in lists]
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(lists):
            while nxt[r] < len(row):
                a = row[nxt[r]]
                deps = _dependencies(a, num_stages)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                finish = start + (fcost(a.stage) if a.kind == FORWARD else bcost(a.stage))
                end[a] = finish
                free[r] = finish
                timelines[r].append((a, start, finish))
                nxt[r] += 1
                progress = True

    stuck = []
    for r, row in enumerate(lists):
        if nxt[r] < len(row):
            a = row[nxt[r]]
            missing = tuple(d for d in _dependencies(a, num_stages) if d not in end)
            stuck.append(StuckAction(r, a, missing, tuple(owner.get(d) for d in missing)))

    busy = tuple(sum(e - s for _, s, e in t) for t in timelines)
    makespan = max((e for t in timelines for _, _, e in t), default=0.0)
    total = len(lists) * makespan
    # (total - busy) / total rather than 1 - busy / total: with integer costs
    # both operands are exact, so the result is the correctly rounded ratio.
    bubble = (total - sum(busy)) / total if total > 0 else 0.0
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=bubble,
        deadlock=bool(stuck),
        num_ranks=len(lists),
        timelines=tuple(tuple(t) for t in timelines),
        busy_time=busy,
        peak_activations=tuple(_peak_activations(t) for t in timelines),
        stuck=tuple(stuck),
    )


def _peak_activations(timeline: Sequence[Tuple[Action, float, float]]) -> int:
    live = set()
    peak = 0
    for a, _, _ in timeline:
        key = (a.stage, a.microbatch)
        if a.kind == FORWARD:
            live.add(key)
            peak = max(peak, len(live))
        else:
            live.discard(key)
    return peak


__all__ = ["simulate_pipeline", "SimulationResult", "StuckAction"]
