"""Pipeline schedules as data: one list of actions per rank.

Pure data with no other pipeline import, so the executor runs the lists, the simulator replays them without
communication (deadlocks, bubbles, memory) and ``render.py`` prints them. Sends and receives are implied: the
forward of stage s sends to s + 1, the backward of stage s to s - 1.

[Note: stage layout]
With ``P = num_stages // stages_per_rank`` ranks, rank r holds stages r, r + P, ... (Megatron-LM's
interleaved layout), so with v = ``stages_per_rank`` > 1 every micro-batch passes through every rank v times.

[Note: orders]
GPIPE: all forwards, then all backwards; every rank holds all m activations at its peak.
ONE_F_ONE_B (PipeDream-flush): rank r runs ``min(P - r - 1, m)`` warm-up forwards, then alternates one
forward and one backward, then cools down; it holds at most ``min(P - r, m)`` activations, same bubble.
INTERLEAVED_1F1B (Megatron-LM): virtual forward k runs chunk ``(k // P) % v`` on micro-batch
``(k // (P * v)) * P + k % P``: micro-batches advance in groups of P through one chunk before the next, which
is why m must be a multiple of P. Rank r warms up with ``min((P - r - 1) * 2 + (v - 1) * P, m * v)``
forwards. The bubble shrinks by about v against 1F1B, at the price of v times more messages.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, List, Union

from ..._choices import parse_choice
from ...errors import ConfigurationError

FORWARD = "F"
BACKWARD = "B"


class PipelineSchedule(enum.Enum):
    """The order in which each pipeline rank runs its forwards and backwards.

    GPIPE: all forwards, then all backwards (holds every micro-batch's activations).
    ONE_F_ONE_B: warm-up forwards, then one forward / one backward, then cool-down.
    INTERLEAVED_1F1B: 1F1B over several model chunks per rank (``stages_per_rank > 1``).
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"

    @classmethod
    def parse(cls, value: Any) -> "PipelineSchedule":
        """Accept a PipelineSchedule, its name or its value in any case (``"1f1b"``, ``"interleaved-1f1b"``, ...).

        Raises UnknownChoiceError (a ``ConfigurationError``) if ``value`` names no schedule.
        """
        return parse_choice(cls, value, "pipeline schedule", {"interleaved": "INTERLEAVED_1F1B"})


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of pipeline work: a forward or backward of one stage on one micro-batch.

    ``str(Action(0, "F", 3))`` is ``"0F3"``.

    Attributes:
        stage: global stage index (0 is the first stage).
        kind: ``"F"`` (forward) or ``"B"`` (backward).
        microbatch: micro-batch index.
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if not _is_int(self.stage) or self.stage < 0:
            raise ConfigurationError(f"Action stage must be an int >= 0, got {self.stage!r}")
        if self.kind not in (FORWARD, BACKWARD):
            raise ConfigurationError(f"Action kind must be 'F' or 'B', got {self.kind!r}")
        if not _is_int(self.microbatch) or self.microbatch < 0:
            raise ConfigurationError(f"Action microbatch must be an int >= 0, got {self.microbatch!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Build an Action from its string form, such as ``"0F3"`` or ``"12B7"``; ConfigurationError otherwise."""
        for kind in (FORWARD, BACKWARD):
            stage, sep, mb = str(text).partition(kind)
            if sep and stage.isdigit() and mb.isdigit():
                return cls(int(stage), kind, int(mb))
        raise ConfigurationError(f"cannot parse {text!r} as an Action; expected e.g. '0F3' or '2B1'")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")


def pipeline_schedule(
    schedule: Union[PipelineSchedule, str],
    num_stages: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
) -> List[List[Action]]:
    """Generate the per-rank action lists of a pipeline schedule (see the module notes).

    Returns one list of Actions per rank (``num_stages // stages_per_rank`` ranks), each holding exactly one
    forward and one backward per (own stage, micro-batch), in the order that rank runs them.

    Raises:
        ConfigurationError: a count is not a positive int, ``num_stages`` is not a multiple of
            ``stages_per_rank``, ``stages_per_rank != 1`` for GPIPE or ONE_F_ONE_B, or the interleaved schedule
            gets a number of micro-batches that is not a multiple of the number of ranks.
    """
    kind = PipelineSchedule.parse(schedule)
    check_positive_int("num_stages", num_stages)
    check_positive_int("num_microbatches", num_microbatches)
    check_positive_int("stages_per_rank", stages_per_rank)
    if num_stages % stages_per_rank:
        raise ConfigurationError(
            f"num_stages={num_stages} is not a multiple of stages_per_rank={stages_per_rank}"
        )
    p, m, v = num_stages // stages_per_rank, num_microbatches, stages_per_rank
    if kind is not PipelineSchedule.INTERLEAVED_1F1B and v != 1:
        raise ConfigurationError(
            f"{kind.name} runs one stage per rank, got stages_per_rank={v}; "
            f"use INTERLEAVED_1F1B for several stages per rank"
        )
    if kind is PipelineSchedule.GPIPE:
        return [_gpipe(r, m) for r in range(p)]
    if kind is PipelineSchedule.ONE_F_ONE_B:
        return [_one_f_one_b(r, p, m) for r in range(p)]
    if m % p:
        raise ConfigurationError(
            f"INTERLEAVED_1F1B needs num_microbatches to be a multiple of the number of ranks: "
            f"m={m} is not divisible by P={p} (num_stages={num_stages}, stages_per_rank={v})"
        )
    if v == 1:
        # The extra warm-up forwards of the interleaved order only cover the hop
        # from one chunk to the next; with a single chunk they would only hold
        # more activations, so one chunk per rank is plain 1F1B.
        return [_one_f_one_b(r, p, m) for r in range(p)]
    return [_interleaved(r, p, m, v) for r in range(p)]


def _gpipe(rank: int, m: int) -> List[Action]:
    return [Action(rank, FORWARD, i) for i in range(m)] + [Action(rank, BACKWARD, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> List[Action]:
    warmup = min(p - rank - 1, m)
    actions = [Action(rank, FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions.append(Action(rank, FORWARD, warmup + i))
        actions.append(Action(rank, BACKWARD, i))
    actions.extend(Action(rank, BACKWARD, i) for i in range(m - warmup, m))
    return actions


def _interleaved(rank: int, p: int, m: int, v: int) -> List[Action]:
    total = m * v

    def virtual(k: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return Action(chunk * p + rank, kind, microbatch)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [virtual(k, FORWARD) for k in range(warmup)]
    for i in range(total - warmup):
        actions.append(virtual(warmup + i, FORWARD))
        actions.append(virtual(i, BACKWARD))
    actions.extend(virtual(k, BACKWARD) for k in range(total - warmup, total))
    return actions


__all__ = ["PipelineSchedule", "Action", "pipeline_schedule"]
