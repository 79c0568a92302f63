"""Autocast: matrix products in float16 or bfloat16 while the parameters stay float32.

[Note: autocast]
PyTorch's rules: parameters stay float32 masters and no cast is cached (so an optimizer step inside the
block is seen); float64 is not lowered; softmax, ``LayerNorm`` and the losses compute in float32, because
their sums and exponentials lose too much in 16 bits. ``backward`` follows what the forward did, since each
layer caches its forward's dtypes. float16 gradients underflow below about 6e-8, so pair float16 with
``ax.GradScaler``; bfloat16 has float32's range. The state is per thread. numpy has no 16-bit GEMM: on the
host autocast models the device arithmetic but is no speed-up.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional, Tuple

import numpy as np

from .._dtypes import floating_dtype, is_floating, is_low_precision_float
from ..errors import ConfigurationError
from .matmul import column_sums, product_2d

_FLOAT32 = np.dtype(np.float32)
_state = threading.local()


def _parse_dtype(dtype: Any) -> np.dtype:
    parsed = floating_dtype(dtype, "autocast dtype", "float16 or bfloat16")
    if not is_low_precision_float(parsed):
        raise ConfigurationError(f"autocast dtype must be float16 or bfloat16, got {parsed}")
    return parsed


def autocast_dtype() -> Optional[np.dtype]:
    """The dtype products are computed in on this thread now, or None outside autocast."""
    return getattr(_state, "dtype", None)


class restored_autocast:
    """Context manager: this thread's autocast state set to ``dtype`` (None: off), as a recorded forward had it."""

    def __init__(self, dtype: Optional[np.dtype]) -> None:
        self._target = dtype
        self._outer: list = []

    def __enter__(self) -> "restored_autocast":
        self._outer.append(autocast_dtype())
        _state.dtype = self._target
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.dtype = self._outer.pop()


class autocast(restored_autocast):
    """Context manager: the ``nn`` layers' matrix products run in ``dtype`` (see the module note).

    Args:
        dtype: "float16" (default) or "bfloat16" (needs ml_dtypes), or the numpy dtype.
        enabled: False runs the block in full precision (also inside an outer autocast).

    Raises:
        ConfigurationError: another dtype, or bfloat16 without ml_dtypes.
    """

    def __init__(self, dtype: Any = "float16", enabled: bool = True) -> None:
        self.dtype = _parse_dtype(dtype)
        self.enabled = bool(enabled)
        super().__init__(self.dtype if self.enabled else None)

    def __repr__(self) -> str:
        return f"autocast(dtype={self.dtype}, enabled={self.enabled})"


def lower(x: Any, dtype: Optional[np.dtype], keep_float64: bool = True) -> Any:
    """``x`` cast for a product in ``dtype`` (None: no cast); ``keep_float64`` leaves float64 alone."""
    if dtype is None or x.dtype == dtype or not is_floating(x.dtype) or (keep_float64 and x.dtype == np.float64):
        return x
    return x.astype(dtype)


def product(a: Any, b: Any, dtype: Optional[np.dtype]) -> Any:
    """``a @ b`` for operands already lowered to ``dtype``, returned in ``dtype``.

    ml_dtypes' bfloat16 products come back in float32 on numpy; they are rounded to bfloat16 here.
    """
    out = matmul_2d(a, b) if b.ndim == 2 else a @ b
    if dtype is not None and out.dtype != dtype and a.dtype == dtype and b.dtype == dtype:
        out = out.astype(dtype)
    return out


def widen(x: Any) -> Any:
    """``x`` cast to float32 under autocast when it is a 16-bit float (softmax, LayerNorm), else ``x``."""
    if autocast_dtype() is None or not is_low_precision_float(x.dtype):
        return x
    return x.astype(_FLOAT32)


def like(grad: Any, dtype: Any) -> Any:
    """``grad`` in ``dtype``, the dtype of the array it is the gradient of (no copy when it already is)."""
    return grad if grad.dtype == dtype else grad.astype(dtype)


