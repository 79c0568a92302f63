"""DataLoader: mini-batches of in-memory arrays, in sampler order."""
from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from .._dtypes import array_module
from ..errors import ConfigurationError, ShapeError
from .sampler import DistributedSampler


class DataLoader:
    """Iterate over mini-batches of one or several arrays that share their first axis.

    Batch i holds rows ``[i * batch_size, (i + 1) * batch_size)`` of the index order: the sampler's,
    else 0..n-1, or a permutation when ``shuffle``. Arrays may be numpy or cupy; each batch is a copy
    taken on the array's own device. The own shuffle of pass e is seeded with ``seed + e`` (e counts
    passes unless ``set_epoch`` fixed it); with a sampler, ``set_epoch`` is forwarded to it.

    Args:
        arrays: a single array, or a tuple/list of arrays with the same length.
        sampler: iterable of int indices with ``len`` (e.g. DistributedSampler); excludes ``shuffle``.
        drop_last: drop a final batch smaller than ``batch_size``.

    Yields:
        For a single array, one batch array; for a tuple/list, a tuple of batches.

    Raises:
        ShapeError: the arrays have different lengths (the message lists them) or are 0-d; a
            ``DistributedSampler`` over another number of samples than the arrays' length; while
            iterating, a sampler index outside ``[0, length)``.
        ConfigurationError: batch_size < 1, no arrays, or both a sampler and shuffle.
    """

    def __init__(self, arrays: Union[Any, Sequence[Any]], batch_size: int, sampler: Optional[Iterable[int]] = None,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False) -> None:
        self._single = not isinstance(arrays, (tuple, list))
        self.arrays = (arrays,) if self._single else tuple(arrays)
        if not self.arrays:
            raise ConfigurationError("DataLoader needs at least one array")
        for i, a in enumerate(self.arrays):
            if getattr(a, "ndim", 0) == 0:
                raise ShapeError(f"DataLoader array {i} must have a leading (sample) axis, got "
                                 f"{type(a).__name__} of shape {getattr(a, 'shape', '?')}")
        lengths = [int(a.shape[0]) for a in self.arrays]
        if len(set(lengths)) != 1:
            raise ShapeError(f"DataLoader arrays must have the same length, got lengths {lengths}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ConfigurationError(f"DataLoader batch_size must be a positive int, got {batch_size!r}")
        if sampler is not None and shuffle:
            raise ConfigurationError("DataLoader takes either a sampler or shuffle=True, not both "
                                     "(let the sampler shuffle)")
        if isinstance(sampler, DistributedSampler) and sampler.n != lengths[0]:
            # fewer would leave rows out silently, more would index past the arrays
            raise ShapeError(f"DataLoader sampler is a DistributedSampler over n={sampler.n} samples, but the "
                             f"arrays have length {lengths[0]}; build it with n={lengths[0]}")
        self.n = lengths[0]
        self.batch_size = int(batch_size)
        self.sampler = sampler
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch of the next pass (and of the sampler, if it has ``set_epoch``)."""
        self.epoch = int(epoch)
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _order(self) -> np.ndarray:
        if self.sampler is not None:
            order = np.fromiter(iter(self.sampler), dtype=np.int64)
            outside = order[(order < 0) | (order >= self.n)]
            if outside.size:
                raise ShapeError(f"DataLoader sampler gave index {int(outside[0])}, outside the arrays' length "
                                 f"{self.n} (indices must be in [0, {self.n}))")
            return order
        if self.shuffle:
            return np.random.default_rng(self.seed + self.epoch).permutation(self.n)
        return np.arange(self.n)

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        self.epoch += 1
        stop = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
        for start in range(0, stop, self.batch_size):
            idx = order[start: start + self.batch_size]
            batch = tuple(a[array_module(a).asarray(idx)] for a in self.arrays)
            yield batch[0] if self._single else batch

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else self.n
        if self.drop_last:
            return count // self.batch_size
        return math.ceil(count / self.batch_size)


__all__ = ["DataLoader"]
