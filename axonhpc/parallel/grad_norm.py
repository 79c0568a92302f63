"""Gradient norm clipping over gradients spread across a group: the global norm from the parts, one reduction.

When each gradient element lives on exactly one rank of the group (FSDP's shards over the shard group, whose
HYBRID_SHARD replicas hold the same shards; a pipeline's stages over its ranks, a tied Parameter counted on
one of its holders), the parts' p-th power sums (or max, for inf) reduced over the group give the norm
single-process ``optim.clip_grad_norm`` computes.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from ..backends import ReduceOp
from ..collectives import all_reduce
from ..collectives.core import refuse_call
from ..errors import AxonError, CollectiveMismatchError, everywhere
from ..optim.clip import checked_max_norm, checked_norm_type, norm_part, scale_to_norm


def clip_grad_norm(grads: List[Any], max_norm: float, norm_type: float, shard_group: Any, xp: Any,
                   uncounted: Sequence[Any] = (), group: Any = None) -> float:
    """Scale this rank's gradients (its part of them all) in place so the global norm is at most ``max_norm``;
    returns the norm.

    Collective over ``group``, every rank of which calls it (None: ``shard_group``), and over ``shard_group``
    when it has more than one rank (None: nothing spread, as FSDP's NO_SHARD). The norm's parts are summed over
    ``shard_group``; the arguments are compared over all of ``group`` (FSDP's replicas hold the same shards and
    must clip them alike). ``norm_type`` is p (``inf`` for the max); ``uncounted``: more gradients scaled
    alike but counted on another rank (a copy of a tied Parameter). InvalidArgumentError (a ``ValueError``)
    unless positive, or if ``max_norm`` is not a number or is NaN, before anything is sent: the other ranks of
    ``group`` raise ``CollectiveRefusedError`` naming this rank, from the all-reduce of the arguments they
    entered.
    """
    check = shard_group if group is None else group
    spread = check is not None and check.size > 1
    try:
        norm_type = checked_norm_type(norm_type)
        max_norm = checked_max_norm(max_norm)
    except AxonError as exc:
        if spread:
            refuse_call(check, "all_reduce", exc)
        raise
    if spread:
        _same_arguments(norm_type, max_norm, check)
    inf = np.isinf(norm_type)
    # Each shard's part stays on the device; the host reads their max or sum once.
    parts = [norm_part(g, norm_type) for g in grads]
    local = (float(xp.stack(parts).max()) if inf else float(xp.stack(parts).sum())) if parts else 0.0
    value = np.array([local], dtype=np.float64)
    if shard_group is not None and shard_group.size > 1:
        all_reduce(value, ReduceOp.MAX if inf else ReduceOp.SUM, shard_group)
    total = float(value[0]) if inf else float(value[0]) ** (1.0 / norm_type)
    scale_to_norm(list(grads) + list(uncounted), total, max_norm)
    return total


def _same_arguments(norm_type: float, max_norm: float, group: Any) -> None:
    """Every rank of ``group`` passed this ``norm_type`` and ``max_norm``, else all raise alike.

    Ranks with another p would add other powers into one sum (and another ``max_norm`` clip by another
    factor): every rank would get a norm, and the replicas would drift apart. One MAX all-reduce of
    ``[p, -p, m, -m]`` (32 bytes, once a step) shows the largest and smallest of each.
    """
    words = np.array([norm_type, -norm_type, max_norm, -max_norm], dtype=np.float64)
    all_reduce(words, ReduceOp.MAX, group)
    if words[0] == -words[1] and words[2] == -words[3]:
        return
    raise everywhere(CollectiveMismatchError(
        f"clip_grad_norm on group {group.name}: the ranks passed different arguments (norm_type from {-words[1]:g} "
        f"to {words[0]:g}, max_norm from {-words[3]:g} to {words[2]:g}); every rank must clip by the same norm"),
        group.ranks)


__all__ = ["clip_grad_norm"]
