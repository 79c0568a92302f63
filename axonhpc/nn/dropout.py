"""Dropout with its own seeded generator, so masks are reproducible run to run."""
from __future__ import annotations

from typing import Any

from .._dtypes import array_module
from ..errors import ConfigurationError
from . import _init
from .module import Module


class Dropout(Module):
    """Zero each element with probability ``p`` in training, scaling the rest by 1/(1-p).

    The identity in eval mode. Masks come from this layer's own numpy
    Generator (drawn on the host, then moved to the input's device), so a
    given seed produces the same sequence of masks on numpy and cupy. The
    layer cannot know its rank: to give each data-parallel rank its own
    masks, pass ``seed=base_seed + rank`` (or call ``manual_seed``).

    Args:
        p: drop probability in [0, 1].
        seed: int, SeedSequence or Generator; the default 0 makes runs
            reproducible.

    Raises:
        ConfigurationError: ``p`` outside [0, 1].
    """

    def __init__(self, p: float = 0.5, seed: _init.SeedLike = 0) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ConfigurationError(f"Dropout probability must be in [0, 1], got {p}")
        self.p = float(p)
        self._rng = _init.make_rng(seed)

    def manual_seed(self, seed: _init.SeedLike) -> None:
        """Restart the mask sequence from ``seed``."""
        self._rng = _init.make_rng(seed)

    def forward(self, x: Any) -> Any:
        """Drop and rescale in training; return ``x`` unchanged in eval or when p == 0."""
        if not self.training or self.p == 0.0:
            self._save_cache(1.0)
            return x
        xp = array_module(x)
        if self.p == 1.0:
            scaled_mask = xp.zeros(x.shape, dtype=x.dtype)
        else:
            keep = self._rng.random(x.shape) >= self.p
            scaled_mask = xp.asarray(keep.astype(x.dtype) * (1.0 / (1.0 - self.p))).astype(x.dtype, copy=False)
        self._save_cache(scaled_mask)
        return x * scaled_mask

    def backward(self, grad_out: Any) -> Any:
        """The gradient through the same mask and scale."""
        return grad_out * self._pop_cache()

    def extra_repr(self) -> str:
        return f"p={self.p}"


__all__ = ["Dropout"]
