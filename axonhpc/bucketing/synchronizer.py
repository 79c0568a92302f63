"""``GradientSynchronizer``: average lists of gradients through fused buckets (copies in and out).

[Note: buffer reuse]
Bucket buffers are kept per (dtype, position in the step) and reused, so a loop with a fixed set of gradients
allocates no bucket memory after its first step. A buffer is never shared by two buckets of one step, so an
all-reduce in flight never sees another bucket's data.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import check_array
from .._ext import _pack  # as a module: see axonhpc.buffers on the import-linter
from ..backends import ReduceOp
from ..buffers import FlatOps, flat_ops_for
from ..errors import UnsupportedDtypeError, UsageError
from .bucket import GradBucket
from .plan import BucketAssigner, bucket_capacity, check_bucket_size, plan_buckets
from .reducer import GradSyncStrategy, Reducer


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
        self.bucket_size = check_bucket_size(bucket_size)
        self.group = group
        self.last_layout: Tuple[Tuple[np.dtype, Tuple[int, ...]], ...] = ()
        self._reducer = Reducer(group)  # its ops are fixed by the first gradients seen (host or device)
        self._buffers: Dict[Tuple[np.dtype, int], Tuple[Any, GradBucket]] = {}
        self._plans: Dict[bytes, List[Tuple[np.dtype, Tuple[int, ...], int]]] = {}
        self._reset_step()

    def _reset_step(self) -> None:
        self._assigner = BucketAssigner(self.bucket_size)
        self._pushed = 0
        self._ordinal: Dict[np.dtype, int] = {}
        self._layout: List[Tuple[np.dtype, Tuple[int, ...]]] = []
        self._reducer.reset()

    def __repr__(self) -> str:
        return (f"GradientSynchronizer(strategy={self.strategy.name}, bucket_size={self.bucket_size}, "
                f"group={self.group!r})")

    def _launch(self, dtype: np.dtype, indices: Tuple[int, ...], grads: List[np.ndarray], numel: int) -> None:
        """Start (OVERLAPPED) or complete (SYNCHRONOUS) one closed bucket's all-reduce."""
        self._layout.append((dtype, indices))
        if numel == 0:
            return  # every rank skips it: the layout is the same everywhere
        ordinal = self._ordinal.get(dtype, 0)
        self._ordinal[dtype] = ordinal + 1
        kept = self._buffers.get((dtype, ordinal))
        if kept is None or kept[0].size < numel:
            buffer = self._reducer.ops.empty(max(numel, bucket_capacity(self.bucket_size, dtype)), dtype)
            kept = self._buffers[(dtype, ordinal)] = (buffer, GradBucket(0, buffer, (), self.group))
        buffer, bucket = kept  # the bucket object is kept with its buffer: nothing is made per step
        bucket.index, bucket.buffer, bucket.copies = len(self._layout) - 1, buffer[:numel], grads
        self._reducer.launch(bucket, ReduceOp.AVG, async_op=self.strategy is GradSyncStrategy.OVERLAPPED)

    def _launch_items(self, dtype: np.dtype, items: List[Tuple[int, np.ndarray]]) -> None:
        grads = [grad for _, grad in items]
        self._launch(dtype, tuple(index for index, _ in items), grads, sum(grad.size for grad in grads))

    def _complete(self, timeout: Optional[float]) -> None:
        """Wait for the buckets in flight, write their averages back, end the step."""
        try:
            self._reducer.complete(timeout=timeout)
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
        if self._reducer.ops is None:
            self._reducer.ops = ops
        elif ops.name != self._reducer.ops.name:
            raise UnsupportedDtypeError(f"{what}: gradients in {ops.name} memory, but this synchronizer's buckets "
                                        f"are in {self._reducer.ops.name} memory (one synchronizer per kind of memory)")
        return self._reducer.ops

    @staticmethod
    def _device_dtype(grad: Any, what: str) -> np.dtype:
        check_array(grad, what, writable=True)
        return grad.dtype

    def _plan(self, grads: List[np.ndarray]) -> List[Tuple[np.dtype, Tuple[int, ...], int]]:
        """The layout of ``grads`` with each bucket's element count, cached by sizes and dtypes."""
        what = "GradientSynchronizer.synchronize: grads"
        if self._reducer.ops.name == "host":
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


__all__ = ["GradientSynchronizer"]
