"""A refusal on one rank, raised on every rank at the end of a training step: ``vote`` and ``batch_refused``.

[Note: a batch refused on one rank]
A loss refuses a bad batch (a target out of range, a shape that does not fit) with an ``AxonError``. Raised
at once on one rank, it would leave the others inside the step's collectives, ended only by
``abort_on_exception``. So the training step (``DistributedTrainer``'s, ``Pipeline.train_step``) catches it at
the loss: that rank finishes the step with a zero gradient for the output, so every collective of the
backward still meets its peers, and the step ends with a vote: the trainer's flag rides on the all-reduce of
the step's loss it makes anyway, the pipeline's is ``vote``, one 8-byte all-reduce; the reasons are gathered
only after a refusal. Every rank then raises before any optimizer step: the refusing rank its own error,
the others ``CollectiveRefusedError`` naming it and its reason (``batch_refused``), and the parameters stay
as they were everywhere. A device batch's target check, read as the step's deferred reads end, is voted on
alike. An error inside the forward itself is not caught: FSDP's forward is collective, and a rank that
stopped half-way through it cannot be brought back into step.

The vote is an ``all_reduce`` like any other: on a node it goes through the shared-memory engine (10 us on 2 ranks
here, where ``groups.agreement.agree`` takes 37-48), and in a fault-tolerant job a dead peer ends it as it
ends any collective.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..backends.base import ReduceOp
from ..errors import CollectiveRefusedError
from ..groups.agreement import Failed, Refused, agree, ranks_text
from .allreduce import all_reduce


def batch_refused(group: Any, what: str) -> Refused:
    """The error of the ranks whose batch passed ``what`` when another's was refused: ``CollectiveRefusedError``
    naming the first refusing rank (world numbering) and its reason."""
    def refused(failed: Failed) -> CollectiveRefusedError:
        ranks = [group.ranks[r] for r, _ in failed]
        why = failed[0][1]
        return CollectiveRefusedError(f"{what} refused the batch of {ranks_text(ranks)} (world numbering): {why}",
                                      rank=ranks[0], reason=why)
    return refused


def vote(group: Any, problem: Optional[BaseException], refused: Refused, wider: Any = None,
         elsewhere: str = "") -> None:
    """Collective over ``group``: raise on every rank if any had a ``problem``, as ``agree`` does, for a check
    made on every step (see the note).

    ``wider``: a second group every rank is in (a pipeline's data-parallel replicas); a problem in any of its
    ``group``s makes every rank raise, those of the groups with none ``CollectiveRefusedError(elsewhere)``.
    """
    flag = np.array([0.0 if problem is None else 1.0])
    if group.size > 1:
        all_reduce(flag, ReduceOp.MAX, group)
    mine = bool(flag[0])
    if wider is not None and wider.size > 1:
        all_reduce(flag, ReduceOp.MAX, wider)
    if mine:
        agree(group, problem, refused)
    if flag[0]:
        raise CollectiveRefusedError(elsewhere)


__all__ = ["vote", "batch_refused"]
