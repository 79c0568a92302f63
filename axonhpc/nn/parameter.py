"""Parameter: an array the optimizer updates, its gradient, and grad-ready hooks.

[Note: gradients are written in place]
A data-parallel wrapper may make ``p.grad`` a view into a flat communication bucket, and other code may hold
views of ``p.data``. So a gradient is added into the existing ``p.grad`` (``p.grad[...] += g``), and
``zero_grad()`` fills it with zeros rather than dropping it, unless asked to.

[Note: grad-ready hooks]
Each layer calls ``accumulate_grad`` right after computing a gradient, in reverse registration order, so
hooks fire in reverse layer order while backward is still running: DDP can start reducing a bucket as soon as
its last gradient is ready. A shared Parameter (weight tying) fires its hooks once per use.
"""
from __future__ import annotations

from typing import Any, Callable, List

from .._dtypes import array_module
from ..errors import ArgumentTypeError, ShapeError
from .matmul import add_product, product_2d

GradHook = Callable[["Parameter"], None]


class RemovableHandle:
    """Handle returned by ``register_grad_hook``; ``remove()`` unregisters the hook."""

    def __init__(self, hooks: List[GradHook], hook: GradHook) -> None:
        self._hooks = hooks
        self._hook = hook

    def remove(self) -> None:
        """Unregister the hook; calling it again does nothing."""
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class Parameter:
    """A trainable array with an accumulated gradient.

    Attributes:
        data: the values (the array given, not copied). Optimizers update it in place and never rebind it.
        grad: the accumulated gradient, like ``data``, or None before the first backward (and after
            ``zero_grad(set_to_none=True)``).
    """

    def __init__(self, data: Any) -> None:
        if not hasattr(data, "shape") or not hasattr(data, "dtype"):
            raise ArgumentTypeError(f"Parameter data must be a numpy or cupy array, got {type(data).__name__}")
        self.data = data
        self.grad = None
        self._grad_hooks: List[GradHook] = []

    @property
    def shape(self):
        """Shape of ``data``."""
        return self.data.shape

    @property
    def dtype(self):
        """dtype of ``data``."""
        return self.data.dtype

    @property
    def size(self) -> int:
        """Number of elements of ``data``."""
        return int(self.data.size)

    @property
    def ndim(self) -> int:
        """Number of dimensions of ``data``."""
        return self.data.ndim

    def register_grad_hook(self, fn: GradHook) -> RemovableHandle:
        """Call ``fn(param)`` during backward each time this gradient becomes final; returns a removable handle."""
        if not callable(fn):
            raise ArgumentTypeError(f"grad hook must be callable, got {type(fn).__name__}")
        self._grad_hooks.append(fn)
        return RemovableHandle(self._grad_hooks, fn)

    def accumulate_grad(self, g: Any) -> None:
        """Add ``g`` (cast to ``data``'s dtype) into ``grad`` and run the grad hooks; layers call it from ``backward``.

        Raises ShapeError if ``g`` does not have the parameter's shape.
        """
        if tuple(g.shape) != tuple(self.data.shape):
            raise ShapeError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(self.data.shape)}")
        if self.grad is None:
            # A copy: ``g`` may alias a layer's cache or the caller's array.
            self.grad = g.astype(self.data.dtype, copy=True)
        else:
            self.grad[...] += g
        self._grad_ready()

    def accumulate_product(self, a: Any, b: Any) -> None:
        """Add the matrix product ``a @ b`` into ``grad`` and run the grad hooks.

        ``accumulate_grad(a @ b)`` with fewer passes over memory: a first gradient is the product itself, and a
        product added into a float32/float64 cupy gradient is accumulated inside the GEMM (``beta=1``). ShapeError
        if the product does not have the parameter's shape.
        """
        shape = (a.shape[0], b.shape[1]) if a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0] else None
        if shape != tuple(self.data.shape):
            raise ShapeError(f"product of shapes {tuple(a.shape)} @ {tuple(b.shape)} for a parameter of shape "
                             f"{tuple(self.data.shape)}")
        if self.grad is None:
            g = product_2d(a, b, self.data.dtype)  # a new array, owned here
            self.grad = g if g.dtype == self.data.dtype else g.astype(self.data.dtype)
        else:
            add_product(self.grad, a, b)
        self._grad_ready()

    def _grad_ready(self) -> None:
        for hook in list(self._grad_hooks):
            hook(self)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the gradient: fill it with zeros in place, or with ``set_to_none`` drop it."""
        if set_to_none:
            self.grad = None
        elif self.grad is not None:
            self.grad[...] = 0

    def __repr__(self) -> str:
        xp = array_module(self.data)
        return f"Parameter(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, array={xp.__name__})"


__all__ = ["Parameter", "RemovableHandle"]
