"""Which gradients share a bucket: ``plan_buckets`` and the rule it shares with ``GradientSynchronizer.push``.

[Note: bucket layout]
A bucket holds one dtype and at most ``bucket_size`` bytes; gradients are assigned in the order given, and a
gradient larger than ``bucket_size`` gets a bucket of its own. The layout is therefore a pure function of the
gradients' sizes, dtypes and order (``plan_buckets`` computes it with no arrays), so every rank issues the same
all-reduces in the same order. DDP plans once at construction, the synchronizer once per list of gradients,
and pushing gradients one by one forms the same buckets.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError


def bucket_capacity(bucket_size: int, dtype: np.dtype) -> int:
    """Elements of ``dtype`` in a bucket of ``bucket_size`` bytes (at least one)."""
    return max(1, bucket_size // dtype.itemsize)


def check_bucket_size(bucket_size: Any) -> int:
    try:
        size = operator.index(bucket_size)
    except TypeError:
        raise ArgumentTypeError(f"bucket_size must be an int (bytes), got {type(bucket_size).__name__} "
                                f"{bucket_size!r}") from None
    if size < 1:
        raise InvalidArgumentError(f"bucket_size must be at least 1 byte, got {size}")
    return size


class BucketAssigner:
    """The rule of the note above, item by item: items are opaque (indices when planning, gradients when pushed)."""

    def __init__(self, bucket_size: int, first_bucket_size: Optional[int] = None):
        self._bucket_size = bucket_size
        self._first_bucket_size = first_bucket_size
        self._opened: set = set()  # dtypes that have had a bucket
        # dtype -> [items, elements used, capacity]; insertion order is opening order.
        self._open: Dict[np.dtype, List[Any]] = {}

    def add(self, item: Any, numel: int, dtype: np.dtype) -> List[Tuple[np.dtype, List[Any]]]:
        """Assign ``item``; return the buckets this closes, in closing order."""
        closed = []
        bucket = self._open.get(dtype)
        if bucket is not None and bucket[1] + numel > bucket[2]:
            closed.append((dtype, self._open.pop(dtype)[0]))
            bucket = None
        if bucket is None:
            first = dtype not in self._opened and self._first_bucket_size is not None
            self._opened.add(dtype)
            size = self._first_bucket_size if first else self._bucket_size
            bucket = self._open[dtype] = [[], 0, bucket_capacity(size, dtype)]
        bucket[0].append(item)
        bucket[1] += numel
        if bucket[1] >= bucket[2]:
            closed.append((dtype, self._open.pop(dtype)[0]))
        return closed

    def flush(self) -> List[Tuple[np.dtype, List[Any]]]:
        """Close every open bucket, in the order they were opened."""
        closed = [(dtype, bucket[0]) for dtype, bucket in self._open.items()]
        self._open.clear()
        return closed


def plan_buckets(specs: Sequence[Tuple[int, Any]], bucket_size: int,
                 first_bucket_size: Optional[int] = None) -> List[Tuple[np.dtype, Tuple[int, ...]]]:
    """The bucket layout: ``(dtype, indices into specs)`` per bucket, in reduction order.

    Args:
        specs: ``(numel, dtype)`` of each gradient, in the order they are given.
        first_bucket_size: cap in bytes of each dtype's first bucket (None: ``bucket_size``); DDP makes it small
            so the first all-reduce starts early in backward.

    Raises InvalidArgumentError (a ``ValueError``) for ``bucket_size`` < 1 or a negative ``numel``.
    """
    first = None if first_bucket_size is None else check_bucket_size(first_bucket_size)
    assigner = BucketAssigner(check_bucket_size(bucket_size), first)
    plan: List[Tuple[np.dtype, Tuple[int, ...]]] = []
    for index, (numel, dtype) in enumerate(specs):
        if numel < 0:
            raise InvalidArgumentError(f"specs[{index}] has negative numel {numel}")
        for bucket_dtype, items in assigner.add(index, numel, np.dtype(dtype)):
            plan.append((bucket_dtype, tuple(items)))
    plan.extend((dtype, tuple(items)) for dtype, items in assigner.flush())
    return plan


__all__ = ["BucketAssigner", "bucket_capacity", "check_bucket_size", "plan_buckets"]
