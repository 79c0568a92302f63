"""A step being captured as a CUDA graph, as the layers below ``axonhpc.cuda.graphs`` see it.

[Note: capturing a step]
While a stream captures, nothing runs: kernels and copies become graph nodes, replayed later on the
same memory with the same arguments. So three things change under ``recording`` (a capture, or
``GraphedStep``'s eager warm-up, so every call returns the same kinds of values):

- **Reads of device values** (a loss as a float, a targets' range check, a norm to clip by) wait
  for the device, which a capture forbids. Losses return 0-d device arrays instead, and checks are
  handed to ``defer_check`` to be read after the step.
- **Host values that change per step** would be frozen into the graph (Adam's step-5 bias
  corrections replayed forever). Optimizers read them from device memory and register with
  ``before_replay`` the host code that writes them before each launch. That memory comes from
  outside the graph's pool (``host_written``): within a launch the graph reuses freed temporaries'
  blocks, so a host-filled block could be overwritten by an earlier node. The first captured
  optimizer step on an H100 read its learning rate from such a block: the backward's gradients.
- **Collectives** issued on a stream (NCCL) are captured; the agreement check runs once at capture
  and each replay is compared instead (``collectives.graphed``).

What cannot work under a capture says so with ``refuse`` (``GraphCaptureError``) instead of leaving
cupy's or CUDA's error to be decoded.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ..errors import GraphCaptureError


class Recording:
    """What one call of a graphed step handed over: checks to read, and work before each replay.

    Args:
        capturing: a CUDA graph is being captured (False: an eager call whose reads are deferred).
        xp: the array module of the step's inputs (cupy), for layers that make device values of host ones.
    """

    def __init__(self, capturing: bool, xp: Any = None, host_allocator: Any = None) -> None:
        self.capturing = bool(capturing)
        self.xp = xp
        self.host_allocator = host_allocator  # the allocator in force before the capture (see host_written)
        self.checks: List[Tuple[Any, Callable[[Any], None]]] = []
        self.before_replay: List[Callable[[], None]] = []
        self.collectives: List[Tuple[Any, Tuple[int, ...], str]] = []


_state = threading.local()
EVER_RECORDED = False  # a graphed step has been called in this process (hot paths test this first)


@contextlib.contextmanager
def recording(record: Recording) -> Iterator[Recording]:
    """Make ``record`` this thread's recording inside the block."""
    global EVER_RECORDED
    EVER_RECORDED = True
    if current() is not None:
        raise GraphCaptureError("a graphed step was called inside another graphed step's call; graphed steps "
                                "do not nest")
    _state.record = record
    try:
        yield record
    finally:
        _state.record = None


def current() -> Optional[Recording]:
    """This thread's recording, or None outside a graphed step's call."""
    return getattr(_state, "record", None)


def capturing() -> bool:
    """Whether this thread is capturing a CUDA graph."""
    record = current()
    return record is not None and record.capturing


def defers_reads() -> bool:
    """Whether device values are to stay on the device (see the module note)."""
    return current() is not None


def defer_check(values: Any, check: Callable[[Any], None]) -> None:
    """Have ``check(values.get())`` called once the step has run (it raises if the values are bad)."""
    current().checks.append((values, check))


def before_replay(fn: Callable[[], None]) -> None:
    """Have ``fn()`` called before every launch of the graph being captured (in registration order)."""
    current().before_replay.append(fn)


def host_written(xp: Any, shape: Any, dtype: Any) -> Any:
    """An empty device array the host writes between launches and the graph being captured reads.

    Allocated outside the graph's own pool (see the module note); outside a capture, a plain ``xp.empty``.
    """
    record = current()
    if record is None or not record.capturing or record.host_allocator is None:
        return xp.empty(shape, dtype)
    with xp.cuda.using_allocator(record.host_allocator):
        return xp.empty(shape, dtype)


def note_collective(group: Any, desc: Tuple[int, ...], text: str) -> None:
    """Record that the capture holds a collective on ``group`` (its descriptor words, and how messages name it)."""
    current().collectives.append((group, desc, text))


def refuse(what: str, why: str) -> None:
    """Raise ``GraphCaptureError`` for ``what`` if this thread is capturing a CUDA graph.

    Raises:
        GraphCaptureError: "<what> cannot be captured in a CUDA graph: <why>".
    """
    if capturing():
        raise GraphCaptureError(f"{what} cannot be captured in a CUDA graph: {why}")


__all__ = ["Recording", "recording", "current", "capturing", "defers_reads", "defer_check", "before_replay",
           "host_written",
           "note_collective", "refuse"]
