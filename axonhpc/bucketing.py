"""Gradient buckets and their synchronisation across a process group.

Re-exports the compiled buffers of ``axonhpc.buffers`` (documented here, as the API lists them) and defines
``GradientSynchronizer``: pack several gradients into one flat buffer, one all-reduce (mean) per bucket, unpack.

[Note: bucket layout]
A bucket holds one dtype and at most ``bucket_size`` bytes; gradients are assigned in the order given, and a
gradient larger than ``bucket_size`` gets a bucket of its own. The layout is therefore a pure function of the
gradients' sizes, dtypes and order (``plan_buckets`` computes it with no arrays), so every rank issues the same
all-reduces in the same order. SYNCHRONOUS and OVERLAPPED share that rule and differ only in when they wait,
so their results are bit for bit the same.

[Note: buffer reuse]
Bucket buffers are kept per (dtype, position in the step) and reused, so a loop with a fixed set of gradients
allocates no bucket memory after its first step. A buffer is never shared by two buckets of one step, so an
all-reduce in flight never sees another bucket's data.
"""
from __future__ import annotations

import enum
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._dtypes import check_array
from ._choices import parse_choice
from .errors import InvalidArgumentError, UnsupportedDtypeError, UsageError
from .backends import ReduceOp
from .buffers import (FlatLayout, FlatOps, GradientBucket, flat_ops_for, flatten_into_padded, pack, padded_size,
                      shard_bounds, shard_size, shard_view, unflatten, unpack)
from ._ext import _pack  # as a module: see axonhpc.buffers on the import-linter
from .collectives import all_reduce
from .groups import resolve_group


class GradSyncStrategy(enum.Enum):
    """When gradients are averaged across the group.

    SYNCHRONOUS: bucket after bucket, waiting for each. OVERLAPPED: each bucket's all-reduce starts as soon as it
    is full (``push``), overlapping the rest of backward; ``finish`` waits for all. NO_SYNC: nothing is sent.
    """

    SYNCHRONOUS = "synchronous"
    OVERLAPPED = "overlapped"
    NO_SYNC = "no_sync"

    @classmethod
    def parse(cls, value: Any) -> "GradSyncStrategy":
        """Accept a GradSyncStrategy or its name in any case; else UnknownChoiceError (an ``InvalidArgumentError``)."""
        return parse_choice(cls, value, "gradient sync strategy")


