"""DistributedSampler: each rank's share of the sample indices for one epoch.

[Note: identical permutations without communication]
Every rank draws the epoch's permutation from a Generator seeded with ``seed + epoch``, so all agree
without exchanging anything and the shares ``indices[r::num_replicas]`` are disjoint. The
permutation is numpy's, so the order differs from torch's DistributedSampler; padding and splitting
rules are the same.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

from ..errors import ArgumentTypeError, ConfigurationError, RankError
from ..observe.log import world_facts


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"DistributedSampler {name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


class DistributedSampler:
    """Split ``range(n)`` between ``num_replicas`` ranks, reshuffled each epoch.

    Without ``drop_last`` every rank gets ceil(n / num_replicas) indices (the list is padded by
    repeating its start, so a few samples appear twice per epoch); with it, floor(n / num_replicas).
    Rank r takes positions r, r + num_replicas, ... of the list.

    Args:
        num_replicas: ranks sharing the data (the data-parallel group size); None: the current world's
            size (pass the dp group's size under a mesh with tensor or pipeline parallelism).
        rank: this rank in [0, num_replicas); None: this rank in the current world.
        shuffle: permute the indices each epoch (seed + epoch), the same way on every rank.
        seed: base seed; must be the same on every rank.

    Raises:
        RankError: ``rank`` outside [0, num_replicas).
        ConfigurationError: ``n`` < 0 or ``num_replicas`` < 1, or ``num_replicas`` or ``rank`` left out
            before ``ax.init()``.
        TypeError: a non-integer ``n``, ``num_replicas``, ``rank`` or ``seed``.
    """

    def __init__(self, n: int, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            facts = world_facts()
            if facts is None:
                raise ConfigurationError("DistributedSampler needs num_replicas and rank, or a world to take them "
                                         "from: call ax.init() first")
            rank = facts[0] if rank is None else rank
            num_replicas = facts[1] if num_replicas is None else num_replicas
        n = _check_int("n", n)
        num_replicas = _check_int("num_replicas", num_replicas)
        rank = _check_int("rank", rank)
        seed = _check_int("seed", seed)
        if n < 0:
            raise ConfigurationError(f"DistributedSampler n must be >= 0, got {n}")
        if num_replicas < 1:
            raise ConfigurationError(f"DistributedSampler num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise RankError(f"DistributedSampler rank {rank} is out of range for num_replicas={num_replicas} "
                            f"(valid ranks are 0..{num_replicas - 1})")
        self.n = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from the next iteration on (call it on every rank)."""
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, as an int64 array."""
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.n)
        else:
            order = np.arange(self.n)
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > self.n and self.n > 0:
            # Repeat the start (several times when n < num_replicas) up to total_size.
            order = np.resize(order, self.total_size)
        return order[self.rank: self.total_size: self.num_replicas].astype(np.int64, copy=False)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(n={self.n}, num_replicas={self.num_replicas}, rank={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch})")


__all__ = ["DistributedSampler"]
