"""``Reducer``: gradient buckets reduced over one group in launch order and completed together.

DDP launches its buckets as backward fills them, ``GradientSynchronizer`` as it packs them, and both complete
them the same way: wait for every bucket in flight, divide when the reduction was a sum, copy back what was
copied in. The pipeline's data-parallel replicas reduce through the synchronizer, so all three share it.
"""
from __future__ import annotations

import enum
import time
from typing import Any, List, Optional

from .._choices import parse_choice
from ..backends import ReduceOp
from ..backends.base import CompletedWork
from ..buffers import FlatOps
from ..collectives import all_reduce
from ..groups import resolve_group
from ..observe import tracing
from .bucket import GradBucket


class GradSyncStrategy(enum.Enum):
    """When gradients are averaged across the group.

    SYNCHRONOUS: bucket after bucket, waiting for each. OVERLAPPED: each bucket's all-reduce starts as soon as it
    is full, overlapping the rest of backward; the end of the step waits for all. NO_SYNC: nothing is sent.
    """

    SYNCHRONOUS = "synchronous"
    OVERLAPPED = "overlapped"
    NO_SYNC = "no_sync"

    @classmethod
    def parse(cls, value: Any) -> "GradSyncStrategy":
        """Accept a GradSyncStrategy or its name in any case; else UnknownChoiceError (an ``InvalidArgumentError``)."""
        return parse_choice(cls, value, "gradient sync strategy")


def finished(result: Optional[Any]) -> Any:
    """A communication hook's return value as a ``Work`` (a hook may return None when it finished in place)."""
    return CompletedWork() if result is None else result


class Reducer:
    """Reduce ``GradBucket``s over ``group``: an all-reduce each, or the communication hook when one is set.

    Args:
        group: the process group (None: the current world's default group, resolved at each call).
        ops: the flat-buffer operations of the buckets' memory (packs and unpacks ``copies``).

    Attributes:
        hook: ``(state, hook)`` of a communication hook (see ``parallel.comm_hooks``), or None.
        launched: the buckets launched since the last ``complete``, in launch order.
    """

    def __init__(self, group: Any, ops: Optional[FlatOps] = None):
        self.group = group
        self.ops = ops
        self.hook: Any = None
        self.launched: List[GradBucket] = []

    def launch(self, bucket: GradBucket, op: ReduceOp = ReduceOp.AVG, async_op: bool = True) -> None:
        """Pack the bucket's ``copies`` (if any) and start its reduction; blocking unless ``async_op``.

        Every rank must launch the same buckets in the same order (collective).
        """
        if bucket.copies is not None:
            self.ops.pack(bucket.copies, out=bucket.buffer)
        traced = tracing.EVER_INSTALLED and tracing.active() is not None
        start = time.perf_counter() if traced else 0.0
        if self.hook is not None:
            state, hook = self.hook
            work = finished(hook(state, bucket))
        else:  # a blocking all-reduce returns None as well
            work = finished(all_reduce(bucket.buffer, op, self.group, async_op=async_op))
        bucket.work, bucket.done = work, False
        self.launched.append(bucket)
        if traced:  # the span's arguments cost microseconds (a dtype's name): only when a timeline records
            tracing.span_until_done(work, start, f"bucket {bucket.index}", "buckets",
                                    elements=int(bucket.buffer.size), dtype=str(bucket.buffer.dtype))

    def reset(self) -> None:
        """Forget the buckets launched and not completed (a step that failed before ``complete``)."""
        self.launched = []

    def abandon(self) -> None:
        """A step failed: wait for the reductions still in flight (they write into the buckets), keep no result.

        The calls that another rank's refusal or a failed check stopped raise again here and are passed over.
        """
        launched, self.launched = self.launched, []
        for bucket in launched:
            try:
                bucket.work.wait()
            except Exception:  # noqa: BLE001 - the step's own error is the one raised
                pass

    def progress(self) -> None:
        """Test the reductions in flight, so MPI progresses them (see DDP's note on overlap and MPI progress)."""
        for bucket in self.launched:
            if not bucket.done:
                bucket.done = bucket.work.is_completed()

    def complete(self, divide_by: Optional[int] = None, timeout: Optional[float] = None) -> int:
        """Wait for every launched bucket, divide by ``divide_by`` (if given), write ``copies`` back.

        ``timeout``: seconds per reduction; None takes the group's (what a blocking all-reduce on it would wait).
        The launched list is emptied even when a wait fails. Returns how many buckets had been seen complete
        before this wait. Raises CollectiveTimeoutError.
        """
        launched, self.launched = self.launched, []
        seen_done = sum(1 for bucket in launched if bucket.done)
        if launched and timeout is None:
            timeout = resolve_group(self.group).effective_timeout()
        for bucket in launched:
            bucket.work.wait(timeout)
        for bucket in launched:
            if divide_by is not None:
                self.ops.xp.divide(bucket.buffer, divide_by, out=bucket.buffer)
            if bucket.copies is not None:
                self.ops.unpack(bucket.buffer, bucket.copies)
        return seen_done


__all__ = ["GradSyncStrategy", "Reducer", "finished"]
