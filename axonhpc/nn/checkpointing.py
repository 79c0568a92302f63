"""Activation checkpointing: keep a module's input, recompute its activations in backward.

[Note: bit-identical recomputation]
``Checkpoint.forward`` runs the inner module and then drops every cached
activation inside it, keeping only the input and the state of the generator of
each ``Dropout`` inside (taken before the forward). ``backward`` restores
those states, runs the same forward again on the same input, which draws
the same masks and does the same arithmetic, so the recomputed activations
and hence the gradients are bit for bit those of an unwrapped module; then
it puts back the generators as they were before the backward, so the
recomputation consumes no randomness, and runs the inner backward. The
recomputation runs under the autocast state of the first forward (see
``nn.autocast``), wherever backward is called.
Memory between forward and backward drops to the input; the price is a
second forward.
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

    Each array object is counted once, even when several caches hold it
    (views are counted at their own size).

    Args:
        module: any Module, after a forward and before its backward.

    Returns:
        The sum of ``nbytes`` over the cached arrays.
    """
    seen: set = set()
    return sum(_nbytes(m.__dict__.get("_cache"), seen) for m in module.modules())


class Checkpoint(Module):
    """Wrap ``module`` so its activations are recomputed in backward instead of kept.

    Parameters stay those of ``module`` (registered as the submodule
    ``module``, so their names gain a ``module.`` prefix). Gradients are
    bit-identical to the unwrapped module's, Dropout included (see the note
    at the top of this file).

    Args:
        module: the Module to checkpoint; its forward takes one input.
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
        """Recompute the inner forward with the saved generators, then backpropagate through it.

        ``input_grad=False`` is passed on to the inner module (see ``Module.backward``).
        """
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
    """Wrap ``module`` in a ``Checkpoint`` (activations recomputed in backward).

    Args:
        module: the Module to checkpoint.

    Returns:
        The wrapper; use it in place of ``module``.
    """
    return Checkpoint(module)


__all__ = ["Checkpoint", "checkpoint", "cached_nbytes"]
