"""Gradient norm clipping, as torch.nn.utils.clip_grad_norm_.

[Note: a non-finite norm]
A gradient holding an inf or a NaN makes the norm inf or NaN. torch (``error_if_nonfinite=False``) then
multiplies every gradient by 0 (an inf norm) or by NaN: the first hides the overflow in a step that does
nothing, the second spreads the NaN into every parameter. Here the gradients are left as they are and the
non-finite norm is returned: the caller sees it (and ``GradScaler`` or ``skip_nonfinite_steps`` see the
gradients) and can skip the step.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence, Union

import numpy as np

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
    """``max_norm`` as a float, or InvalidArgumentError (a ``ValueError``) unless a number other than NaN."""
    value = _number(max_norm, "max_norm")
    if math.isnan(value):  # no norm is at most NaN: torch would scale every gradient by NaN
        raise InvalidArgumentError(f"clip_grad_norm max_norm must not be NaN, got {value!r}")
    return value


def _number(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"clip_grad_norm {name} must be a number, got {value!r}") from None


_CHUNK = 1 << 17  # elements of a host gradient widened to float64 at a time: 1 MiB, which stays in cache


def _sum_of_squares(g: Any, xp: Any) -> Any:
    """sum g^2 of a flat array, accumulated in float64, as a 0-d float64 array of ``xp``.

    On the host one BLAS dot, a gradient of another dtype widened a chunk at a time into one small buffer
    rather than copied whole; on a device a widened copy, squared and summed.
    """
    if xp is not np:  # no cuBLAS: a graph capture refuses it (axonhpc.cuda.graphs)
        wide = g.astype(np.float64)
        wide *= wide
        return wide.sum()
    if g.dtype == np.float64:
        return np.dot(g, g)
    buffer = np.empty(min(g.size, _CHUNK))
    total = 0.0
    for start in range(0, g.size, _CHUNK):
        part = buffer[:min(_CHUNK, g.size - start)]
        np.copyto(part, g[start:start + _CHUNK])
        total += float(part.dot(part))
    return np.asarray(total)


def norm_part(grad: Any, norm_type: float) -> Any:
    """One gradient's part of a joint norm, as a 0-d float64 array of its array module: max |g| for an infinite
    ``norm_type``, else sum |g|^p, accumulated in float64.

    In float16 a sum of squares passes 65504 (a norm of 256) and overflows to inf; in float32 a sum over
    millions of elements loses about five digits. The max (or sum) of the parts, to the power 1/p, is the norm.
    """
    xp = array_module(grad)
    if math.isinf(norm_type):  # a max is exact in any dtype
        return xp.abs(grad).max().astype(np.float64) if grad.size else xp.zeros((), dtype=np.float64)
    if norm_type == 2.0:  # the common case, on every step of a clipped run
        return _sum_of_squares(grad.reshape(-1), xp)
    g = xp.abs(grad.astype(np.float64, copy=False))  # a new array: the power in place below leaves ``grad`` alone
    if norm_type != 1.0:
        g **= norm_type
    return g.sum()


def joint_part(parts: Sequence[Any], norm_type: float) -> Any:
    """The max (an infinite ``norm_type``) or the sum of ``norm_part``'s parts: a new 0-d float64 array of their
    module, the parts added in turn. Not ``xp.stack``: cupy stacks more than 8 arrays through a table of their
    addresses copied from the host, which a CUDA graph capture refuses."""
    xp = array_module(parts[0])
    total = xp.zeros((), dtype=np.float64)  # the parts are >= 0 (or NaN, which both keep)
    for part in parts:
        if math.isinf(norm_type):
            xp.maximum(total, part, out=total)
        else:
            total += part
    return total


def scale_to_norm(grads: Iterable[Any], total: float, max_norm: float) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``, ``total`` being their joint norm;
    leave them as they are if ``total`` is inf or NaN."""
    if not math.isfinite(total):
        return  # [Note: a non-finite norm]
    clip_coef = min(float(max_norm) / (total + 1e-6), 1.0)
    if clip_coef < 1.0:
        for g in grads:
            g *= clip_coef


def clip_grad_norm(params: Union[Any, Iterable[Any]], max_norm: float, norm_type: float = 2.0) -> float:
    """Scale gradients in place so that their joint norm is at most ``max_norm``.

    The norm is over all gradients together, as if concatenated; they are multiplied by ``min(1, max_norm /
    (total_norm + 1e-6))``, and parameters without a gradient are skipped. ``norm_type`` is p (``inf`` for the
    largest absolute value); InvalidArgumentError (a ``ValueError``) unless positive, or if ``max_norm`` is not a
    number or is NaN.

    Each gradient's part of the norm is accumulated in float64, so float16 and bfloat16 gradients get the norm
    their values have (a float16 sum of squares would overflow past a norm of 256).

    Returns the total norm before clipping (0.0 without gradients). If it is inf or NaN (a gradient holds an
    inf or a NaN, or its p-th powers pass float64's range), the gradients are left unchanged and that value is
    returned, for the caller to skip the step ([Note: a non-finite norm]). Inside a graphed step on device arrays
    it is a 0-d float64 device array, and the scale is computed on the device (1.0 where nothing is clipped).
    """
    if hasattr(params, "data") and hasattr(params, "grad"):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = checked_norm_type(norm_type)
    max_norm = checked_max_norm(max_norm)
    if not grads:
        return 0.0
    # Each gradient's part stays on the device; one read for all of them.
    joint = joint_part([norm_part(g, norm_type) for g in grads], norm_type)
    total = joint if math.isinf(norm_type) else joint ** (1.0 / norm_type)
    if capture.defers_reads() and is_cupy_array(total):
        return scale_on_device(grads, total, max_norm)
    total = float(total)
    scale_to_norm(grads, total, max_norm)
    return total


def scale_on_device(grads: Iterable[Any], total: Any, max_norm: float) -> Any:
    """``scale_to_norm`` without reading ``total`` (a 0-d device array); returns ``total`` as float64.

    The coefficient is computed in float64 as the host computes it, then rounded to each gradient's dtype, so
    the numbers are the same (1.0 for a non-finite ``total``, which leaves the gradients as they are).
    """
    xp = array_module(total)
    total = total.astype("float64")
    coef = xp.where(xp.isfinite(total), xp.fmin(float(max_norm) / (total + 1e-6), 1.0), 1.0)
    for g in grads:
        g *= coef.astype(g.dtype)
    return total


__all__ = ["clip_grad_norm", "checked_norm_type", "checked_max_norm", "norm_part", "scale_to_norm", "scale_on_device"]
