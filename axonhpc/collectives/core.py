"""Collectives on arrays: checks first, then one backend call.

[Note: what this layer adds over a backend]
Every argument is checked before anything is sent. ``ReduceOp.AVG`` is a SUM
then a division (floor for integers). float16 and bfloat16 have no MPI
reduction, so they are reduced in a float32 copy and rounded back once.
"""
from __future__ import annotations

import importlib
import time
from typing import Any, NoReturn, Optional

import numpy as np

from .._dtypes import array_module, check_array, is_cupy_array, is_low_precision_float
from ..backends.base import CompletedWork, ReduceOp, Work
from ..cuda import capture
from ..errors import AxonError, CollectiveStallError, CollectiveTimeoutError, ReadOnlyBufferError, ShapeError, replacing
from ..groups import ProcessGroup, resolve_group
from ..observe import tracing
from ..settings import settings
from . import (agreement, engine_calls, fast_path, fingerprint, flight, graphed, routes, shm_path, staged_path,
               stragglers, watch, watchdog)
from .group_state import state_of
from .ring import ring_all_reduce, ring_reduce_scatter
from .widen import divide_average, work_dtype


def member(group: Optional[ProcessGroup], op: str) -> ProcessGroup:
    return resolve_group(group).require_member(op)


def refuse_call(pg: ProcessGroup, op: str, problem: AxonError, x: Any = None, async_op: bool = False) -> NoReturn:
    """This rank's arguments failed a check: tell the group's other ranks, then raise ``problem`` ([Note: a refusal on one rank])."""
    agreement.refuse_locally(pg, op, problem, nonblocking=async_op and not is_cupy_array(x) and not settings.deterministic)


# Why a route cannot be captured in a CUDA graph (see [Note: collectives in a graph] in ``graphed``).
_RING_IN_GRAPH = ("deterministic mode (ax.settings.deterministic) reduces floats in the ring's fixed order, point "
                  "to point from the host; capture with deterministic mode off")


class CallLabel:
    """How messages name one call; formatted only when a message needs it."""

    __slots__ = ("op", "seq", "group", "entry", "call")

    def __init__(self, op: str, seq: int, group: ProcessGroup, entry: Optional[list] = None,
                 call: tuple = (None, None, None)):
        self.op, self.seq, self.group, self.entry = op, seq, group, entry
        self.call = call  # (x, reduce op name, root): what the ranks must agree on

    def desc(self) -> tuple:
        """The call's descriptor, compared across the ranks (see ``agreement``)."""
        return agreement.describe(self.op, *self.call)

    def refuse(self) -> None:
        """The ranks disagreed about this call: raise the same error on every rank."""
        agreement.refuse(self.group, self.seq, self.op, *self.call)

    def __str__(self) -> str:
        return fingerprint.call_name(self.op, self.seq, self.group)


_OP_NAMES = {op: op.name for op in ReduceOp}  # Enum.name is a slow property; this is on every call


def start_call(pg: ProcessGroup, op: str, x: Any = None, reduce: Optional[ReduceOp] = None,
           root: Optional[int] = None) -> CallLabel:
    """Flight record, debug check and sequence number; returns the label used in messages."""
    agreement.flush(pg)  # earlier asynchronous calls start first, in the same order on every rank
    debug = pg.debug_enabled()
    reduce_name = None if reduce is None else _OP_NAMES[reduce]
    entry = flight.record(pg, op, x, reduce_name, root, fingerprint.caller_location() if debug else None)
    if debug:
        fingerprint.check(pg, op, x, reduce_name, root)
    label = CallLabel(op, pg.seq, pg, entry, (x, reduce_name, root))
    pg.seq += 1
    return label


def run_call(pg: ProcessGroup, label: CallLabel, issue, async_op: bool, carried: bool = False,
         carry: Optional[ReduceOp] = None) -> Any:
    """Compare the call across ranks (unless ``carried``), then call ``issue(nonblocking)``: its Work, or wait for it."""
    # In a CUDA graph capture nothing runs, so nothing can be waited for on the host: no timeout, no
    # arrival notices; the call is ordered on the stream (see [Note: collectives in a graph]).
    timeout = None if capture.capturing() else pg.effective_timeout()
    collective = isinstance(label, CallLabel)  # point-to-point calls carry a plain text label
    # Every rank announces each timed call, blocking or not (a rank may wait where another does not).
    arrivals = pg.backend.announce(label.seq, label.op) if collective and timeout is not None else None
    entry = label.entry if collective else None
    # An asynchronous call is noted too: the node's engine runs it (and its check) before returning.
    key = watchdog.blocking(pg, entry, label)
    try:
        result = _checked_run(pg, label, issue, async_op, carried, timeout, collective, arrivals, entry, carry)
    finally:
        if key is not None:
            watchdog.unblocked(key)
    every = settings.straggler_every
    if every and collective and not (label.seq + 1) % every and not (label.call and is_cupy_array(label.call[0])):
        stragglers.compare(pg, label.seq + 1)  # host calls only (see stragglers)
    return result


