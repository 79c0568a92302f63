"""The two modes every data-parallel wrapper has: the model's train/eval mode, and ``no_sync``."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


class WrapperModes:
    """``train()``, ``eval()`` and ``no_sync()`` of a wrapper that holds its model as ``self.module``.

    The train/eval mode lives in the model (Dropout reads ``module.training``);
    the wrapper only forwards the switch and returns itself, so
    ``ddp.eval()(x)`` reads as it does on a plain module. ``no_sync`` is the
    wrapper's own: while ``syncing`` is False, backward leaves the gradients
    local and the wrapper reduces them at the first backward after it.
    """

    module: Any
    _no_sync_depth = 0  # no_sync blocks entered and not left (they nest)

    def train(self, mode: bool = True) -> Any:
        """Training mode (Dropout active) for the wrapped module, or eval mode with ``mode=False``; returns self."""
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        """Evaluation mode (Dropout is the identity) for the wrapped module; returns self."""
        self.module.eval()
        return self

    @property
    def syncing(self) -> bool:
        """Whether a backward now reduces gradients across the group (False inside ``no_sync``)."""
        return self._no_sync_depth == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally (no communication); blocks nest."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1


__all__ = ["WrapperModes"]
