"""Gradient norm clipping, as torch.nn.utils.clip_grad_norm_."""
from __future__ import annotations

import math
from typing import Any, Iterable, Union

from .._dtypes import array_module, is_cupy_array
from ..cuda import capture
from ..errors import InvalidArgumentError


def checked_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float, or InvalidArgumentError (a ``ValueError``) unless a positive number (``inf`` allowed)."""
    value = _number(norm_type, "norm_type")
    if not value > 0:
        raise InvalidArgumentError(f"clip_grad_norm norm_type must be positive, got {norm_type!r}")
    return value


def checked_max_norm(max_norm: Any) -> float:
    """``max_norm`` as a float, or InvalidArgumentError (a ``ValueError``) unless a number."""
    return _number(max_norm, "max_norm")


def _number(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"clip_grad_norm {name} must be a number, got {value!r}") from None


def scale_to_norm(grads: Iterable[Any], total: float, max_norm: float) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``, ``total`` being their joint norm."""
    clip_coef = min(float(max_norm) / (total + 1e-6), 1.0)
    if clip_coef < 1.0:
        for g in grads:
            g *= clip_coef


def clip_grad_norm(params: Union[Any, Iterable[Any]], max_norm: float, norm_type: float = 2.0) -> float:
    """Scale gradients in place so that their joint norm is at most ``max_norm``.

    The norm is over all gradients together, as if concatenated; they are multiplied by ``min(1, max_norm /
    (total_norm + 1e-6))``, and parameters without a gradient are skipped. ``norm_type`` is p (``inf`` for the
    largest absolute value); InvalidArgumentError (a ``ValueError``) unless positive, or if ``max_norm`` is not a
    number.

    Returns the total norm before clipping (0.0 without gradients). Inside a graphed step on device arrays it is
    a 0-d float64 device array, and the scale is computed on the device (1.0 where nothing is clipped).
    """
    if hasattr(params, "data") and hasattr(params, "grad"):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = checked_norm_type(norm_type)
    max_norm = checked_max_norm(max_norm)
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
    """``scale_to_norm`` without reading ``total`` (a 0-d device array); returns ``total`` as float64.

    The coefficient is computed in float64 as the host computes it, then rounded to each gradient's dtype, so
    the numbers are the same.
    """
    xp = array_module(total)
    total = total.astype("float64")
    coef = xp.fmin(float(max_norm) / (total + 1e-6), 1.0)
    for g in grads:
        g *= coef.astype(g.dtype)
    return total


__all__ = ["clip_grad_norm", "checked_norm_type", "checked_max_norm", "scale_to_norm", "scale_on_device"]
