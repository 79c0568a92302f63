"""The fast path of blocking collectives on plain host arrays: one eligibility check, one table of calls.

[Note: why a second path]
The general path (argument checks, records, agreement, ``core.run_call``'s timeouts and timeline spans)
is over a hundred Python calls, which at 8 bytes are the whole cost of an all-reduce on one node.
A blocking call on a plain numpy array with no debug mode, timeout or timeline and the native
algorithm needs only the flight record, the sequence number, the agreement check and the call, and
``attempt`` does only that. Each collective is one ``Spec`` row of the table; a call that does not
qualify gets ``NOT_TAKEN`` with nothing sent, and the general path handles it, errors included.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from .._dtypes import is_supported
from ..backends import mpi_work, shm as shm_backend
from ..backends.base import REDUCE_OP_NAMES, CompletedWork, ReduceOp, Work
from ..cuda import capture
from ..errors import InvalidArgumentError, PeerFailedError
from ..groups import resolve_group
from ..observe import tracing
from ..settings import settings
from . import agreement, engine_calls, flight, shm_path, stragglers, watchdog
from .agreement import _PENDING
from .engine_calls import BUSY

NOT_TAKEN = object()  # what ``attempt`` returns when the general path must handle the call


def _finish(work: Work) -> None:
    if type(work) is not CompletedWork:  # a blocking MPI call is complete on return
        work.wait()


class Spec(NamedTuple):
    """One collective's row of the fast path's table."""

    op: str  # its name in flight records and messages
    writes_input: bool  # the call writes into ``x`` (so ``x`` must be writable)
    reduces: bool  # takes a ReduceOp, which the node's kernels must reduce (``shm_path.FUSED``)
    rooted: bool  # takes a root, which must be a rank of the group
    # The result's shape from (x.shape, group size), or None when the call cannot be made this way;
    # no function: ``x`` itself is the result (and None is returned).
    result_shape: Optional[Callable[[tuple, int], Optional[tuple]]]
    # The engine carries calls of at least ``settings.shm_min_bytes``; with this flag, only while the whole
    # result (x.nbytes times the group size) fits ``settings.shm_allgather_max_bytes``.
    bounded_result: bool
    # (run, engine, x, out, op name, root): ``run(engine, method, *args)`` makes the engine's call (``_now``, or
    # ``engine_calls.run`` where the wait must poll)
    on_engine: Callable[[Callable, Any, Any, Any, Optional[str], Optional[int]], None]
    # (backend, x, out, op, root, nonblocking): nonblocking where another rank makes the call so
    on_backend: Callable[[Any, Any, Any, Optional[ReduceOp], Optional[int], bool], Work]


def _now(engine: Any, method: str, *args: Any) -> None:
    """The engine's call, waited for inside C."""
    getattr(engine, method)(*args)


