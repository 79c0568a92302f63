"""Communication hooks: how DDP's buckets and FSDP's gradient shards are averaged.

[Note: the hook interface]
A hook is ``hook(state, bucket) -> Work | None``, registered with
``ddp.register_comm_hook(state, hook)`` or ``fsdp.register_comm_hook(state,
hook)`` before the first backward. ``bucket`` is a ``GradBucket``:

- ``kind == "all_reduce"`` (DDP): ``bucket.buffer`` is the flat gradient
  bucket; when the returned ``Work`` completes (or at once, if the hook
  returns None) the buffer must hold the group average.
- ``kind == "reduce_scatter"`` (FSDP): ``bucket.buffer`` is the unit's padded
  flat gradient; the ``Work``'s ``wait()`` must return this rank's averaged
  part (``buffer.size // group.size`` elements, part ``group.rank``).

Every rank must do the same communication in a hook, as with any collective.
``state`` is whatever the caller registered (an error-feedback residual, a
counter, None). ``allreduce_hook`` is what DDP and FSDP do without a hook;
``fp16_compress_hook`` and ``bf16_compress_hook`` send 16-bit floats
(``collectives.compressed``; the error they add is described there and
measured by the tests and ``axonhpc bench ddp --comm-hook``).
"""
from __future__ import annotations

from typing import Any, List, Optional

from ..backends import ReduceOp
from ..backends.base import CompletedWork
from ..collectives import all_reduce, compressed_all_reduce, compressed_reduce_scatter, reduce_scatter
from ..errors import InvalidArgumentError

KINDS = ("all_reduce", "reduce_scatter")


class GradBucket:
    """What a communication hook gets: one flat gradient buffer and where it comes from.

    Attributes:
        index: the bucket's place in the all-reduce order (DDP) or the unit's index (FSDP).
        buffer: the flat gradient (see the module note for what the hook must leave).
        names: names of the parameters whose gradients the buffer holds.
        group: the process group to average over.
        kind: "all_reduce" (DDP) or "reduce_scatter" (FSDP).
    """

    def __init__(self, index: int, buffer: Any, names: List[str], group: Any, kind: str):
        if kind not in KINDS:
            raise InvalidArgumentError(f"unknown bucket kind {kind!r}; use one of {KINDS}")
        self.index, self.buffer, self.names, self.group, self.kind = index, buffer, list(names), group, kind

    def __repr__(self) -> str:
        return (f"GradBucket(index={self.index}, kind={self.kind!r}, elements={self.buffer.size}, "
                f"dtype={self.buffer.dtype}, group={self.group.name!r})")


def allreduce_hook(state: Any, bucket: GradBucket) -> Any:
    """The default: an all-reduce (DDP) or reduce-scatter (FSDP) of the average, asynchronous."""
    if bucket.kind == "all_reduce":
        return all_reduce(bucket.buffer, ReduceOp.AVG, bucket.group, async_op=True)
    return reduce_scatter(bucket.buffer, ReduceOp.AVG, bucket.group, async_op=True)


def _compress_hook(wire: str):
    def hook(state: Any, bucket: GradBucket) -> Any:
        if bucket.kind == "all_reduce":
            compressed_all_reduce(bucket.buffer, wire, bucket.group)
            return None
        return CompletedWork(compressed_reduce_scatter(bucket.buffer, wire, bucket.group))

    hook.__name__ = f"{wire.replace('float', 'fp').replace('bfp', 'bf')}_compress_hook"
    hook.__doc__ = (f"Average with {wire} on the wire: half of float32's bytes, at the rounding error "
                    f"described in ``collectives.compressed``.")
    return hook


fp16_compress_hook = _compress_hook("float16")
bf16_compress_hook = _compress_hook("bfloat16")


def finished(result: Optional[Any]) -> Any:
    """A hook's return value as a ``Work`` (a hook may return None when it finished in place)."""
    return CompletedWork() if result is None else result


__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "finished", "KINDS"]
