"""Lower a rank's schedule to explicit steps: receives, compute, sends.

A schedule names only computation (``0F3``: forward of stage 0 on
micro-batch 3); the messages are implied. ``lower_schedule`` makes them
explicit for one rank, as torch.distributed.pipelining's ``_add_send_recv``
does, so the executor is a small interpreter over the result. Like the
schedules, it is pure data: it needs no communication and can be checked
without MPI (every send has its receive on the peer rank).

[Note: steps]
Each action of the rank's list becomes one ``Step``:

- ``waits``: the receive the action needs before it can start, if its input
  comes from another rank: ``RECV_F`` (the activation of stage s - 1) before
  a forward of stage s > 0, ``RECV_B`` (the gradient of stage s + 1) before a
  backward of a stage that is not the last;
- ``work``: the compute op (``F`` or ``B``), then the send it posts, if the
  consumer is on another rank: ``SEND_F`` (activation to stage s + 1) after a
  forward that is not on the last stage, ``SEND_B`` (gradient to stage s - 1)
  after a backward of stage s > 0.

When the neighbouring stage lives on the same rank (one rank holding several
chunks) there is no message and no op: the hand-over is local. The executor
times ``work`` and not ``waits``: waiting for an input is the bubble, not part
of the action.
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

    ``str(Op("SEND_F", 0, 3, 1))`` is ``"0SEND_F3"``.

    Attributes:
        kind: ``"F"``, ``"B"``, ``"RECV_F"``, ``"SEND_F"``, ``"RECV_B"`` or ``"SEND_B"``.
        stage: the stage whose forward or backward this belongs to (a send's
            sender, a receive's receiver).
        microbatch: micro-batch index.
        peer: the rank at the other end of a send or receive; for compute, this rank.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One schedule action lowered: the receives it waits for, then its work.

    Attributes:
        action: the schedule's action.
        waits: receives that must complete before the action starts.
        work: the compute op, then the sends it posts.
    """

    action: Action
    waits: Tuple[Op, ...]
    work: Tuple[Op, ...]


def lower_schedule(actions: Sequence[Action], rank: int, num_ranks: int, num_stages: int) -> List[Step]:
    """Lower one rank's action list to steps with explicit sends and receives.

    Stages are laid out as ``pipeline_schedule`` assumes: stage s lives on
    rank ``s % num_ranks``.

    Args:
        actions: this rank's list, e.g. ``pipeline_schedule(...)[rank]``.
        rank: this rank.
        num_ranks: ranks in the pipeline.
        num_stages: stages in the model.

    Returns:
        One Step per action, in the same order.
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
