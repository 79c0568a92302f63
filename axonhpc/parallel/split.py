"""Which parameters of a model its layers split over a group of their own: ``split_parameters``.

A tensor-parallel layer (``tensor.ColumnParallelLinear``, ``tensor.RowParallelLinear`` and the blocks built
of them) holds part of a parameter on each rank of its group, and says which, and along which axis, with
``split_axes()``. Clipping (a norm over the parts) and checkpoints (each rank's box of the whole array) need
that, whatever strategy holds the layer, so it lives here rather than in ``tensor``, which the other
strategies may not import.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple


def split_parameters(module: Any) -> Dict[int, Tuple[Any, int]]:
    """The parameters of ``module`` that its layers split: ``id(Parameter)`` -> (layer, axis).

    Each layer's ``split_axes``: a column-parallel layer's weight and bias along axis 0 (its output rows), a
    row-parallel layer's weight along axis 1 (its input columns). Every other parameter, a row-parallel bias
    or a norm layer's, is whole and the same on every rank of the layer's group.
    """
    out = {}
    for _, m in module.named_modules():
        axes = getattr(type(m), "split_axes", None)
        if callable(axes):
            out.update((id(p), (m, axis)) for p, axis in m.split_axes())
    return out


__all__ = ["split_parameters"]