def makes_nonblocking(pg: ProcessGroup, async_op: bool, timeout: Optional[float], collective: bool = True) -> bool:
    """Whether this rank makes a call nonblocking (its check tells the other ranks, [Note: blocking and nonblocking
    twins] in agreement): asked to, under a timeout, or while another call of this thread waits.

    Nonblocking too while a call waits for its check ([Note: calls waiting for their check, across groups]
    in agreement): over MPI the wait must poll (the node's engine waits inside C either way). A collective's
    own group's calls were issued by start_call. ``elsewhere`` first (it reads a list: a group that never
    made a call has no engine to look up); ``still_waiting_elsewhere`` last, never for a call the engine
    carries: its round of ``progress`` may issue a call into the engine, which waits there for the others.
    Over MPI it must poll as well while calls are in flight in the node's engine ([Note: calls in flight in
    the engine]); a call the engine carries goes in its queue whatever ``nonblocking`` says.
    """
    own_too = not collective
    return async_op or timeout is not None or (
        bool(agreement._PENDING) and agreement.elsewhere(pg, own_too)
        and (not collective or agreement.node_engine(pg) is None)
        and agreement.still_waiting_elsewhere(pg, own_too)) or (
        bool(engine_calls.BUSY) and engine_calls.busy_here())


def _checked_run(pg: ProcessGroup, label: Any, issue, async_op: bool, carried: bool, timeout: Optional[float],
                 collective: bool, arrivals: Any, entry: Optional[list], carry: Optional[ReduceOp] = None) -> Any:
    """``run_call``'s body: the agreement check, the call, and the wait (a blocking call's, which the watchdog sees)."""
    pending = None
    way = agreement.AS_PLANNED
    nonblocking = makes_nonblocking(pg, async_op, timeout, collective)
    if collective and not carried and async_op and not is_cupy_array(label.call[0]):
        # A host call may start once its check is done (MPI progresses each communicator on its own).
        # A device call may not: NCCL runs the calls of all its communicators in the order they were
        # queued, so one started later on some ranks than on others could deadlock the GPUs.
        pending = agreement.start_check(pg, label.seq, label.op, *label.call)
    elif collective and not carried:
        way = agreement.check(pg, label.seq, label.op, *label.call, arrivals=arrivals, label=label, carry=carry,
                              nonblocking=nonblocking)
    start = time.perf_counter()
    try:
        if pending is not None:  # issued once the check is done (agreement.CheckedWork)
            work: Work = agreement.CheckedWork(pg, pending, lambda: issue(True))
        elif way == agreement.CARRIED:
            work = CompletedWork()
        else:  # nonblocking where any rank makes it so ([Note: blocking and nonblocking twins])
            work = issue(nonblocking or way == agreement.NONBLOCKING)
    except agreement.EngineMismatch as exc:
        agreement.explain_mismatch(label.refuse, exc)
    except CollectiveStallError:
        raise  # the watchdog's verdict, which says all there is to say
    except CollectiveTimeoutError as exc:  # the shared-memory engine timed out inside the call
        if arrivals is None:
            raise
        raise replacing(watch.engine_timed_out(exc, timeout, label, arrivals, pg), exc, settings.debug)
    work.label = label
    _trace(work, start, label, collective)
    if async_op:
        if type(work) is engine_calls.EngineWork:
            work.labelled()
        if type(work) is not CompletedWork:  # ProcessGroup.destroy waits for it (GroupState.complete)
            state_of(pg).note_started(work)
        if entry is not None:
            work.then(lambda: entry.__setitem__(flight.DONE, True))
        if timeout is not None:  # wait() waits as long as a blocking call would
            watch.arm(work, timeout, label, arrivals, pg)
        return work
    if arrivals is None and not (collective and timeout is not None and pg.debug_enabled()):
        result = work.wait(timeout)
    else:
        result = watch.wait(work, timeout, label, arrivals, pg)
    if entry is not None:
        entry[flight.DONE] = True
    return result


