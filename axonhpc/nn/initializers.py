"""Seeded initialisers matching PyTorch's default distributions.

Values are drawn in float64 from a numpy Generator on the host and then cast,
so a given seed gives the same weights on every rank, with numpy or cupy,
in any dtype. Move a model to the GPU with ``Module.to("cuda")``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence, Union

import numpy as np

from ..errors import ArgumentTypeError

SeedLike = Union[None, int, np.random.SeedSequence, np.random.Generator]


def check_sizes(owner: str, **sizes: Any) -> None:
    """Refuse a layer size that is not an int (``"4"``, ``4.0``, ``True``) before it reaches arithmetic.

    Raises:
        ArgumentTypeError: naming the layer, the argument and what it got.
    """
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(f"{owner} {name} must be an int, got {type(value).__name__} {value!r}")


def make_rng(seed: SeedLike) -> np.random.Generator:
    """A numpy Generator from an int, SeedSequence, Generator (used as is) or None (fresh entropy)."""
    return np.random.default_rng(seed)


def child_seeds(seed: SeedLike, n: int) -> list:
    """``n`` independent seeds derived from ``seed`` (for the sublayers of a layer)."""
    if isinstance(seed, np.random.Generator):
        return [np.random.default_rng(s) for s in seed.bit_generator.seed_seq.spawn(n)]
    if not isinstance(seed, np.random.SeedSequence):
        seed = np.random.SeedSequence(seed)
    return seed.spawn(n)


def uniform(rng: np.random.Generator, shape: Sequence[int], bound: float, dtype: Any) -> np.ndarray:
    """U(-bound, bound) of the given shape, cast to ``dtype``."""
    return rng.uniform(-bound, bound, size=tuple(shape)).astype(dtype)


def fan_in_bound(fan_in: int) -> float:
    """1/sqrt(fan_in): PyTorch's kaiming_uniform(a=sqrt(5)) weight bound and Linear bias bound."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


def xavier_bound(fan_in: int, fan_out: int) -> float:
    """sqrt(6 / (fan_in + fan_out)): Glorot uniform."""
    return math.sqrt(6.0 / (fan_in + fan_out))
