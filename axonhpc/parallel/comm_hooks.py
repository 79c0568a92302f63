"""Communication hooks: how DDP's buckets and FSDP's gradient shards are averaged.

[Note: the hook interface]
A hook is ``hook(state, bucket) -> Work | None``, registered with
``ddp.register_comm_hook(state, hook)`` or ``fsdp.register_comm_hook(state,
hook)`` before the first backward. ``bucket`` is a ``GradBucket`` (the reducer's own bucket, ``axonhpc.bucketing``):

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

from typing import Any

from ..backends import ReduceOp
from ..backends.base import CompletedWork
from ..bucketing import KINDS, GradBucket, finished
from ..collectives import all_reduce, compressed_all_reduce, compressed_reduce_scatter, reduce_scatter


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


__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "finished", "KINDS"]
