"""Dropout with its own seeded generator, so masks are reproducible run to run."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .._dtypes import array_module
from ..cuda import capture
from ..errors import ConfigurationError
from . import initializers
from .module import Module


class Dropout(Module):
    """Zero each element with probability ``p`` in training, scaling the rest by 1/(1-p); the identity in eval.

    Masks come from this layer's own numpy Generator (drawn on the host, then moved to the input's device), so a
    seed gives the same masks on numpy and cupy. The layer cannot know its rank: give data-parallel ranks their
    own masks with ``seed=base_seed + rank`` (or ``manual_seed``), or key the masks by sample.

    [Note: masks keyed by sample]
    After ``key_by_sample(step, first_row)``, row i of the following inputs gets the mask of a generator made
    from (this layer's key, ``step``, ``first_row + i``), so a sample's mask depends only on the step and its
    place in the global batch, not on how the batch is split or which rank draws it. A data-, tensor- and
    pipeline-parallel run then draws exactly the masks of one process keyed the same way, and a run resumed at
    step s draws those of step s.

    Raises:
        ConfigurationError: ``p`` outside [0, 1].
    """

    takes_arrays = True

    def __init__(self, p: float = 0.5, seed: initializers.SeedLike = 0) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ConfigurationError(f"Dropout probability must be in [0, 1], got {p}")
        self.p = float(p)
        self._rng = initializers.make_rng(seed)
        self._key: Optional[int] = None  # drawn from _rng by the first key_by_sample
        self._rows: Optional[Tuple[int, int]] = None  # (step, next row) while keyed by sample

    def manual_seed(self, seed: initializers.SeedLike) -> None:
        """Restart the mask sequence from ``seed`` (and stop keying masks by sample)."""
        self._rng = initializers.make_rng(seed)
        self._key, self._rows = None, None

    def key_by_sample(self, step: int, first_row: int = 0) -> None:
        """Draw the masks of the next inputs by sample: row i from (key, ``step``, ``first_row + i``).

        Call it before each step's first forward with the global index of this rank's first sample. Raises
        ConfigurationError for a negative or non-integer ``step`` or ``first_row``.
        """
        for name, value in (("step", step), ("first_row", first_row)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"Dropout.key_by_sample: {name} must be a non-negative int, got {value!r}")
        if self._key is None:
            self._key = int(self._rng.integers(2 ** 63))
        self._rows = (int(step), int(first_row))

    def rng_state(self) -> Any:
        """Everything the next masks depend on (for ``set_rng_state``; activation checkpointing uses it)."""
        return self._rng.bit_generator.state, self._key, self._rows

    def set_rng_state(self, state: Any) -> None:
        """Go back to a state ``rng_state`` returned."""
        self._rng.bit_generator.state, self._key, self._rows = state

    def _keep(self, shape: Tuple[int, ...]) -> np.ndarray:
        """Where to keep elements of an input of ``shape`` (host booleans), advancing the generator or the rows."""
        if self._rows is None:
            return self._rng.random(shape) >= self.p
        step, row = self._rows
        rows = shape[0] if shape else 1
        keep = np.stack([initializers.make_rng([self._key, step, row + i]).random(shape[1:]) >= self.p
                         for i in range(rows)]) if rows else np.zeros(shape, dtype=bool)
        self._rows = (step, row + rows)
        return keep.reshape(shape)

    def forward(self, x: Any) -> Any:
        """Drop and rescale in training; return ``x`` unchanged in eval or when p == 0."""
        if not self.training or self.p == 0.0:
            self._save_cache(1.0)
            return x
        xp = array_module(x)
        if self.p == 1.0:
            scaled_mask = xp.zeros(x.shape, dtype=x.dtype)
        else:
            capture.refuse("Dropout in training mode", f"its mask (p={self.p}) is drawn on the host at each call, "
                            "and a graph would replay the mask of the capture at every step; capture the step "
                            "with the model in eval mode or without dropout")
            keep = self._keep(tuple(x.shape))
            scaled_mask = xp.asarray(keep.astype(x.dtype) * (1.0 / (1.0 - self.p))).astype(x.dtype, copy=False)
        self._save_cache(scaled_mask)
        return x * scaled_mask

    def backward(self, grad_out: Any) -> Any:
        """The gradient through the same mask and scale."""
        return grad_out * self._pop_cache()

    def extra_repr(self) -> str:
        return f"p={self.p}"


def key_dropout_by_sample(module: Module, step: int, first_row: int = 0) -> None:
    """``Dropout.key_by_sample(step, first_row)`` on every Dropout inside ``module``."""
    for m in module.modules():
        if isinstance(m, Dropout):
            m.key_by_sample(step, first_row)