def _trace(work: Work, start: float, label: Any, collective: bool) -> None:
    """A timeline span for this call, from its start until its completion is seen (if a timeline records)."""
    if tracing.active() is None:
        return
    if collective:
        entry = label.entry
        dtype = None if entry is None else entry[flight.DTYPE]
        tracing.span_until_done(work, start, label.op, "comm", seq=label.seq, group=label.group.name,
                                dtype=None if dtype is None else str(dtype),
                                shape=None if entry is None else entry[flight.SHAPE])
    else:
        tracing.span_until_done(work, start, str(label).split(" ")[0], "comm", what=str(label))


def _reduction(pg: ProcessGroup, x, out, op: ReduceOp, issue_on, result=None):
    """Shared AVG / widening for all_reduce and reduce_scatter (``widen``); ``issue_on(src, dst, base_op, nonblocking)``."""
    base = ReduceOp.SUM if op is ReduceOp.AVG else op
    wide = work_dtype(x.dtype, op)
    if wide is not None:
        src = x.astype(wide)
        dst = src if out is x else array_module(x).empty(out.shape, dtype=wide)
    else:
        src, dst = x, out

    def finish():
        divide_average(dst, op, pg.size)
        if dst is not out:
            out[...] = dst.astype(out.dtype)

    def issue(nonblocking):
        work = issue_on(src, dst, base, nonblocking).then(finish)
        work._result = result
        return work

    return issue


# -- reductions ------------------------------------------------------------------------
def native_all_reduce(x, op=ReduceOp.SUM, group: Optional[ProcessGroup] = None, async_op: bool = False):
    """Reduce ``x`` over the group, in place, in one backend call (what ``ax.all_reduce`` does with "native").

    Raises:
        NotAMemberError, UnsupportedDtypeError, NonContiguousBufferError,
        ReadOnlyBufferError, CollectiveTimeoutError.
    """
    if not async_op and fast_path.attempt(fast_path.ALL_REDUCE, x, group, op) is not fast_path.NOT_TAKEN:
        return None
    pg = member(group, "all_reduce")
    try:
        op = ReduceOp.parse(op)
        check_array(x, "all_reduce buffer", writable=True)
    except AxonError as exc:
        refuse_call(pg, "all_reduce", exc, x, async_op)
    return checked_all_reduce(x, op, pg, async_op)


def checked_all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup, async_op: bool) -> Any:
    """The native all-reduce's general path, once ``x``, ``op`` and membership of ``pg`` are checked."""
    graphed.admit(pg, "all_reduce", x, _OP_NAMES[op], why_not=_RING_IN_GRAPH if shm_path.fixed_order(x, op) else None)
    label = start_call(pg, "all_reduce", x, op)
    route, node = routes.choose(pg, x, "all_reduce", op, async_op)
    if route is routes.ONE_RANK:
        work = CompletedWork()
        _trace(work, time.perf_counter(), label, True)
        work.wait()  # nothing to wait for: marks it finished (and ends its timeline span)
        return work if async_op else None
    backend = pg.backend
    issue = _reduction(pg, x, x, op, lambda s, d, base, nb: backend.all_reduce(s, base, nb))
    if route is routes.STAGED:  # unless another rank's call is nonblocking: then whole, as its is
        return run_call(pg, label, lambda nb: issue(True) if nb else staged_path.all_reduce(pg, x, op), False)
    if route is routes.RING:
        agreement.check(pg, label.seq, "all_reduce ring", x, label.call[1])  # point to point: no native call meets it
        ring_all_reduce(x, op, pg)
        return CompletedWork() if async_op else None
    if route is routes.NODE:
        desc = label.desc()
        return run_call(pg, label, lambda nb: node.all_reduce(x, x, op, desc, async_op), async_op, carried=True)
    if route is routes.NODE_WIDENED:
        desc = label.desc()
        issue = _reduction(pg, x, x, op, lambda s, d, base, nb: node.all_reduce(s, d, base, desc, async_op))
        return run_call(pg, label, issue, async_op, carried=True)
    # A blocking call that ``_reduction`` passes through unchanged may go with its check (collectives.carried).
    carry = op if not async_op and op is not ReduceOp.AVG and not is_low_precision_float(x.dtype) else None
    return run_call(pg, label, issue, async_op, carry=carry)


