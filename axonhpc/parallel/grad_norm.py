"""Gradient norm clipping over gradients spread across a group: the global norm from the parts, one reduction.

When each gradient element lives on exactly one rank of the group (FSDP's shards over the shard group, whose
HYBRID_SHARD replicas hold the same shards; a pipeline's stages over its ranks, a tied Parameter counted on
one of its holders), the parts' p-th power sums (or max, for inf) reduced over the group give the norm
single-process ``optim.clip_grad_norm`` computes. A model split two ways (a pipeline's stages holding
tensor-parallel layers) sums twice: over the stage's tensor-parallel group, then over the pipeline.

[Note: a refusal across groups]
The arguments are compared over each group in turn, and a rank that refuses (a bad ``max_norm``, or a
refusal its caller found) tells each of its groups. Its peers of the first group learn it there, from the
argument check they entered, and tell their later groups in the same way, so with a tensor-parallel group
and then a pipeline every rank of the mesh raises, none waits in a group its peers left.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends import ReduceOp
from ..collectives import all_reduce
from ..collectives.core import refuse_call
from ..errors import AxonError, CollectiveMismatchError, ConfigurationError, everywhere
from ..optim.clip import checked_max_norm, checked_norm_type, joint_part, norm_part, scale_to_norm


def clip_grad_norm(grads: List[Any], max_norm: float, norm_type: float, uncounted: Sequence[Any] = (),
                   sum_over: Sequence[Any] = (), check_over: Optional[Sequence[Any]] = None,
                   problem: Optional[AxonError] = None) -> float:
    """Scale this rank's gradients (its part of them all) in place so the global norm is at most ``max_norm``;
    returns the norm.

    ``sum_over``: the groups the norm's parts are summed over, in turn (a tensor-parallel group, then a
    pipeline's: a stage's total, then the model's); ``check_over``: the groups the arguments are compared
    over, in turn (None: ``sum_over``; FSDP's replicas hold the same shards and must clip them alike). None
    entries and one-rank groups are skipped. ``norm_type`` is p (``inf`` for the max); ``uncounted``: more
    gradients scaled alike but counted on another rank (a copy of a tied or replicated Parameter).

    Raises:
        InvalidArgumentError (a ``ValueError``): ``norm_type`` not positive, ``max_norm`` not a number or NaN,
            before anything is sent; or ``problem``, a refusal the caller found. The other ranks raise
            ``CollectiveRefusedError`` naming this rank, from the argument check of the first group they share
            with it, and pass it on through the groups after it ([Note: a refusal across groups]).
        CollectiveMismatchError: the ranks of a group passed different arguments (on every rank, alike).
    """
    checks = [g for g in (sum_over if check_over is None else check_over) if g is not None and g.size > 1]
    try:
        norm_type = checked_norm_type(norm_type)
        max_norm = checked_max_norm(max_norm)
    except AxonError as exc:
        problem = problem or exc
    for group in checks:
        if problem is None:
            try:
                _same_arguments(norm_type, max_norm, group)
            except AxonError as exc:
                problem = exc
        else:
            try:
                refuse_call(group, "all_reduce", problem)
            except AxonError:
                pass  # raised below, once every group has heard
    if problem is not None:
        raise problem
    inf = np.isinf(norm_type)
    # Each shard's part stays on the device; the host reads their max or sum once.
    parts = [norm_part(g, norm_type) for g in grads]
    local = float(joint_part(parts, norm_type)) if parts else 0.0
    value = np.array([local], dtype=np.float64)
    for group in sum_over:
        if group is not None and group.size > 1:
            all_reduce(value, ReduceOp.MAX if inf else ReduceOp.SUM, group)
    total = float(value[0]) if inf else float(value[0]) ** (1.0 / norm_type)
    scale_to_norm(list(grads) + list(uncounted), total, max_norm)
    return total


def tensor_group(split: Dict[int, Tuple[Any, int]], what: str) -> Any:
    """The one group of the tensor-parallel layers ``split`` came from (``split.split_parameters``), or None.

    Raises:
        ConfigurationError: their layers use more than one group.
    """
    groups = {id(layer.group): layer.group for layer, _ in split.values()}
    if len(groups) > 1:
        names = sorted(g.name for g in groups.values())
        raise ConfigurationError(f"{what}: the tensor-parallel layers use {len(groups)} groups ({names}); one norm "
                                 f"over them needs a single tensor-parallel group")
    return next(iter(groups.values()), None)


def counted_here(params: Sequence[Any], split: Dict[int, Tuple[Any, int]], group: Any,
                 elsewhere: Any = ()) -> Tuple[List[Any], List[Any]]:
    """``(gradients counted on this rank, gradients scaled here but counted on another)`` of ``params``.

    A parameter split over the tensor-parallel ``group`` is counted on every rank of it (each holds its own
    part); any other is whole and the same on every rank of the group, so counted on group rank 0 alone; one
    whose id is in ``elsewhere`` (a tied copy) is counted where its other copy is.
    """
    counted, uncounted = [], []
    for p in params:
        if p.grad is None:
            continue
        mine = id(p) not in elsewhere and (group is None or id(p) in split or group.rank == 0)
        (counted if mine else uncounted).append(p.grad)
    return counted, uncounted


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


__all__ = ["clip_grad_norm", "counted_here", "tensor_group"]