def _bucket_capacity(bucket_size: int, dtype: np.dtype) -> int:
    """Elements of ``dtype`` in a bucket of ``bucket_size`` bytes (at least one)."""
    return max(1, bucket_size // dtype.itemsize)


class _BucketAssigner:
    """The bucketing rule of the note above, over element counts.

    Items are opaque to it (indices when planning, gradients when pushing), so the plan and the synchronizer
    cannot drift apart.
    """

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
            bucket = self._open[dtype] = [[], 0, _bucket_capacity(size, dtype)]
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


def _check_bucket_size(bucket_size: Any) -> int:
    size = operator.index(bucket_size)
    if size < 1:
        raise InvalidArgumentError(f"bucket_size must be at least 1 byte, got {size}")
    return size


def plan_buckets(specs: Sequence[Tuple[int, Any]], bucket_size: int,
                 first_bucket_size: Optional[int] = None) -> List[Tuple[np.dtype, Tuple[int, ...]]]:
    """The bucket layout ``GradientSynchronizer`` forms: ``(dtype, indices into specs)`` per bucket, in order.

    Args:
        specs: ``(numel, dtype)`` of each gradient, in the order they are given.
        first_bucket_size: cap in bytes of each dtype's first bucket (None: ``bucket_size``); DDP makes it small
            so the first all-reduce starts early in backward.

    Raises InvalidArgumentError (a ``ValueError``) for ``bucket_size`` < 1 or a negative ``numel``.
    """
    first = None if first_bucket_size is None else _check_bucket_size(first_bucket_size)
    assigner = _BucketAssigner(_check_bucket_size(bucket_size), first)
    plan: List[Tuple[np.dtype, Tuple[int, ...]]] = []
    for index, (numel, dtype) in enumerate(specs):
        if numel < 0:
            raise InvalidArgumentError(f"specs[{index}] has negative numel {numel}")
        for bucket_dtype, items in assigner.add(index, numel, np.dtype(dtype)):
            plan.append((bucket_dtype, tuple(items)))
    plan.extend((dtype, tuple(items)) for dtype, items in assigner.flush())
    return plan


class GradientSynchronizer:
    """Average lists of gradients across a process group through fused buckets.

    Each bucket is one ``all_reduce(..., op=ReduceOp.AVG)``, written back into the gradient arrays.
    ``synchronize`` caches the layouts of the last few gradient lists, so a training loop plans once.

    Args:
        strategy: a ``GradSyncStrategy`` (or its name).
        bucket_size: bucket size in BYTES (25_000_000 is torch DDP's 25 MB).
        group: the process group (None: the current world's default group).

    Attributes:
        last_layout: ``(dtype, indices)`` of each bucket of the last completed step, in all-reduce order.

    Raises:
        InvalidArgumentError: unknown strategy, or ``bucket_size`` < 1 (a ``ValueError``).
    """

    _MAX_PLANS = 8  # distinct gradient lists whose layouts synchronize keeps

    def __init__(self, strategy: Any = GradSyncStrategy.SYNCHRONOUS, bucket_size: int = 25_000_000,
                 group: Any = None):
        self.strategy = GradSyncStrategy.parse(strategy)
        self.bucket_size = _check_bucket_size(bucket_size)
        self.group = group
        self.last_layout: Tuple[Tuple[np.dtype, Tuple[int, ...]], ...] = ()
        self._buffers: Dict[Tuple[np.dtype, int], np.ndarray] = {}
        self._ops: Optional[FlatOps] = None  # host or device, fixed by the first gradients seen
        self._plans: Dict[bytes, List[Tuple[np.dtype, Tuple[int, ...], int]]] = {}
        self._reset_step()

    def _reset_step(self) -> None:
        self._assigner = _BucketAssigner(self.bucket_size)
        self._pushed = 0
        self._ordinal: Dict[np.dtype, int] = {}
        self._pending: List[Tuple[Any, np.ndarray, List[np.ndarray]]] = []
        self._layout: List[Tuple[np.dtype, Tuple[int, ...]]] = []

    def __repr__(self) -> str:
        return (f"GradientSynchronizer(strategy={self.strategy.name}, bucket_size={self.bucket_size}, "
                f"group={self.group!r})")

    def _launch(self, dtype: np.dtype, indices: Tuple[int, ...], grads: List[np.ndarray], numel: int) -> None:
        """Pack one closed bucket and start (OVERLAPPED) or complete (SYNCHRONOUS) its all-reduce."""
        self._layout.append((dtype, indices))
        if numel == 0:
            return  # every rank skips it: the layout is the same everywhere
        ordinal = self._ordinal.get(dtype, 0)
        self._ordinal[dtype] = ordinal + 1
        buffer = self._buffers.get((dtype, ordinal))
        if buffer is None or buffer.size < numel:
            buffer = self._ops.empty(max(numel, _bucket_capacity(self.bucket_size, dtype)), dtype)
            self._buffers[(dtype, ordinal)] = buffer
        flat = self._ops.pack(grads, out=buffer[:numel])
        if self.strategy is GradSyncStrategy.OVERLAPPED:
            self._pending.append((all_reduce(flat, ReduceOp.AVG, self.group, async_op=True), flat, grads))
        else:
            all_reduce(flat, ReduceOp.AVG, self.group)
            self._ops.unpack(flat, grads)

    def _launch_items(self, dtype: np.dtype, items: List[Tuple[int, np.ndarray]]) -> None:
        grads = [grad for _, grad in items]
        self._launch(dtype, tuple(index for index, _ in items), grads, sum(grad.size for grad in grads))

    def _complete(self, timeout: Optional[float]) -> None:
        """Wait for the buckets in flight, write their averages back, end the step."""
        try:
            if timeout is None and self._pending:
                # the limit a blocking all_reduce on this group would have
                timeout = resolve_group(self.group).effective_timeout()
            for work, flat, grads in self._pending:
                work.wait(timeout)
                self._ops.unpack(flat, grads)
            self.last_layout = tuple(self._layout)
        finally:
            self._reset_step()

    def push(self, grad: np.ndarray) -> None:
        """Add a final gradient to its dtype's bucket; a bucket that fills is all-reduced at once.

        OVERLAPPED starts the all-reduce and returns; SYNCHRONOUS completes it first; NO_SYNC does nothing. ``grad``
        receives the average in ``finish()``, so it must stay alive and unchanged until then, and every rank must push
        the same sizes and dtypes in the same order. Raises UnsupportedDtypeError, NonContiguousBufferError or
        ReadOnlyBufferError, before sending, if ``grad`` cannot be averaged in place.
        """
        if self.strategy is GradSyncStrategy.NO_SYNC:
            return
        what = f"GradientSynchronizer.push: gradient {self._pushed}"
        ops = self._memory([grad], what)
        dtype = _pack.checked_dtype(grad, what, writable=True) if ops.name == "host" else self._device_dtype(grad, what)
        for bucket_dtype, items in self._assigner.add((self._pushed, grad), grad.size, dtype):
            self._launch_items(bucket_dtype, items)
        self._pushed += 1

    def finish(self, timeout: Optional[float] = None) -> None:
        """All-reduce the still-open buckets, wait for every bucket, write the averages back.

        ``timeout``: seconds per outstanding all-reduce; None takes the group's, else ``ax.settings.timeout``.
        Raises CollectiveTimeoutError if one does not complete in time.
        """
        try:
            for dtype, items in self._assigner.flush():
                self._launch_items(dtype, items)
        except BaseException:
            self._reset_step()  # a failed step must not leak its buckets into the next
            raise
        self._complete(timeout)

    def _memory(self, grads: List[Any], what: str) -> FlatOps:
        """The flat-buffer operations for ``grads``: chosen by the first gradients, then held to."""
        ops = flat_ops_for(grads, what=what)
        if self._ops is None:
            self._ops = ops
        elif ops.name != self._ops.name:
            raise UnsupportedDtypeError(f"{what}: gradients in {ops.name} memory, but this synchronizer's buckets "
                                        f"are in {self._ops.name} memory (one synchronizer per kind of memory)")
        return self._ops

    @staticmethod
    def _device_dtype(grad: Any, what: str) -> np.dtype:
        check_array(grad, what, writable=True)
        return grad.dtype

    def _plan(self, grads: List[np.ndarray]) -> List[Tuple[np.dtype, Tuple[int, ...], int]]:
        """The layout of ``grads`` with each bucket's element count, cached by sizes and dtypes."""
        what = "GradientSynchronizer.synchronize: grads"
        if self._ops.name == "host":
            key = _pack.layout_key(grads, what, writable=True)
        else:
            key = repr([(self._device_dtype(g, f"{what}[{i}]").str, g.size) for i, g in enumerate(grads)]).encode()
        plan = self._plans.get(key)
        if plan is None:
            sizes = [grad.size for grad in grads]
            plan = [(dtype, indices, sum(sizes[i] for i in indices))
                    for dtype, indices in plan_buckets([(g.size, g.dtype) for g in grads], self.bucket_size)]
            if len(self._plans) >= self._MAX_PLANS:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def synchronize(self, grads: Sequence[np.ndarray]) -> None:
        """Collective: average ``grads`` in place across the group (nothing with NO_SYNC).

        All gradients are checked before any is sent; they must have the same sizes, dtypes and order on every rank.
        The buckets are those that pushing them in order would form.

        Raises:
            UnsupportedDtypeError, NonContiguousBufferError, ReadOnlyBufferError: a gradient cannot be averaged in
                place.
            UsageError: gradients were pushed and not yet finished (a ``RuntimeError``).
            CollectiveTimeoutError: an all-reduce did not complete in time.
        """
        if self.strategy is GradSyncStrategy.NO_SYNC:
            return
        if self._pushed:
            raise UsageError(f"synchronize called while {self._pushed} pushed gradients are not finished; "
                             "call finish() first")
        grads = grads if type(grads) is list else list(grads)
        if not grads:
            return
        self._memory(grads, "GradientSynchronizer.synchronize: grads")
        plan = self._plan(grads)
        try:
            for dtype, indices, numel in plan:
                self._launch(dtype, indices, [grads[i] for i in indices], numel)
        except BaseException:
            self._reset_step()
            raise
        self._complete(None)


__all__ = [
    "GradientBucket",
    "GradientSynchronizer",
    "GradSyncStrategy",
    "FlatLayout",
    "flatten_into_padded",
    "pack",
    "padded_size",
    "plan_buckets",
    "shard_bounds",
    "shard_size",
    "shard_view",
    "unflatten",
    "unpack",
]
