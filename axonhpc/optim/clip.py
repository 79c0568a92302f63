"""Gradient norm clipping, as torch.nn.utils.clip_grad_norm_."""
from __future__ import annotations

import math
from typing import Any, Iterable, Union

from .._dtypes import array_module, is_cupy_array
from ..cuda import capture
from ..errors import InvalidArgumentError


def checked_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float, refused unless positive (``float("inf")`` is the largest absolute value).

    Raises:
        InvalidArgumentError: ``norm_type`` is not positive (a ``ValueError``).
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise InvalidArgumentError(f"clip_grad_norm norm_type must be positive, got {norm_type}")
    return norm_type


def scale_to_norm(grads: Iterable[Any], total: float, max_norm: float) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``, ``total`` being their joint norm."""
    clip_coef = min(float(max_norm) / (total + 1e-6), 1.0)
    if clip_coef < 1.0:
        for g in grads:
            g *= clip_coef


def clip_grad_norm(params: Union[Any, Iterable[Any]], max_norm: float, norm_type: float = 2.0) -> float:
    """Scale gradients in place so that their joint norm is at most ``max_norm``.

    The norm is taken over all gradients together, as if concatenated; they
    are multiplied by min(1, max_norm / (total_norm + 1e-6)). Parameters
    without a gradient are skipped.

    Args:
        params: a Parameter or an iterable of Parameters.
        max_norm: largest allowed norm.
        norm_type: p of the p-norm; ``float("inf")`` for the largest absolute value.

    Returns:
        The total norm before clipping, as a float (0.0 if no parameter has a gradient).
        Inside a graphed step (``axonhpc.cuda.graphs``) on device arrays, a 0-d float64 device
        array: the scale is then computed on the device and every gradient is multiplied
        by it (by 1.0 where there is nothing to clip, which changes no value).

    Raises:
        ValueError: norm_type is not positive.
    """
    if hasattr(params, "data") and hasattr(params, "grad"):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = checked_norm_type(norm_type)
    if not grads:
        return 0.0
    xp = array_module(grads[0])
    if math.isinf(norm_type):
        # Each gradient's largest magnitude stays on the device; one read for all of them.
        total = xp.stack([xp.abs(g).max() if g.size else xp.zeros((), dtype=g.dtype) for g in grads]).max()
    else:
        # Per-gradient norms first, then the norm of those: one pass over each array.
        norms = xp.stack([xp.linalg.norm(g.reshape(-1), norm_type) for g in grads])
        total = xp.linalg.norm(norms, norm_type)
    if capture.defers_reads() and is_cupy_array(total):
        return scale_on_device(grads, total, max_norm)
    total = float(total)
    scale_to_norm(grads, total, max_norm)
    return total


def scale_on_device(grads: Iterable[Any], total: Any, max_norm: float) -> Any:
    """``scale_to_norm`` without reading ``total`` (a 0-d device array): the same numbers, computed on the device.

    The coefficient is computed in float64 as the host computes it, then rounded to each
    gradient's dtype as a Python float is; where it is 1 the multiplication changes nothing.

    Returns:
        ``total`` as a 0-d float64 device array.
    """
    xp = array_module(total)
    total = total.astype("float64")
    coef = xp.fmin(float(max_norm) / (total + 1e-6), 1.0)
    for g in grads:
        g *= coef.astype(g.dtype)
    return total


__all__ = ["clip_grad_norm", "checked_norm_type", "scale_to_norm", "scale_on_device"]
