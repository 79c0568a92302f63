"""A step being captured as a CUDA graph, as the layers below ``axonhpc.cuda.graphs`` see it.

[Note: capturing a step]
While a stream captures nothing runs: kernels become graph nodes, replayed later with the same arguments.
So under ``recording`` (a capture, or ``GraphedStep``'s eager warm-up):

- **Reads of device values** wait for the device, which a capture forbids: losses return 0-d device
  arrays, and checks go to ``defer_check`` to be read after the step.
- **Host values that change per step** would be frozen into the graph (Adam's bias corrections).
  Optimizers read them from device memory written before each launch (``before_replay``). That memory
  comes from outside the graph's pool (``host_written``): within a launch the graph reuses freed
  temporaries' blocks, so a host-filled block could be overwritten (on an H100 the first captured step
  read its learning rate from the backward's gradients).
- **Collectives** on a stream (NCCL) are captured; each replay is compared instead (``collectives.graphed``).

What cannot work under a capture says so with ``refuse`` (``GraphCaptureError``).

[Note: deferred reads]
A GPU step that reads its loss as a float stops the host between forward and backward, and the device
idles while the backward is launched (0.7 ms of a 10 ms MLP step on an H100). ``defer_reads()`` is a
recording that captures nothing: losses and norms stay on the device, checks are read as it ends.
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
        xp: the step's array module (None in ``defer_reads``: numbers stay numbers).
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
    """Have ``check(values.get())`` called once the step has run (in ``defer_reads``, after an event on ``values``)."""
    record = current()
    record.checks.append((values, check))
    if not record.graphed:
        record.events.append(array_module(values).cuda.get_current_stream().record())


def read_checks(checks: List[Tuple[Any, Callable[[Any], None]]], events: Sequence[Any] = ()) -> None:
    """Read the deferred checks' values in one float64 read (each read is a round trip), and run each check.

    With ``events``, the read waits for those events only, on its own stream, so queued work goes on.
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
    """Keep device values on the device inside the block: [Note: deferred reads].

    Losses on device arrays return 0-d device arrays and ``clip_grad_norm`` the norm as one; the cross-entropy's
    target check is read when the block ends, so a bad target's ``ShapeError`` comes after the step has run.
    Host arrays are unaffected.
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
    """An empty device array, outside the graph's pool, that the host writes between launches (``xp.empty`` outside a capture)."""
    record = current()
    if record is None or not record.capturing or record.host_allocator is None:
        return xp.empty(shape, dtype)
    with xp.cuda.using_allocator(record.host_allocator):
        return xp.empty(shape, dtype)


def note_collective(group: Any, desc: Tuple[int, ...], text: str) -> None:
    """Record that the capture holds a collective on ``group`` (its descriptor words, and how messages name it)."""
    current().collectives.append((group, desc, text))


def refuse(what: str, why: str) -> None:
    """Raise ``GraphCaptureError`` for ``what`` if this thread is capturing a CUDA graph."""
    if capturing():
        raise GraphCaptureError(f"{what} cannot be captured in a CUDA graph: {why}")


__all__ = ["Recording", "recording", "current", "capturing", "defers_reads", "in_graphed_step", "defer_check",
           "read_checks", "defer_reads", "before_replay",
           "host_written",
           "note_collective", "refuse"]
