"""Element-wise activations: ReLU, GELU, Tanh."""
from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import array_module, bfloat16_dtype, is_floating, is_low_precision_float
from ..errors import ConfigurationError
from . import kernels
from .autocast import like
from .functional import erf
from .module import Module

_INV_SQRT2 = kernels.INV_SQRT2
_INV_SQRT_2PI = kernels.INV_SQRT_2PI
_SQRT_2_OVER_PI = kernels.SQRT_2_OVER_PI
_TANH_COEF = kernels.TANH_COEF
_BFLOAT16 = bfloat16_dtype()  # None without ml_dtypes


def _opmath(x: Any) -> Any:
    """``x`` in float32 when it is a 16-bit float (float16, bfloat16), else as it is.

    ml_dtypes' bfloat16 times a Python float is float32, and float16 arithmetic
    rounds at every step: both are avoided by computing in float32 and
    rounding the result once to the input's dtype.
    """
    return x.astype(np.float32) if is_low_precision_float(x.dtype) else x


def _rounded(out: Any, dtype: Any) -> Any:
    """``out`` in the floating input's ``dtype`` (None: an integer input, left as computed)."""
    return out if dtype is None else like(out, dtype)


def _select(cond: Any, a: Any, b: Any, x: Any) -> Any:
    """``where(cond, a, b)`` for ``x`` and the int 0 as ``a`` and ``b``, in ``x``'s dtype.

    cupy's ``where`` has no bfloat16 loop: it selects in float32 and returns float32, so a ReLU under bfloat16
    autocast handed the next layer float32 to cast back, and its backward float32 gradients (on an H200 a
    4-layer MLP's bfloat16 step spent 0.44 of its 2.3 ms of device time in casts to bfloat16). A bfloat16
    array is selected as its bits instead: +0.0 is the bit pattern 0.
    """
    xp = array_module(x)
    if _BFLOAT16 is None or x.dtype != _BFLOAT16:
        return xp.where(cond, a, b)
    bits = x.view(np.uint16)
    return xp.where(cond, bits if a is x else a, bits if b is x else b).view(x.dtype)


class ReLU(Module):
    """max(x, 0), NaN passing; the gradient at 0 is taken as 0, as in PyTorch.

    On cupy float32/float64 arrays the forward is one kernel (``nn.kernels``).
    """

    takes_arrays = True

    def forward(self, x: Any) -> Any:
        """Apply ReLU element-wise."""
        if kernels.takes_kernels(x):
            y, mask = kernels.relu_forward(x)
            self._save_cache(mask)
            return y
        # Selects, not ``x * (x > 0)``: -inf * 0 is NaN and -1 * 0 is -0.0, where PyTorch gives +0.0. As in
        # PyTorch, a NaN passes (its gradient too) and -0.0 stays -0.0.
        mask = ~(x <= 0)
        self._save_cache(mask)
        return _select(x < 0, 0, x, x)

    def fused_bias_forward(self, pre: Any, bias: Any) -> Any:
        """``forward(pre + bias)`` with the add in the same kernel (``Linear(activation="relu")`` on cupy).

        The caller has checked ``kernels.takes_kernels(pre, bias)``; ``pre`` is a fresh product and is overwritten.
        """
        y, mask = kernels.bias_relu(pre, bias)
        self._save_cache(mask)
        return y

    def backward(self, grad_out: Any) -> Any:
        """Pass the gradient where the input was positive (or NaN), +0.0 elsewhere (an inf or NaN there included)."""
        return _select(self._pop_cache(), grad_out, 0, grad_out)


class Tanh(Module):
    """Hyperbolic tangent (on cupy float32/float64 arrays the backward is one kernel)."""

    takes_arrays = True

    def forward(self, x: Any) -> Any:
        """Apply tanh element-wise."""
        y = array_module(x).tanh(x)
        self._save_cache(y)
        return y

    def backward(self, grad_out: Any) -> Any:
        """d tanh(x)/dx = 1 - tanh(x)^2."""
        y = self._pop_cache()
        if kernels.takes_kernels(y, grad_out):
            return kernels.tanh_backward(grad_out, y)
        return grad_out * (1 - y * y)


class GELU(Module):
    """Gaussian error linear unit, x * Phi(x), as PyTorch's ``nn.GELU``.

    Args:
        approximate: "none" (default) for the exact form 0.5 x (1 + erf(x / sqrt 2)),
            computed with a Cody rational erf accurate to ~1e-16 in float64 and
            ~1e-7 in float32 (see ``axonhpc.nn.functional``); or "tanh" for
            0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), which differs
            from the exact form by up to ~3e-4 (absolute, near |x| = 2).

    On cupy float32/float64 arrays the forward and the backward are one kernel
    each (``nn.kernels``), the array code's result bit for bit.

    Raises:
        ConfigurationError: another ``approximate`` value.
    """

    takes_arrays = True

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ConfigurationError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Any) -> Any:
        """Apply GELU element-wise (16-bit floats computed in float32 and rounded once, as PyTorch does)."""
        if kernels.takes_kernels(x):
            y, aux = kernels.gelu_forward(x, self.approximate == "tanh")
            self._save_cache((x, aux, x.dtype))
            return y
        xp = array_module(x)
        dtype = x.dtype if is_floating(x.dtype) else None  # integers give float64, as before
        x = _opmath(x)
        if dtype is not None and kernels.takes_host_kernels(x):  # a 16-bit input, in float32 by the kernel
            y, aux = kernels.gelu_forward(x, self.approximate == "tanh")
            self._save_cache((x, aux, dtype))
            return _rounded(y, dtype)
        if self.approximate == "tanh":
            t = xp.tanh(_SQRT_2_OVER_PI * (x + _TANH_COEF * x * x * x))
            self._save_cache((x, t, dtype))
            return _rounded(0.5 * x * (1 + t), dtype)
        cdf = 0.5 * (1 + erf(x * _INV_SQRT2))
        self._save_cache((x, cdf, dtype))
        return _rounded(x * cdf, dtype)

    def fused_bias_forward(self, pre: Any, bias: Any) -> Any:
        """``forward(pre + bias)`` with the add in the same kernel (``Linear(activation="gelu")`` on cupy).

        The caller has checked ``kernels.takes_kernels(pre, bias)``; ``pre`` is a fresh product and is
        overwritten with ``pre + bias``, the input the backward reads.
        """
        y, aux, x = kernels.bias_gelu(pre, bias, self.approximate == "tanh")
        self._save_cache((x, aux, x.dtype))
        return y

    def backward(self, grad_out: Any) -> Any:
        """Exact form: Phi(x) + x phi(x); tanh form: the derivative of that formula.

        Returns the input gradient in the input's dtype (computed in float32 for 16-bit floats).
        """
        x, aux, dtype = self._pop_cache()
        if type(x) is np.ndarray:  # a 16-bit gradient joins the float32 host kernel, as its forward did
            grad_out = _opmath(grad_out)
        if kernels.takes_kernels(x, grad_out):
            return _rounded(kernels.gelu_backward(grad_out, x, aux, self.approximate == "tanh"), dtype)
        xp = array_module(x)
        grad_out = _opmath(grad_out)
        if self.approximate == "tanh":
            t = aux
            inner_grad = _SQRT_2_OVER_PI * (1 + 3 * _TANH_COEF * x * x)
            return _rounded(grad_out * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * inner_grad), dtype)
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * x * x)
        return _rounded(grad_out * (aux + x * pdf), dtype)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


__all__ = ["ReLU", "GELU", "Tanh"]
