"""Lower a rank's schedule to explicit steps: receives, compute, sends.

A schedule names only computation; ``lower_schedule`` makes the messages explicit for one rank, as
torch.distributed.pipelining's ``_add_send_recv`` does, so the executor is a small interpreter. Like the
schedules it is pure data, checkable without MPI (every send has its receive on the peer rank).

[Note: steps]
Each action becomes one ``Step``: ``waits`` (``RECV_F`` before a forward whose input is on another rank,
``RECV_B`` before such a backward), then ``work`` (the compute op, then ``SEND_F``/``SEND_B`` if the consumer
is on another rank). Neighbouring stages on one rank hand over locally, with no op. The executor times
``work`` and not ``waits``: waiting for an input is the bubble, not part of the action.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from .schedules import FORWARD, Action

RECV_F = "RECV_F"
SEND_F = "SEND_F"
RECV_B = "RECV_B"
SEND_B = "SEND_B"


@dataclasses.dataclass(frozen=True)
class Op:
    """One thing a rank does: compute (``"F"``, ``"B"``) or a message (``"SEND_F"`` ...).

    ``str(Op("SEND_F", 0, 3, 1))`` is ``"0SEND_F3"``. ``stage`` is a send's sender, a receive's receiver;
    ``peer`` the rank at the other end (this rank for compute).
    """

    kind: str
    stage: int
    microbatch: int
    peer: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One schedule action lowered: the receives it ``waits`` for, then its ``work`` (compute, then sends)."""

    action: Action
    waits: Tuple[Op, ...]
    work: Tuple[Op, ...]


def lower_schedule(actions: Sequence[Action], rank: int, num_ranks: int, num_stages: int) -> List[Step]:
    """Lower one rank's action list to steps with explicit sends and receives, one Step per action.

    Stage s lives on rank ``s % num_ranks``, as ``pipeline_schedule`` assumes.
    """
    last = num_stages - 1

    def remote(stage: int) -> bool:
        return stage % num_ranks != rank

    steps = []
    for a in actions:
        s, i = a.stage, a.microbatch
        compute = Op(a.kind, s, i, rank)
        if a.kind == FORWARD:
            waits = (Op(RECV_F, s, i, (s - 1) % num_ranks),) if s > 0 and remote(s - 1) else ()
            sends = (Op(SEND_F, s, i, (s + 1) % num_ranks),) if s < last and remote(s + 1) else ()
        else:
            waits = (Op(RECV_B, s, i, (s + 1) % num_ranks),) if s < last and remote(s + 1) else ()
            sends = (Op(SEND_B, s, i, (s - 1) % num_ranks),) if s > 0 and remote(s - 1) else ()
        steps.append(Step(a, waits, (compute,) + sends))
    return steps


__all__ = ["Op", "Step", "lower_schedule", "RECV_F", "SEND_F", "RECV_B", "SEND_B"]
