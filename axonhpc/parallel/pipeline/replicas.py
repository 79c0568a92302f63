"""Pipeline x data parallelism: ``StageReplicas``, one rank's stages replicated over a ``dp_group``.

[Note: pipeline x data parallelism]
The members of a dp group hold the same stages, so after the pipeline's backward each rank averages its
stages' gradients over ``dp_group`` with bucketed all-reduces; each replica's gradient is that of its equal
shard's mean loss, so the average is the global-batch gradient. This simplest correct composition does not
overlap the all-reduces with the pipeline's cool-down. The last stage's loss is averaged too, so every
replica returns the global-batch loss.
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ...backends import ReduceOp
from ...bucketing import GradientSynchronizer
from ...collectives import all_reduce
from ...errors import UsageError
from ..replicate import broadcast_arrays
from ..same_model import check_same_model, parameter_lines
from .tied import unique_parameters


class StageReplicas:
    """This rank's stages and their replicas over ``dp_group``; built collectively.

    Checks that every replica holds the same stage parameters (and ``setting``), then copies dp rank 0's values.
    Raises NotAMemberError, or ModelMismatchError on every replica together.
    """

    def __init__(self, dp_group: Any, stages: List[int], stage_modules: Sequence[Any], setting: str,
                 bucket_size: int):
        self.group = dp_group.require_member("building a Pipeline with dp_group")
        # The replicas of these stages hold the same stages with the same parameters, or every one raises
        # (before the broadcast below and before any gradient is averaged).
        named = [(f"stage{s}.{name}", q) for s in stages for name, q in stage_modules[s].named_parameters()]
        check_same_model(self.group, f"Pipeline stages {stages} over dp_group {self.group.name}",
                         parameter_lines(named), settings=[setting],
                         hint="the data-parallel replicas of a stage must build the same stage modules")
        self._sync = GradientSynchronizer(bucket_size=bucket_size, group=self.group)
        params = unique_parameters([stage_modules[s] for s in stages])
        if self.group.size > 1 and params:
            broadcast_arrays([q.data for q in params], self.group)

    def average(self, parameters: Callable[[], List[Any]], loss: Optional[float], is_last: bool,
                rank: int) -> Tuple[Optional[float], float]:
        """Collective: average the stages' gradients and (on the last stage's rank) the loss over the replicas.

        Returns ``(loss, seconds taken)`` (loss None off the last stage). UsageError if a parameter has no gradient.
        """
        if self.group.size == 1:
            return loss, 0.0
        # Every member of dp_group holds the same stages, so all of them push the same gradients.
        sync_start = time.perf_counter()
        params = parameters()
        missing = [k for k, q in enumerate(params) if q.grad is None]
        if missing:
            raise UsageError(f"Pipeline: parameters {missing} of rank {rank} got no gradient; "
                             f"they cannot be averaged over dp_group")
        self._sync.synchronize([q.grad for q in params])
        if is_last:
            box = np.array([loss], dtype=np.float64)
            all_reduce(box, ReduceOp.AVG, self.group)
            loss = float(box[0])
        return loss, time.perf_counter() - sync_start


__all__ = ["StageReplicas"]
