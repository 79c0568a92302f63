"""What every data-parallel wrapper passes straight to the model it wraps: the train/eval mode."""
from __future__ import annotations

from typing import Any


class ModeOfWrappedModule:
    """``train()`` and ``eval()`` of a wrapper that holds its model as ``self.module``.

    The mode lives in the model (Dropout reads ``module.training``); the
    wrapper only forwards the switch and returns itself, so
    ``ddp.eval()(x)`` reads as it does on a plain module.
    """

    module: Any

    def train(self, mode: bool = True) -> Any:
        """Training mode (Dropout active) for the wrapped module, or eval mode with ``mode=False``; returns self."""
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        """Evaluation mode (Dropout is the identity) for the wrapped module; returns self."""
        self.module.eval()
        return self


__all__ = ["ModeOfWrappedModule"]
