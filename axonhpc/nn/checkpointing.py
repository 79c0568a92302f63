"""Activation checkpointing: keep a module's input, recompute its activations in backward.

[Note: bit-identical recomputation]
``Checkpoint.forward`` keeps only the input and the generator state of each ``Dropout`` inside (taken before
the forward). ``backward`` restores those states and reruns the forward, which draws the same masks and does
the same arithmetic, so the gradients are bit for bit those of an unwrapped module; it then puts the
generators back, so the recomputation consumes no randomness. It runs under the first forward's autocast
state, wherever backward is called. Memory between forward and backward drops to the input, for the price
of a second forward.
"""
from __future__ import annotations

from typing import Any

from .autocast import autocast_dtype, restored_autocast
from .dropout import Dropout
from .module import Module, call_backward


def _nbytes(obj: Any, seen: set) -> int:
    if hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return int(obj.nbytes)
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o, seen) for o in obj.values())
    return 0


def cached_nbytes(module: Module) -> int:
    """Bytes of the arrays held in the forward caches of ``module`` and its submodules.

    Each array object is counted once, even when several caches hold it (views at their own size).
    """
    seen: set = set()
    return sum(_nbytes(m.__dict__.get("_cache"), seen) for m in module.modules())


class Checkpoint(Module):
    """Wrap ``module`` (whose forward takes one input) so its activations are recomputed in backward.

    Its parameters are registered under the submodule ``module``, so their names gain a ``module.`` prefix.
    Gradients are bit-identical to the unwrapped module's, Dropout included (see the module note).
    """

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def _dropouts(self):
        return [m for m in self.module.modules() if isinstance(m, Dropout)]

    def forward(self, x: Any) -> Any:
        """Run the inner module, then keep only ``x`` and the Dropout generators' starting states."""
        states = [d.rng_state() for d in self._dropouts()]
        out = self.module(x)
        for m in self.module.modules():
            object.__setattr__(m, "_cache", None)
        self._save_cache((x, states, autocast_dtype()))
        return out

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Recompute the inner forward with the saved generators, then backpropagate (``input_grad`` passed on)."""
        x, states, autocast_state = self._pop_cache()
        dropouts = self._dropouts()
        current = [d.rng_state() for d in dropouts]
        for d, state in zip(dropouts, states):
            d.set_rng_state(state)
        try:
            with restored_autocast(autocast_state):  # products in the dtypes of the first forward
                self.module(x)
        finally:
            for d, state in zip(dropouts, current):
                d.set_rng_state(state)
        return call_backward(self.module.backward, grad_out, input_grad)


def checkpoint(module: Module) -> Checkpoint:
    """Wrap ``module`` in a ``Checkpoint``; use the result in its place."""
    return Checkpoint(module)


__all__ = ["Checkpoint", "checkpoint", "cached_nbytes"]