def matmul_2d(a: Any, b: Any) -> Any:
    """``a @ b`` as one 2-D GEMM when ``a`` is C-contiguous (numpy's stacked product is 1.3-3x slower).

    A zero width (``Linear(3, 0)``'s output, ``Linear(0, 2)``'s input) has no 2-D view to take: ``@`` gives
    its zero-size product, or zeros for an empty sum.
    """
    if a.shape[-1] == 0 or b.shape[-1] == 0:
        return a @ b
    return product_2d(a, b)


def linear_product(x: Any, weight: Any) -> Tuple[Any, Tuple[Any, Any, Any]]:
    """``(y, saved)``: ``x @ weight.T`` under this thread's autocast state, and what its backward needs.

    Only a cast weight is saved: the parameter's array may be resharded (FSDP) before backward.
    """
    dtype = autocast_dtype()
    w = lower(weight, dtype)
    if w is weight:  # no autocast, or a float64 weight: full precision, in the weight's dtype
        xc = x if x.dtype == weight.dtype else x.astype(weight.dtype)  # float64 data into a float32 model
        return matmul_2d(xc, weight.T), (xc, None, x.dtype)
    xc = lower(x, dtype, keep_float64=False)
    return product(xc, w.T, dtype), (xc, w, x.dtype)


def linear_grad_output(grad_out: Any, saved: Tuple[Any, Any, Any]) -> Any:
    """d loss / d y in the dtype the product ran in (under autocast; otherwise as given)."""
    w = saved[1]
    return grad_out if w is None else like(grad_out, w.dtype)


def linear_input_grad(grad_out: Any, saved: Tuple[Any, Any, Any], weight: Any) -> Any:
    """d loss / d x = ``grad_out @ weight``, in the dtype of ``x`` (``saved``: ``linear_product``'s tuple)."""
    w, x_dtype = saved[1], saved[2]
    if w is None:
        return like(matmul_2d(grad_out, weight.data), x_dtype)
    return like(matmul_2d(grad_out, w), x_dtype)


def linear_param_grads(grad_out: Any, saved: Tuple[Any, Any, Any], weight: Any, bias: Any = None) -> None:
    """Add d loss / d bias (summed in float32 under autocast) and d loss / d weight into their ``grad``."""
    xc = saved[0]
    # Rows counted, not reshape(-1, width): -1 is undecided for a zero width (Linear(3, 0), Linear(0, 2)).
    g2 = grad_out.reshape(math.prod(grad_out.shape[:-1]), grad_out.shape[-1])
    # Bias before weight: hooks fire in reverse registration order.
    if bias is not None:
        bias.accumulate_grad(column_sums(g2) if saved[1] is None else column_sums(g2, bias.dtype))
    weight.accumulate_product(g2.T, xc.reshape(math.prod(xc.shape[:-1]), xc.shape[-1]))


def linear_backward(grad_out: Any, saved: Tuple[Any, Any, Any], weight: Any, bias: Any = None,
                    input_grad: bool = True) -> Any:
    """The whole backward of ``linear_product`` (plus a bias): parameter gradients, then d loss / d x.

    ``grad_out`` may be in any dtype. Returns d loss / d x in the dtype of ``x``, or None with ``input_grad=False``.
    """
    grad_out = linear_grad_output(grad_out, saved)
    linear_param_grads(grad_out, saved, weight, bias)
    return linear_input_grad(grad_out, saved, weight) if input_grad else None


def add_bias(y: Any, bias: Any, saved: Tuple[Any, Any, Any]) -> Any:
    """``y + bias`` for a fresh product ``y``: in place (rounded to ``y``'s dtype under autocast) where it can."""
    if bias.dtype == y.dtype or saved[1] is not None:
        y += bias
        return y
    return y + bias


__all__ = ["autocast", "autocast_dtype", "restored_autocast", "lower", "product", "widen", "like", "matmul_2d",
           "linear_product", "linear_grad_output", "linear_input_grad", "linear_param_grads", "linear_backward",
           "add_bias"]
