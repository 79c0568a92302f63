"""Device elementwise kernels, built once and kept: what ``optim.fused`` and ``nn.kernels`` share.

[Note: exact fused kernels]
A fused kernel performs, in one pass over memory, the operations the array
code performs one kernel at a time, in the same order and the same dtype,
with every Python float rounded to that dtype as numpy and cupy round a
Python float against an array. It is compiled with ``--fmad=false``
(``OPTIONS``), so NVRTC never contracts a multiply and an add into one
rounding, and with IEEE division and square root (NVRTC's defaults). The
result is then the array code's bit for bit on the same GPU: the
transcendental functions (``exp``, ``tanh``) are the same CUDA functions cupy's
own kernels call.

Bodies and preambles are written in the common part of CUDA C++ and C99 with
``<tgmath.h>``: arithmetic, ``?:``, casts, the overloaded math functions, and
helpers marked ``__device__``. The strict stand-in of the tests compiles them
as C on the host, where ``exp`` and ``tanh`` are the C library's (a few ulp
from numpy's), and arithmetic and ``sqrt`` round exactly as on a GPU.

Kernels are built on first use and cached by array module, name and variant
(the flags that select the body), so a stand-in module never meets the
kernels of another.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Tuple

import numpy as np

from ._dtypes import array_module

# Compile options: no multiply-add contraction, so every operation rounds as the array code does.
OPTIONS = ("--fmad=false",)
# The dtypes the kernels are written for; 16-bit floats keep the array code.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_cache: Dict[Tuple[Any, str, Tuple[Any, ...]], Any] = {}  # (array module, name, variant) -> kernel
_lock = threading.Lock()

Source = Tuple[str, str, str, str]  # in_params, out_params, operation, preamble


def has_kernels(xp: Any) -> bool:
    """Whether ``xp`` (an array module) compiles elementwise kernels: cupy does, numpy does not."""
    return xp is not np and hasattr(xp, "ElementwiseKernel")


def serves(x: Any) -> bool:
    """Whether the kernels serve array ``x``: a cupy array of float32 or float64 (a type test, no device work)."""
    return np.dtype(x.dtype) in KERNEL_DTYPES and has_kernels(array_module(x))


def elementwise(xp: Any, name: str, variant: Tuple[Any, ...], build: Callable[..., Source]) -> Any:
    """The ``ElementwiseKernel`` ``axonhpc_<name>`` of ``build(*variant)``, built on first use and kept.

    Args:
        xp: the array module (cupy, or the tests' stand-in).
        name: the kernel's name, unique per ``build``.
        variant: hashable flags passed to ``build``; each distinct tuple is its own kernel.
        build: returns ``(in_params, out_params, operation, preamble)``.
    """
    key = (xp, name, variant)
    kernel = _cache.get(key)
    if kernel is None:
        with _lock:
            kernel = _cache.get(key)
            if kernel is None:
                in_params, out_params, body, preamble = build(*variant)
                kernel = xp.ElementwiseKernel(in_params, out_params, body, f"axonhpc_{name}", preamble=preamble,
                                              options=OPTIONS)
                _cache[key] = kernel
    return kernel


def launches(xp: Any, names: Any = None) -> int:
    """Launches so far of the kept kernels of ``xp`` (optionally only those named in ``names``).

    Counts what the kernel objects count: the tests' stand-in keeps a ``calls``
    counter; cupy's kernels have none and count 0.
    """
    return sum(getattr(k, "calls", 0) for (module, name, _), k in list(_cache.items())
               if module is xp and (names is None or name in names))


def kept(xp: Any) -> Dict[Tuple[str, Tuple[Any, ...]], Any]:
    """The kept kernels of ``xp`` by ``(name, variant)`` (for tests and diagnostics)."""
    return {(name, variant): k for (module, name, variant), k in list(_cache.items()) if module is xp}


__all__ = ["OPTIONS", "KERNEL_DTYPES", "has_kernels", "serves", "elementwise", "launches", "kept"]
