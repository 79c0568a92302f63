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

[Note: deferred reads]
The first rule is useful without a graph. A plain step on a GPU that reads its loss as a float
stops the host between the forward and the backward, and the device then idles while the host
launches the backward's first kernels: on an H100, 0.7 ms of a 10 ms MLP step. ``defer_reads()``
is a block under a recording that captures nothing (``graphed=False``): its losses and clipping
norms stay on the device, and its checks are read as it ends.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from .._dtypes import array_module
from ..errors import GraphCaptureError


class Recording:
    """What one call of a graphed step handed over: checks to read, and work before each replay.

    Args:
        capturing: a CUDA graph is being captured (False: an eager call whose reads are deferred).
        xp: the array module of the step's inputs (cupy), for layers that make device values of host ones
            (None in ``defer_reads``: numbers stay numbers).
        graphed: a call of a graphed step (False: a ``defer_reads`` block).
    """

    def __init__(self, capturing: bool, xp: Any = None, host_allocator: Any = None, graphed: bool = True) -> None:
        self.capturing = bool(capturing)
        self.graphed = bool(graphed)
        self.xp = xp
        self.host_allocator = host_allocator  # the allocator in force before the capture (see host_written)
        self.checks: List[Tuple[Any, Callable[[Any], None]]] = []
        self.events: List[Any] = []  # defer_reads: recorded after each check's values
        self.before_replay: List[Callable[[], None]] = []
        self.collectives: List[Tuple[Any, Tuple[int, ...], str]] = []


_state = threading.local()
EVER_RECORDED = False  # a graphed step has been called in this process (hot paths test this first)


@contextlib.contextmanager
def recording(record: Recording) -> Iterator[Recording]:
    """Make ``record`` this thread's recording inside the block."""
    global EVER_RECORDED
    EVER_RECORDED = EVER_RECORDED or record.graphed  # a defer_reads block captures nothing: hot paths stay fast
    if current() is not None:
        raise GraphCaptureError("a graphed step was called inside another graphed step's call or a defer_reads() "
                                "block; graphed steps do not nest")
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


def in_graphed_step() -> bool:
    """Whether this thread runs a call of a graphed step (its warm-up, capture or replay)."""
    record = current()
    return record is not None and record.graphed


def defer_check(values: Any, check: Callable[[Any], None]) -> None:
    """Have ``check(values.get())`` called once the step has run (it raises if the values are bad).

    In a ``defer_reads`` block an event is recorded after ``values``, so that the read waits for them only.
    """
    record = current()
    record.checks.append((values, check))
    if not record.graphed:
        record.events.append(array_module(values).cuda.get_current_stream().record())


def read_checks(checks: List[Tuple[Any, Callable[[Any], None]]], events: Sequence[Any] = ()) -> None:
    """Read the deferred checks' values, all in one read, and run each check (which raises if they are bad).

    Several checks are read as one float64 array (exact for their float32/float64 values and integers
    below 2**53): each read waits for the device, and a round trip costs tens of microseconds. With
    ``events`` (one recorded after each check's values), the read runs on a stream of its own that
    waits for those events only, so the work queued after them goes on while the host reads.
    """
    if not checks:
        return
    xp = array_module(checks[0][0])
    stream = _read_stream(xp) if events else None
    with stream if stream is not None else contextlib.nullcontext():
        for event in events:
            stream.wait_event(event)
        if len(checks) == 1:
            host = checks[0][0].reshape(-1).get(stream=stream)
        else:
            host = xp.concatenate([values.reshape(-1).astype("float64") for values, _ in checks]).get(stream=stream)
    offset = 0
    for values, check in checks:
        size = int(values.size)
        check(host[offset:offset + size].reshape(values.shape).astype(values.dtype))
        offset += size


@contextlib.contextmanager
def defer_reads() -> Iterator[None]:
    """Keep device values on the device inside the block: [Note: deferred reads]. ::

        with ax.defer_reads():
            loss = loss_fn(model(x), y)        # cupy logits: a 0-d device array, not a float
            model.backward(loss_fn.backward())
            opt.step()
        print(float(loss))                     # the read, after the whole step is queued

    Losses on device arrays return 0-d device arrays and ``clip_grad_norm`` the norm as one; the
    cross-entropy's target-range check is read when the block ends, so a step with a bad target has
    run (optimizer included) when its ``ShapeError`` comes. Host arrays are unaffected. Inside a
    graphed step's call, where reads are deferred already, the block does nothing more.
    """
    if current() is not None:
        yield
        return
    record = Recording(capturing=False, graphed=False)
    with recording(record):
        yield
    read_checks(record.checks, record.events)


def _read_stream(xp: Any) -> Any:
    """This thread's stream for deferred reads (one per thread and device, made on first use)."""
    streams = getattr(_state, "read_streams", None)
    if streams is None:
        streams = _state.read_streams = {}
    key = (id(xp), xp.cuda.runtime.getDevice())
    stream = streams.get(key)
    if stream is None:
        stream = streams[key] = xp.cuda.Stream(non_blocking=True)
    return stream


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


__all__ = ["Recording", "recording", "current", "capturing", "defers_reads", "in_graphed_step", "defer_check",
           "read_checks", "defer_reads", "before_replay",
           "host_written",
           "note_collective", "refuse"]