def _result_buffer(x: Any, out: Any, shape: tuple, op: str, what: str) -> Any:
    """``out``, checked to fit a result of ``shape`` and ``x``'s dtype (else ShapeError), or a new array."""
    if out is None:
        return array_module(x).empty(shape, dtype=x.dtype)
    check_array(out, f"{op} out", writable=True)
    if tuple(out.shape) != shape or out.dtype != x.dtype:
        raise ShapeError(f"{op}: out is {out.dtype} of shape {tuple(out.shape)}; {what} is {x.dtype} of shape {shape}")
    return out


def _apart(x: Any, out: Any) -> Any:
    """``x``, or a copy of it where it overlaps ``out``: MPI refuses aliased buffers, and a result written over
    its own input would read parts already overwritten."""
    if is_cupy_array(x):  # both contiguous (checked): their byte ranges tell
        a, b = x.data.ptr, out.data.ptr
        overlaps = a < b + out.nbytes and b < a + x.nbytes
    else:
        overlaps = np.may_share_memory(x, out)
    return x.copy() if overlaps else x


def reduce_scatter(x, op=ReduceOp.SUM, group: Optional[ProcessGroup] = None, async_op: bool = False,
                   out=None):
    """Reduce ``x`` over the group and give rank i the i-th part along axis 0.

    Args:
        out: a reusable buffer for this rank's part (a fresh one's first touch costs about the copy); None allocates.

    Raises:
        ShapeError: ``x`` is 0-d, ``x.shape[0]`` is not divisible by the size, or ``out`` is wrong.
    """
    if not async_op:
        part = fast_path.attempt(fast_path.REDUCE_SCATTER, x, group, op, out=out)
        if part is not fast_path.NOT_TAKEN:
            return part
    pg = member(group, "reduce_scatter")
    try:
        op = ReduceOp.parse(op)
        check_array(x, "reduce_scatter input")
        if x.ndim == 0 or x.shape[0] % pg.size != 0:
            raise ShapeError(
                f"reduce_scatter: input shape {tuple(x.shape)} must have a first dimension divisible by the group "
                f"size {pg.size}" + ("" if x.ndim == 0 else f" ({x.shape[0]} % {pg.size} = {x.shape[0] % pg.size})"))
        out = _result_buffer(x, out, (x.shape[0] // pg.size,) + tuple(x.shape[1:]), "reduce_scatter",
                             "this rank's part")
    except AxonError as exc:
        refuse_call(pg, "reduce_scatter", exc, x, async_op)
    x = _apart(x, out)
    graphed.admit(pg, "reduce_scatter", x, _OP_NAMES[op],
                  why_not=_RING_IN_GRAPH if shm_path.fixed_order(x, op) else None)
    label = start_call(pg, "reduce_scatter", x, op)
    route, node = routes.choose(pg, x, "reduce_scatter", op)
    if route is routes.RING:
        return run_call(pg, label, lambda nb: ring_reduce_scatter(x, out, op, pg), async_op)
    if route is routes.NODE:
        desc = label.desc()
        return run_call(pg, label, lambda nb: node.reduce_scatter(x, out, op, desc, async_op), async_op, carried=True)
    if route is routes.NODE_WIDENED:
        desc = label.desc()
        issue = _reduction(pg, x, out, op, lambda s, d, base, nb: node.reduce_scatter(s, d, base, desc, async_op), out)
        return run_call(pg, label, issue, async_op, carried=True)
    backend = pg.backend
    issue = _reduction(pg, x, out, op, lambda s, d, base, nb: backend.reduce_scatter(s, d, base, nb), out)
    return run_call(pg, label, issue, async_op)


def reduce_scatter_sum(x, group=None, async_op=False):
    """``reduce_scatter`` with ``ReduceOp.SUM``."""
    return reduce_scatter(x, ReduceOp.SUM, group, async_op)


def reduce_scatter_mean(x, group=None, async_op=False):
    """``reduce_scatter`` with ``ReduceOp.AVG``."""
    return reduce_scatter(x, ReduceOp.AVG, group, async_op)


# -- data movement ----------------------------------------------------------------------
def broadcast(x, src: int = 0, group: Optional[ProcessGroup] = None, async_op: bool = False):
    """Copy ``x`` of group rank ``src`` into ``x`` on every rank (in place).

    ``x`` must be writable on the source too: else the source would send to ranks that had already refused.

    Raises:
        RankError: ``src`` out of range for the group.
        ReadOnlyBufferError: ``x`` is read-only (on any rank).
    """
    if not async_op and fast_path.attempt(fast_path.BROADCAST, x, group, root=src) is not fast_path.NOT_TAKEN:
        return None
    pg = member(group, "broadcast")
    try:
        src = pg.check_rank(src, "broadcast src")
        if isinstance(x, np.ndarray) and not x.flags.writeable:
            role = " (the source)" if pg.rank == src else ""
            raise ReadOnlyBufferError(
                f"broadcast buffer ({x.dtype} array of shape {x.shape}) on group rank {pg.rank}{role} of group "
                f"{pg.name} is read-only; a broadcast buffer must be writable on every rank, the source included "
                f"(src={src}), so that every rank refuses it alike before anything is sent")
        check_array(x, "broadcast buffer", writable=True)
    except AxonError as exc:
        refuse_call(pg, "broadcast", exc, x, async_op)
    graphed.admit(pg, "broadcast", x, root=src)
    label = start_call(pg, "broadcast", x, root=src)
    backend = pg.backend
    route, node = routes.choose(pg, x, "broadcast")
    if route is routes.NODE:
        desc = label.desc()
        return run_call(pg, label, lambda nb: node.broadcast(x, src, desc, async_op), async_op, carried=True)
    return run_call(pg, label, lambda nb: backend.broadcast(x, src, nb), async_op)


def all_gather(x, group: Optional[ProcessGroup] = None, async_op: bool = False, out=None):
    """Every rank's ``x``, stacked: result ``[i]`` is rank i's array.

    Args:
        out: a reusable result buffer (for 64 MiB a fresh one's page faults cost as much as the transfer).

    Raises:
        ShapeError: ``out`` has the wrong shape or dtype.
    """
    if not async_op:
        result = fast_path.attempt(fast_path.ALL_GATHER, x, group, out=out)
        if result is not fast_path.NOT_TAKEN:
            return result
    pg = member(group, "all_gather")
    try:
        check_array(x, "all_gather input")
        out = _result_buffer(x, out, (pg.size,) + tuple(x.shape), "all_gather", "the result")
    except AxonError as exc:
        refuse_call(pg, "all_gather", exc, x, async_op)
    x = _apart(x, out)
    graphed.admit(pg, "all_gather", x)
    label = start_call(pg, "all_gather", x)
    route, node = routes.choose(pg, x, "all_gather")
    if route is routes.NODE:
        desc = label.desc()
        return run_call(pg, label, lambda nb: node.all_gather(x, out, desc, async_op), async_op, carried=True)
    backend = pg.backend
    return run_call(pg, label, lambda nb: backend.all_gather(x, out, nb), async_op)


def gather(x, dst: int = 0, group: Optional[ProcessGroup] = None, async_op: bool = False):
    """Stack every rank's ``x`` on group rank ``dst``.

    Returns:
        On ``dst`` an array of shape ``(size, *x.shape)``; None elsewhere.
    """
    pg = member(group, "gather")
    try:
        dst = pg.check_rank(dst, "gather dst")
        check_array(x, "gather input")
    except AxonError as exc:
        refuse_call(pg, "gather", exc, x, async_op)
    graphed.admit(pg, "gather", x, root=dst, why_not="NCCL has no gather (it is grouped sends and receives, "
                                                     "which axonhpc does not capture)")
    out = array_module(x).empty((pg.size,) + tuple(x.shape), dtype=x.dtype) if pg.rank == dst else None
    label = start_call(pg, "gather", x, root=dst)
    backend = pg.backend
    return run_call(pg, label, lambda nb: backend.gather(x, out, dst, nb), async_op)


_HEADER = 34  # status, dtype index, ndim, up to 31 dimensions
_SCATTER_OK, _SCATTER_FAILED, _SCATTER_OK_DEVICE = 0, 1, 2  # the header's status: the source's array kind, or failure


def scatter(x, src: int = 0, group: Optional[ProcessGroup] = None, async_op: bool = False):
    """Give rank i the part ``x[i]`` of group rank ``src``'s array (others pass None).

    The part's shape and dtype travel in a small header, so a wrong ``x`` on ``src`` is reported everywhere.

    Raises:
        ShapeError: on every rank, if ``x.shape[0]`` on ``src`` is not the group size.
    """
    from .._dtypes import supported_dtypes

    pg = member(group, "scatter")
    try:
        src = pg.check_rank(src, "scatter src")
    except AxonError as exc:
        refuse_call(pg, "scatter", exc)  # the others' check before the header hears it (a blocking step)
    graphed.admit(pg, "scatter", None, root=src, why_not="the part's shape travels first in a host message, and "
                                                         "NCCL has no scatter (grouped sends and receives)")
    backend = pg.backend
    header = np.zeros(_HEADER, dtype=np.int64)
    problem: Optional[Exception] = None
    if pg.rank == src:
        try:
            check_array(x, "scatter input")
            if x.ndim == 0 or x.shape[0] != pg.size:
                raise ShapeError(f"scatter: the source array on group rank {src} has shape {tuple(x.shape)}; "
                                 f"its leading size must equal the group size {pg.size}")
            if x.ndim - 1 > _HEADER - 3:
                raise ShapeError(f"scatter: arrays of {x.ndim} dimensions are not supported (at most {_HEADER - 2})")
            # The receivers make their part where the source's array lives: a device array travels
            # device to device (NCCL) and must meet device buffers on every rank.
            status = _SCATTER_OK_DEVICE if array_module(x) is not np else _SCATTER_OK
            header[:3] = (status, list(supported_dtypes()).index(x.dtype), x.ndim - 1)
            header[3:3 + x.ndim - 1] = x.shape[1:]
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here
            problem = exc
            header[0] = _SCATTER_FAILED
    label = start_call(pg, "scatter", None, root=src)
    send = x if pg.rank == src else None
    # A device call must be queued when it is made (NCCL runs its communicators' calls in the order they were
    # queued, see ``_checked_run``), and only the source knows whether its array is one: where the backend
    # carries device arrays the part goes at once, after the header (waited for). Elsewhere the header and the
    # part are the steps of one nonblocking call, issued in the group's order like any other.
    eager = backend.host_side() is not backend

    def issue_part(nb: bool) -> Work:
        """The part, once the header is in: raise the source's problem on every rank, or scatter."""
        if header[0] not in (_SCATTER_OK, _SCATTER_OK_DEVICE):
            if problem is not None:
                raise problem
            raise ShapeError(f"scatter: the source array on group rank {src} was invalid (see the error on that "
                             f"rank)")
        dtype = supported_dtypes()[int(header[1])]
        shape = tuple(int(d) for d in header[3:3 + int(header[2])])
        if pg.rank == src:
            xp = array_module(x)
        else:
            xp = importlib.import_module("cupy") if header[0] == _SCATTER_OK_DEVICE else np
        return backend.scatter(send, xp.empty(shape, dtype=dtype), src, nb)

    def issue(nb: bool) -> Work:
        """The header, then the part, both made as the check agreed (every rank blocking, or every rank not:
        [Note: blocking and nonblocking twins])."""
        head = backend.broadcast(header, src, nb)
        if not nb or eager:
            head.wait()
            return issue_part(nb)
        # The part is issued once the header is in, before anything else of the group goes (a CheckedWork
        # whose "check" is the header), so ahead of the group's calls made after this one.
        part = agreement.CheckedWork(pg, (head, _nothing), lambda: issue_part(True))
        waiting = state_of(pg).unissued
        if waiting[0] is not part:
            waiting.remove(part)
            waiting.insert(0, part)
        part.label = label
        return part

    if async_op and eager:  # checked before it returns, as a device call is (the part goes at once)
        agreement.check(pg, label.seq, "scatter", None, None, src, nonblocking=True)
        return run_call(pg, label, issue, async_op, carried=True)
    # Every rank must name one src before the header: the check, as for any call (its way, ``makes_nonblocking``).
    return run_call(pg, label, issue, async_op)


def _nothing() -> None:
    """A step with nothing to verify."""


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False):
    """Return once every rank of the group has entered the barrier."""
    pg = member(group, "barrier")
    graphed.admit(pg, "barrier", why_not="a barrier waits on the host, which a graph's replay does not")
    label = start_call(pg, "barrier")
    backend = pg.backend
    return run_call(pg, label, lambda nb: backend.barrier(nb), async_op)


# -- facts ------------------------------------------------------------------------------------
def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in the group (-1 if not a member)."""
    return resolve_group(group).rank


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in the group."""
    return resolve_group(group).size


def is_main_process(group: Optional[ProcessGroup] = None) -> bool:
    """True on rank 0 of the group."""
    return resolve_group(group).rank == 0
