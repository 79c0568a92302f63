"""Sequential: modules applied in order, backward in reverse."""
from __future__ import annotations

from typing import Any, Iterator

from ..errors import ArgumentTypeError
from .activation import GELU, ReLU
from .linear import Linear
from .module import Module, call_backward

_FUSED = (ReLU, GELU)  # activations whose kernel adds the bias of the Linear before them


def _fusable(linear: Module, activation: Module) -> bool:
    """A plain Linear (no activation of its own) then a plain ReLU or GELU, neither with its ``forward`` wrapped
    (FSDP and others hook a module by setting ``forward`` on the instance: then each is called)."""
    return (type(linear) is Linear and linear.activation is None and type(activation) in _FUSED
            and "forward" not in linear.__dict__ and "forward" not in activation.__dict__)


class Sequential(Module):
    """Chain modules: ``forward`` feeds each output to the next; ``backward`` runs them in reverse.

    Submodules are registered as "0", "1", ..., so parameters are named
    "0.weight", "0.bias", ... as in PyTorch.

    Args:
        *modules: the layers, in forward order.

    Raises:
        TypeError: an argument is not a Module.
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> "Sequential":
        """Add ``module`` at the end; returns self."""
        if not isinstance(module, Module):
            raise ArgumentTypeError(f"Sequential takes Modules, got {type(module).__name__}")
        setattr(self, str(len(self._modules)), module)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def __getitem__(self, index: Any) -> Any:
        layers = list(self._modules.values())
        if isinstance(index, slice):
            return Sequential(*layers[index])
        return layers[index]

    def forward(self, x: Any) -> Any:
        """Apply every layer in order.

        A plain ``Linear`` followed by a plain ``ReLU`` or ``GELU`` runs as ``Linear.forward_with``: the
        bias is added in the activation's kernel (one pass over the output fewer), with the result and
        the backward of the two calls. Subclasses of either, and modules whose ``forward`` a wrapper
        replaced (FSDP's units), are called one by one.
        """
        layers = list(self._modules.values())
        i = 0
        while i < len(layers):
            m = layers[i]
            if i + 1 < len(layers) and _fusable(m, layers[i + 1]):
                x = m.forward_with(x, layers[i + 1])
                i += 2
            else:
                x = m(x)
                i += 1
        return x

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Backward through every layer in reverse order; returns d loss / d input.

        Args:
            grad_out: d loss / d output.
            input_grad: False passes ``input_grad=False`` on to the first layer
                (see ``Module.backward``); the result may then be None.
        """
        layers = list(self._modules.values())
        for m in reversed(layers[1:]):
            grad_out = m.backward(grad_out)
        return call_backward(layers[0].backward, grad_out, input_grad) if layers else grad_out


__all__ = ["Sequential"]
