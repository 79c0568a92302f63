"""Fused optimizer updates on the device: one elementwise kernel a parameter instead of one per operation.

[Note: fused updates]
On numpy the update of ``Adam`` or ``SGD`` is a dozen array operations, each a
pass over the parameter's memory. On cupy each of them is also a kernel
launch: Adam reads and writes 31 arrays' worth of memory a parameter, where
one kernel that reads the gradient, the parameter and the two moments and
writes back three needs 7. Here each update is one cupy ``ElementwiseKernel``
whose body performs the same operations in the same order, in the
parameter's dtype, with the hyperparameters rounded to that dtype as numpy
and cupy round a Python float against an array. It is compiled with
``--fmad=false``, so NVRTC does not contract a multiply and an add into one
rounding, and IEEE division and square root (NVRTC's defaults): the fused
update is then the unfused one bit for bit. That is what the tests check,
against the strict stand-in (which compiles the same bodies as C on the host)
and on a GPU.

The choice is made for each parameter at each step (``fuses``: a type and
dtype test, no device work): cupy arrays of float32 or float64 with a
gradient of the same kind take the kernel. Host arrays, 16-bit floats (no
half-precision kernel is written: mixed precision keeps float32 master
weights) and optimizers built with ``fused=False`` keep the array code. The
kernels are built on first use and kept per array module and variant.

Bodies are written in the common part of CUDA C++ and C99 with <tgmath.h>
(arithmetic, ``sqrt``, casts), so the stand-in can compile them on a machine
without CUDA.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .._dtypes import array_module
from ..errors import ConfigurationError

# Compile options: no multiply-add contraction, so every operation rounds as the unfused array code does.
OPTIONS = ("--fmad=false",)
FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_kernels: Dict[Tuple[Any, str, Tuple[bool, ...]], Any] = {}  # (array module, name, variant) -> kernel
_lock = threading.Lock()


def has_kernels(xp: Any) -> bool:
    """Whether ``xp`` (an array module) compiles elementwise kernels: cupy does, numpy does not."""
    return xp is not np and hasattr(xp, "ElementwiseKernel")


def _refusal(data: Any) -> Optional[str]:
    """Why the kernels do not serve ``data``, or None when they do."""
    if not has_kernels(array_module(data)):
        return "is a host array (fused kernels are for cupy arrays)"
    if np.dtype(data.dtype) not in FUSED_DTYPES:
        return f"has dtype {np.dtype(data.dtype).name} (fused kernels are for float32 and float64)"
    return None


def check_fused(fused: Optional[bool], params: Any, owner: str) -> Optional[bool]:
    """Validate an optimizer's ``fused`` argument against its parameters (at construction).

    Returns:
        ``fused`` as None, True or False.

    Raises:
        ConfigurationError: ``fused`` is not None or a bool, or ``fused=True`` with a
            parameter the kernels do not serve (named with its index and shape).
    """
    if fused is not None and not isinstance(fused, (bool, np.bool_)):
        raise ConfigurationError(f"{owner} fused must be None, True or False, got {fused!r}")
    if fused:
        for i, p in enumerate(params):
            reason = _refusal(p.data)
            if reason is not None:
                raise ConfigurationError(f"{owner}(fused=True): parameter {i} of shape {tuple(p.data.shape)} "
                                         f"{reason}; pass fused=None to fuse where possible, or fused=False")
    return None if fused is None else bool(fused)


def fuses(fused: Optional[bool], data: Any, grad: Any) -> bool:
    """Whether this step updates ``data`` from ``grad`` with the fused kernel (see the module note).

    Raises:
        ConfigurationError: ``fused=True`` and ``data`` or ``grad`` is (now) an array the kernel
            does not serve.
    """
    if fused is False:
        return False
    reason = _refusal(data)
    if reason is None and (type(grad) is not type(data) or grad.dtype != data.dtype or grad.shape != data.shape):
        reason = (f"has a gradient of another kind ({type(grad).__name__} of {np.dtype(grad.dtype).name}, "
                  f"shape {tuple(grad.shape)})")
    if reason is not None and fused:
        raise ConfigurationError(f"fused=True: a parameter of shape {tuple(data.shape)} {reason}")
    return reason is None


def _kernel(xp: Any, name: str, flags: Tuple[bool, ...], build) -> Any:
    key = (xp, name, flags)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                in_params, out_params, body = build(*flags)
                kernel = xp.ElementwiseKernel(in_params, out_params, body, f"axonhpc_{name}", options=OPTIONS)
                _kernels[key] = kernel
    return kernel


def _adam_source(l2: bool, decoupled: bool) -> Tuple[str, str, str]:
    """Adam's update in the order of ``Adam._update`` (torch's): lerp, second moment, denominator, step."""
    lines = []
    if l2:
        lines.append("T g = grad + weight_decay * param;")
    else:
        lines.append("T g = grad;")
    if decoupled:
        lines.append("param = param * decay;")
    lines += [
        "exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg);",
        "exp_avg_sq = exp_avg_sq * beta2;",
        "exp_avg_sq = exp_avg_sq + one_minus_beta2 * (g * g);",
        "T denom = sqrt(exp_avg_sq) / sqrt_bias_correction2;",
        "denom = denom + eps;",
        "T update = exp_avg / denom;",
        "update = update * step_size;",
        "param = param - update;",
    ]
    return ("T grad, T weight_decay, T decay, T one_minus_beta1, T beta2, T one_minus_beta2, "
            "T sqrt_bias_correction2, T eps, T step_size",
            "T param, T exp_avg, T exp_avg_sq", "\n".join(lines))


def adam(xp: Any, data: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, *, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, decoupled: bool, step: int) -> None:
    """One Adam/AdamW update of ``data`` and its moments in place, in one kernel (see the module note)."""
    t = data.dtype.type
    l2 = weight_decay != 0 and not decoupled
    shrink = weight_decay != 0 and decoupled
    kernel = _kernel(xp, "adam", (l2, shrink), _adam_source)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    kernel(grad, t(weight_decay), t(1 - lr * weight_decay), t(1 - beta1), t(beta2), t(1 - beta2),
           t(math.sqrt(bias_correction2)), t(eps), t(lr / bias_correction1), data, exp_avg, exp_avg_sq)


def _sgd_source(l2: bool, momentum: bool, first: bool, dampened: bool, nesterov: bool) -> Tuple[str, str, str]:
    """SGD's update in the order of ``SGD._update`` (torch's)."""
    lines = ["T g = grad + weight_decay * param;" if l2 else "T g = grad;"]
    if momentum:
        if first:
            lines.append("buf = g;")
        else:
            lines.append("buf = buf * momentum;")
            lines.append("buf = buf + one_minus_dampening * g;" if dampened else "buf = buf + g;")
        lines.append("T d = g + momentum * buf;" if nesterov else "T d = buf;")
    else:
        lines.append("T d = g;")
    lines.append("param = param - lr * d;")
    return ("T grad, T weight_decay, T momentum, T one_minus_dampening, T lr",
            "T param, T buf" if momentum else "T param", "\n".join(lines))


def sgd(xp: Any, data: Any, grad: Any, buf: Any, *, lr: float, momentum: float, dampening: float,
        weight_decay: float, nesterov: bool, first: bool) -> None:
    """One SGD update of ``data`` (and its momentum buffer ``buf``, when momentum is on) in one kernel.

    ``first``: ``buf`` is new and takes the gradient, as torch's first momentum step does. Without
    momentum ``buf`` is None.
    """
    t = data.dtype.type
    flags = (weight_decay != 0, momentum != 0, bool(first), dampening != 0, bool(nesterov))
    kernel = _kernel(xp, "sgd", flags, _sgd_source)
    outputs = (data, buf) if momentum != 0 else (data,)
    kernel(grad, t(weight_decay), t(momentum), t(1 - dampening), t(lr), *outputs)


__all__ = ["OPTIONS", "FUSED_DTYPES", "has_kernels", "check_fused", "fuses", "adam", "sgd"]
