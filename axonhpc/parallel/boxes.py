"""Where each array a rank holds lies in the whole model: the boxes layout-free checkpoints and recovery use.

A box is ``(global shape, offset)`` of a local array in the whole model's
array of that name. Replicated parameters are the whole array; a tensor-parallel
layer's are its rows or columns; an FSDP flat shard holds C-order spans of
several parameters (``fsdp_boxes``).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..nn import Checkpoint, Module
from .split import split_parameters


def dense_names(module: Module) -> Dict[str, str]:
    """Each parameter name of ``module`` -> the name without the ``module.`` parts that ``nn.Checkpoint`` adds."""
    wrapped = sorted((name + "." if name else "" for name, m in module.named_modules() if isinstance(m, Checkpoint)),
                     key=len, reverse=True)
    out = {}
    for name, _ in module.named_parameters():
        dense = name
        for prefix in wrapped:
            if dense.startswith(prefix + "module."):
                dense = prefix + dense[len(prefix) + len("module."):]
        out[name] = dense
    return out


def parameter_boxes(module: Module, local_shapes: Optional[Mapping[int, Tuple[int, ...]]] = None
                    ) -> Dict[str, Tuple[str, Tuple[int, ...], Tuple[int, ...]]]:
    """Where each parameter of ``module`` lies in the whole model: name -> (whole-model name, global shape, offset).

    A column-parallel layer's weight and bias are its rows of the full ones
    (offset along axis 0), a row-parallel layer's weight its columns (offset
    along axis 1); every other parameter is the whole array (replicated).

    Args:
        module: a model or a part of one (a ``gpt_part``, a tensor-parallel block).
        local_shapes: ``id(Parameter)`` -> its shape, for parameters whose
            ``data`` FSDP has released (None: every ``data`` is in place).

    Returns:
        A dict in ``named_parameters`` order.
    """
    split = split_parameters(module)
    names = dense_names(module)
    out = {}
    for name, p in module.named_parameters():
        shape = tuple(local_shapes[id(p)]) if local_shapes is not None and id(p) in local_shapes else p.data.shape
        shape, offset = list(shape), [0] * len(shape)
        if id(p) in split:  # the group's ranks hold equal consecutive blocks along the axis
            layer, axis = split[id(p)]
            offset[axis] = layer.group.rank * shape[axis]
            shape[axis] *= layer.group.size
        out[name] = (names[name], tuple(shape), tuple(offset))
    return out


def fsdp_boxes(module: Module, units: Sequence[Any], shard_rank: Optional[int] = None,
               shards: Optional[Sequence[Any]] = None) -> Dict[str, Tuple[Any, ...]]:
    """The boxes of FSDP's flat shards over ``module``: whole-model name -> ``(global shape, offset, shard, span)``.

    ``span`` is ``(local shape, start, stop, at)``: elements ``[start, stop)`` of
    the C-order flattening of the block of ``local shape`` at ``offset`` are
    ``shard.data[at:at + stop - start]``; a name the shards hold nothing of is
    left out. ``shard_rank`` and ``shards`` describe dp rank ``shard_rank``'s
    shards instead, held in ``shards`` (one flat Parameter per unit): a copy kept elsewhere.
    """
    shapes = {id(p): tuple(shape) for u in units for p, shape in zip(u.params, u.layout.shapes)}
    params = dict(module.named_parameters())
    boxes = {id(params[name]): box for name, box in parameter_boxes(module, shapes).items()}
    out: Dict[str, Tuple[Any, ...]] = {}
    for k, unit in enumerate(units):
        spans = unit.held_spans() if shard_rank is None else unit.flat.spans(shard_rank)
        shard = unit.shard if shards is None else shards[k]
        for i, start, stop, at in spans:
            dense, shape, offset = boxes[id(unit.params[i])]
            out[dense] = (shape, offset, shard, (unit.layout.shapes[i], start, stop, at))
    return out


def replicated_boxes(module: Module) -> Dict[str, Tuple[Any, ...]]:
    """The boxes of ``module``'s own parameters: whole-model name -> ``(global shape, offset, Parameter)``."""
    params = dict(module.named_parameters())
    return {dense: (shape, offset, params[name]) for name, (dense, shape, offset) in parameter_boxes(module).items()}


__all__ = ["dense_names", "parameter_boxes", "fsdp_boxes", "replicated_boxes"]
