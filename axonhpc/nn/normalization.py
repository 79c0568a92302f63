"""LayerNorm over the trailing axes."""
from __future__ import annotations

import math
from typing import Any, Sequence, Tuple, Union

import numpy as np

from .._dtypes import array_module
from ..errors import ConfigurationError, ShapeError
from . import kernels
from .autocast import like, widen
from .module import Module
from .parameter import Parameter


class LayerNorm(Module):
    """Normalise over the last ``len(normalized_shape)`` axes, then scale and shift.

    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance,
    as PyTorch's ``nn.LayerNorm``; ``weight`` starts at ones, ``bias`` at zeros.

    Args:
        normalized_shape: int or shape of the trailing axes to normalise.
        eps: added to the variance.
        elementwise_affine: learn ``weight`` and ``bias`` of ``normalized_shape``.
        dtype: parameter dtype.

    Raises:
        ConfigurationError: an empty or non-positive ``normalized_shape``, or eps not a number >= 0 (NaN).
    """

    takes_arrays = True

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5,
                 elementwise_affine: bool = True, dtype: Any = np.float32) -> None:
        super().__init__()
        shape = (int(normalized_shape),) if np.ndim(normalized_shape) == 0 else tuple(int(s) for s in normalized_shape)
        if not shape or any(s <= 0 for s in shape):
            raise ConfigurationError(f"LayerNorm normalized_shape must be non-empty and positive, got {shape}")
        try:
            value = float(eps)
        except (TypeError, ValueError):
            value = math.nan
        if not value >= 0:  # NaN too, which would make every output NaN
            raise ConfigurationError(f"LayerNorm eps must be a number >= 0, got {eps!r}")
        self.normalized_shape = shape
        self.eps = value
        self.elementwise_affine = bool(elementwise_affine)
        if self.elementwise_affine:
            self.weight = Parameter(np.ones(shape, dtype=dtype))
            self.bias = Parameter(np.zeros(shape, dtype=dtype))
        else:
            self.weight = None
            self.bias = None

    def forward(self, x: Any) -> Any:
        """Normalise ``x`` of shape (..., *normalized_shape).

        Raises:
            ShapeError: the trailing axes of ``x`` are not ``normalized_shape``.
        """
        k = len(self.normalized_shape)
        if x.ndim < k or tuple(x.shape[x.ndim - k:]) != self.normalized_shape:
            raise ShapeError(f"LayerNorm{self.normalized_shape} got input of shape {tuple(x.shape)}; "
                             f"its trailing axes must be {self.normalized_shape}")
        x_dtype = x.dtype
        x = widen(x)  # float32 under autocast: a 16-bit variance loses too much
        widened_from = x_dtype if x.dtype != x_dtype else None
        xp = array_module(x)
        axes = tuple(range(x.ndim - k, x.ndim))
        affine = self._affine()
        if k == 1 and kernels.takes_kernels(x, *affine):  # host: one pass a row; device: three launches
            y, xhat, rstd = kernels.layer_norm_forward(x, *(affine or (None, None)), self.eps)
            self._save_cache((xhat, rstd, axes, widened_from))
            return xhat if y is None else y
        centred = x - x.mean(axis=axes, keepdims=True)
        var = (centred * centred).mean(axis=axes, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + self.eps)
        xhat = centred * rstd
        self._save_cache((xhat, rstd, axes, widened_from))
        if self.elementwise_affine:
            return xhat * self.weight.data + self.bias.data
        return xhat

    def backward(self, grad_out: Any) -> Any:
        """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) over the normalised axes."""
        xhat, rstd, axes, widened_from = self._pop_cache()
        weight = self._affine()[:1]
        if len(axes) == 1 and kernels.takes_kernels(grad_out, xhat, rstd, *weight):
            dx, dweight, dbias = kernels.layer_norm_backward(grad_out, xhat, rstd, *(weight or (None,)))
            if self.elementwise_affine:  # bias before weight: hooks fire in reverse registration order
                self.bias.accumulate_grad(dbias)
                self.weight.accumulate_grad(dweight)
            return dx if widened_from is None else like(dx, widened_from)
        if self.elementwise_affine:
            lead = tuple(range(grad_out.ndim - len(axes)))
            # Bias before weight: hooks fire in reverse registration order.
            self.bias.accumulate_grad(grad_out.sum(axis=lead))
            self.weight.accumulate_grad((grad_out * xhat).sum(axis=lead))
            dxhat = grad_out * self.weight.data
        else:
            dxhat = grad_out
        dx = rstd * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                     - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))
        return dx if widened_from is None else like(dx, widened_from)

    def _affine(self) -> Tuple[Any, ...]:
        """The ``(weight, bias)`` arrays, or ``()`` without them."""
        return (self.weight.data, self.bias.data) if self.elementwise_affine else ()

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


__all__ = ["LayerNorm"]
