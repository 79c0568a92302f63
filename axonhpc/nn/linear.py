"""Linear: y = x @ weight.T + bias, in PyTorch's layout and default initialisation."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import ConfigurationError, ShapeError
from . import initializers, kernels
from .activation import GELU, ReLU
from .autocast import add_bias, linear_backward, linear_product
from .module import Module
from .parameter import Parameter

# Linear(activation=...): the activations whose bias add can join their kernel.
ACTIVATIONS = {"relu": lambda: ReLU(), "gelu": lambda: GELU(), "gelu_tanh": lambda: GELU("tanh")}


class Linear(Module):
    """Affine map over the last axis: ``x @ weight.T + bias``.

    PyTorch's layout (``weight`` is (out_features, in_features)), so state dicts move between the two unchanged,
    and PyTorch's default initialisation: U(-1/sqrt(in_features), 1/sqrt(in_features)) for weight and bias.

    Args:
        seed: int, SeedSequence or Generator for the initial values; None draws fresh entropy (ranks then
            differ until a data-parallel wrapper broadcasts rank 0's parameters).
        activation: None, "relu", "gelu" or "gelu_tanh": applied to the output, bit for bit as
            ``Sequential(Linear, activation)``; on cupy the bias is added in the activation's kernel.

    Raises:
        ConfigurationError: a negative size or an unknown activation.
    """

    takes_arrays = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Any = np.float32, seed: initializers.SeedLike = None, activation: Optional[str] = None) -> None:
        super().__init__()
        initializers.check_sizes("Linear", in_features=in_features, out_features=out_features)
        if in_features < 0 or out_features < 0:
            raise ConfigurationError(f"Linear sizes must be >= 0, got in_features={in_features}, "
                                     f"out_features={out_features}")
        if activation is not None and activation not in ACTIVATIONS:
            raise ConfigurationError(f"Linear activation must be None or one of {sorted(ACTIVATIONS)}, "
                                     f"got {activation!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        rng = initializers.make_rng(seed)
        bound = initializers.fan_in_bound(self.in_features)
        self.weight = Parameter(initializers.uniform(rng, (self.out_features, self.in_features), bound, dtype))
        if bias:
            self.bias = Parameter(initializers.uniform(rng, (self.out_features,), bound, dtype))
        else:
            self.bias = None
        self.activation = None if activation is None else ACTIVATIONS[activation]()

    def forward(self, x: Any) -> Any:
        """Apply the map to ``x`` (..., in_features); returns (..., out_features). ShapeError for another last axis."""
        return self.forward_with(x, self.activation)

    def forward_with(self, x: Any, activation: Optional[Module]) -> Any:
        """``activation(self(x))`` for an ``nn.ReLU`` or ``nn.GELU`` (or None), the bias added in its kernel.

        ``Sequential`` calls this for a Linear followed by one of them; ``activation.backward`` then
        ``self.backward`` run as after two separate calls. ShapeError for another last axis.
        """
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ShapeError(f"Linear({self.in_features}, {self.out_features}) got input of shape "
                             f"{tuple(x.shape)}; the last axis must be {self.in_features}")
        y, saved = linear_product(x, self.weight.data)
        self._save_cache(saved)
        if activation is not None and self.bias is not None and kernels.takes_kernels(y, self.bias.data):
            return activation.fused_bias_forward(y, self.bias.data)
        if self.bias is not None:
            y = add_bias(y, self.bias.data, saved)
        return y if activation is None else activation(y)

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Gradients for ``x``, ``weight`` and ``bias`` from d loss / d y (..., out_features).

        With an activation, y is its output. ``input_grad=False`` (a first layer, whose input is data) skips
        ``grad_out @ weight`` and returns None.
        """
        if self.activation is not None:
            grad_out = self.activation.backward(grad_out)
        return linear_backward(grad_out, self._pop_cache(), self.weight, self.bias, input_grad)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


__all__ = ["Linear"]
