"""``clip_grad_norm``: clip a model's gradients by the norm of the whole model, however a strategy split it.

[Note: one norm for a split model]
``optim.clip_grad_norm`` clips by the norm of the gradients it is given. Where each rank holds only a part
of the model's gradients, that is a different norm, and so a different factor, on every rank: the model's
copies then drift apart, and none of them is clipped as the unsplit model would be. The global norm sums
each element's p-th power once over the ranks that hold the parts (a max for ``inf``): FSDP's shards over
their shard group (``fsdp.clip_grad_norm``), a pipeline's stages over its group (``pipe.clip_grad_norm``;
stages of tensor-parallel layers over their group first),
and a tensor-parallel model's layers over their group, where a column-parallel layer's weight and bias and
a row-parallel layer's weight are each rank's own rows or columns and every other parameter (a row-parallel
bias, a norm layer) is the same on every rank of the group, counted on its rank 0. DDP's gradients are the
same on every rank after the reduction, so its module is clipped as one process would (TP layers inside
counted as above).
"""
from __future__ import annotations

from typing import Any

from ..errors import ArgumentTypeError
from ..nn import Module
from ..optim import clip_grad_norm as clip_local
from .ddp import DDP
from .fsdp import FSDP
from .grad_norm import clip_grad_norm as clip_spread, counted_here, tensor_group
from .pipeline import Pipeline
from .split import split_parameters


def clip_grad_norm(model: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale ``model``'s gradients in place so that the norm of the whole model's is at most ``max_norm``;
    returns that norm before clipping, the same on every rank ([Note: one norm for a split model]).

    ``model`` is an ``FSDP``, a ``Pipeline``, a ``DDP``, or a module (tensor-parallel layers in it are counted
    over their group). Collective over the ranks that split it; call it after the backward (and, for a
    pipeline, ``train_step``) and before the optimizer's step.

    Raises:
        InvalidArgumentError: a non-positive ``norm_type`` or a ``max_norm`` that is not a number (on every rank
            of the group that would reduce).
        ConfigurationError: tensor-parallel layers over more than one group.
        ArgumentTypeError: ``model`` is none of these.
    """
    if isinstance(model, (FSDP, Pipeline)):
        return model.clip_grad_norm(max_norm, norm_type)
    module = model.module if isinstance(model, DDP) else model
    if not isinstance(module, Module):
        raise ArgumentTypeError(f"clip_grad_norm takes an FSDP, a Pipeline, a DDP or an axonhpc.nn.Module, got "
                                f"{type(model).__name__}")
    split = split_parameters(module)
    group = tensor_group(split, "clip_grad_norm")
    if group is None:
        return clip_local(module.parameters(), max_norm, norm_type)
    counted, elsewhere = counted_here(module.parameters(), split, group)
    return clip_spread(counted, max_norm, norm_type, elsewhere, sum_over=[group])


__all__ = ["clip_grad_norm"]