def _part_shape(shape: tuple, size: int) -> Optional[tuple]:
    if not shape or shape[0] % size:
        return None  # 0-d, or not divisible: the general path says so
    return (shape[0] // size,) + shape[1:]


ALL_REDUCE = Spec(
    "all_reduce", True, True, False, None, False,
    lambda run, engine, x, out, name, root: run(engine, "all_reduce", x, name),
    lambda backend, x, out, op, root, nb: backend.all_reduce(x, op, nb))
REDUCE_SCATTER = Spec(
    "reduce_scatter", False, True, False, _part_shape, False,
    lambda run, engine, x, out, name, root: run(engine, "reduce_scatter", x, out, name),
    lambda backend, x, out, op, root, nb: backend.reduce_scatter(x, out, op, nb))
BROADCAST = Spec(
    "broadcast", True, False, True, None, False,
    lambda run, engine, x, out, name, root: run(engine, "broadcast", x, root),
    lambda backend, x, out, op, root, nb: backend.broadcast(x, root, nb))
ALL_GATHER = Spec(
    "all_gather", False, False, False, lambda shape, size: (size,) + shape, True,
    lambda run, engine, x, out, name, root: run(engine, "all_gather", x, out),
    lambda backend, x, out, op, root, nb: backend.all_gather(x, out, nb))


def _named_op(name: str) -> Any:
    """The ReduceOp ``name`` names (``ReduceOp.parse`` keeps it for the next call), or None if it names none."""
    try:
        return ReduceOp.parse(name)
    except InvalidArgumentError:
        return None


def attempt(spec: Spec, x: Any, group: Any, op: Any = None, root: Any = None, out: Any = None) -> Any:
    """Run one blocking collective on the fast path, or return ``NOT_TAKEN`` having sent nothing.

    It qualifies when ``x`` is a plain, contiguous, non-empty numpy array of a supported dtype (writable
    if written, not in a shared window), ``op`` one the node's kernels reduce, ``root`` and ``out``
    valid, no timeline records, and ``shm_path.plain_route`` offers a route. A reduction the engine
    does not take must also be one MPI has (not AVG).

    Returns:
        The result buffer (``out``, or a new array), None for an in-place call, or ``NOT_TAKEN``.
    """
    if type(x) is not np.ndarray or not x.nbytes or BUSY:
        return NOT_TAKEN  # BUSY: calls in flight in an engine, which the general path advances while it waits
    name = None
    if spec.reduces:
        names = shm_path.FUSED.get(x.dtype)  # supported dtypes only
        if type(op) is str:  # "sum", "AVG": the name of a ReduceOp (a bad one is refused on the general path)
            op = REDUCE_OP_NAMES.get(op) or _named_op(op)
        if names is None or type(op) is not ReduceOp:
            return NOT_TAKEN
        name = names.get(op._value_)
        if name is None:
            return NOT_TAKEN
    elif not is_supported(x.dtype):
        return NOT_TAKEN
    flags = x.flags
    if not flags.c_contiguous or (spec.writes_input and not flags.writeable):
        return NOT_TAKEN
    if tracing.EVER_INSTALLED and tracing.active() is not None:
        return NOT_TAKEN
    if capture.EVER_RECORDED and capture.capturing():
        return NOT_TAKEN  # the general path refuses it (collectives.graphed)
    pg = resolve_group(group)
    if pg.member_backend is None:
        return NOT_TAKEN
    if shm_backend.ANY_ARRAYS and shm_backend.engine_in_window(pg.member_backend, x) is not None:
        return NOT_TAKEN  # the general path works on it where it lies
    if spec.rooted and (type(root) is not int or not 0 <= root < pg.size):
        return NOT_TAKEN
    engine, backend = shm_path.plain_route(pg)
    use_engine = engine is not None and x.nbytes >= settings.shm_min_bytes and (
        not spec.bounded_result or x.nbytes * pg.size <= settings.shm_allgather_max_bytes)
    if not use_engine and (backend is None or op is ReduceOp.AVG):
        return NOT_TAKEN
    if spec.result_shape is not None:
        shape = spec.result_shape(x.shape, pg.size)
        if shape is None:
            return NOT_TAKEN
        if out is None:
            out = np.empty(shape, dtype=x.dtype)
        elif (type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype
              or not out.flags.c_contiguous or not out.flags.writeable or np.may_share_memory(x, out)):
            return NOT_TAKEN  # the general path says what is wrong, or copies an input that overlaps out
    else:
        out = None
    state = pg.collective_state  # made by plain_route
    if _PENDING and engine is None and agreement.still_waiting_elsewhere(pg):
        return NOT_TAKEN  # over MPI it must be made nonblocking ([Note: calls waiting for their check, across groups])
    if state.unissued or state.in_engine:
        agreement.flush(pg)  # earlier asynchronous calls start first, in the same order on every rank
    # Calls of other groups waiting to be issued, or MPI requests in flight (those just issued too): the engine's
    # wait must issue or advance them, so it polls (engine_calls.run).
    run = engine_calls.run if use_engine and (
        (_PENDING and agreement.elsewhere(pg)) or (mpi_work.IN_FLIGHT and mpi_work.in_flight_here())) else _now
    entry = flight.record(pg, spec.op, x, name, root, None)
    seq = pg.seq
    pg.seq += 1
    blocked, key = watchdog._blocked, watchdog.get_ident()  # the watchdog's note, inline (see there)
    blocked[key] = (pg, entry, None)
    try:
        if use_engine:
            spec.on_engine(run, engine, x, out, name, root)  # compares the call across the node as it goes
        elif engine is None and spec is ALL_REDUCE:
            # Over MPI a small all-reduce the group expects goes with its check in one call (carried).
            way = agreement.check_all_reduce(pg, seq, x, name, op)
            if way != agreement.CARRIED:
                _finish(spec.on_backend(backend, x, out, op, root, way == agreement.NONBLOCKING))
        else:
            way = agreement.check(pg, seq, spec.op, x, name, root, engine=engine if engine is not None else False)
            _finish(spec.on_backend(backend, x, out, op, root, way == agreement.NONBLOCKING))
    except agreement.EngineMismatch as exc:
        agreement.explain_mismatch(lambda: agreement.refuse(pg, seq, spec.op, x, name, root), exc)
    except PeerFailedError as exc:
        watchdog.delivered(exc)  # an abandoned engine's error names this call
        raise
    finally:
        del blocked[key]
    if entry is not None:
        entry[flight.DONE] = True
    every = settings.straggler_every
    if every and not pg.seq % every:
        stragglers.compare(pg, pg.seq)
    return out
