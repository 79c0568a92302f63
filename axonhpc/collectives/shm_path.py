"""Which collectives go through the node's shared memory instead of MPI, and how.

[Note: choosing the shared-memory path]
All-reduce, reduce-scatter, broadcast and all-gather of host arrays take the shared-memory engine
when the group is one node's and ``settings.shm_collectives`` is "auto", whatever their size:
measured on 2-4 ranks here, the engine beat the MPICH wheel's own shared memory from 64 bytes to
256 MiB (docs/performance.md). All-gather takes it only up to ``settings.shm_allgather_max_bytes``
(256 KiB): above that MPI's single-copy transfer beats copying every byte through the slots. The
choice depends only on what is equal on every rank of a correct program, so all ranks choose
alike. The window is set up when the group is made, so a timeout is never stuck behind it.

``plain_route`` keeps per settings revision the route of a plain blocking call, and
``fast_path.attempt`` makes it with nothing else looked up: about 2-3 us over the engine's time.

A call with ``async_op=True`` is queued in the engine and returned in flight (``engine_calls``).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .._dtypes import is_cupy_array, is_low_precision_float
from ..backends.base import CompletedWork, ReduceOp, Work
from ..backends import shm as shm_backend
from ..backends.shm import allocate_array, engine_for, engine_in_window, free_array
from ..errors import CollectiveStallError, CollectiveTimeoutError, PeerFailedError, replacing
from ..settings import settings
from . import engine_calls, watchdog
from .group_state import state_of
from .widen import work_dtype

_KERNEL_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.uint8))


class _Path:
    """One call's way through the engine: runs it, and names missing ranks by their global numbers."""

    def __init__(self, engine: Any, pg: Any, op_name: str):
        self.engine, self.pg, self.op_name = engine, pg, op_name

    def fuses(self, op: ReduceOp, x: Any) -> bool:
        """True if the kernels finish ``op`` themselves: every op but AVG, and AVG of float32/float64."""
        return op.value in FUSED.get(np.dtype(x.dtype), ())

    def _call(self, method: str, *args: Any, later: bool = False, result: Any = None) -> Work:
        """Run ``engine.method(*args)``: its Work, finished unless ``later`` (then an ``EngineWork`` in flight)."""
        # The watchdog, which sees the wait (``core.run_call`` notes every call), learns which engine to end it
        # in: an array's window has its own.
        ident = watchdog.get_ident()
        watchdog.engines[ident] = self.engine
        try:
            if later:
                op = engine_calls.queue(self.engine, method, *args)
                return engine_calls.EngineWork(op, self.engine, self._timed_out, result, state_of(self.pg).in_engine)
            engine_calls.run(self.engine, method, *args)
        except CollectiveStallError:
            raise  # the watchdog's verdict, which says all there is to say
        except CollectiveTimeoutError as exc:
            raise replacing(self._timed_out(exc), exc, settings.debug)
        except PeerFailedError as exc:
            watchdog.delivered(exc)  # an abandoned engine's error names this call
            raise
        finally:
            del watchdog.engines[ident]
        return _done(result)

    def _timed_out(self, exc: Exception) -> CollectiveTimeoutError:
        return timed_out(exc, self.engine, self.pg, self.op_name)

    # ``desc``: the call's descriptor (``agreement.describe``), taken from the caller's own array: the
    # engine sees flattened, byte or widened views of it, and compares ``desc`` across the node.
    # ``later``: the call is asynchronous (``async_op=True``): it is queued and its Work returned in flight.
    def all_reduce(self, src: Any, dst: Any, op: ReduceOp, desc: tuple, later: bool = False) -> Work:
        """Reduce ``src`` into ``dst`` (the same array, or a copy target) over the node."""
        if dst is not src:
            dst[...] = src
        return self._call("all_reduce", dst.reshape(-1), op.name, desc, later=later)

    def reduce_scatter(self, src: Any, dst: Any, op: ReduceOp, desc: tuple, later: bool = False) -> Work:
        """This rank's block of the reduction of ``src`` into ``dst``."""
        return self._call("reduce_scatter", np.ascontiguousarray(src).reshape(-1), dst.reshape(-1), op.name, desc,
                          later=later, result=dst)

    def all_gather(self, x: Any, out: Any, desc: tuple, later: bool = False) -> Work:
        """Every rank's ``x`` into ``out`` (group size blocks, in rank order)."""
        return self._call("all_gather", x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8), desc,
                          later=later, result=out)

    def broadcast(self, x: Any, src: int, desc: tuple, later: bool = False) -> Work:
        """Group rank ``src``'s ``x`` into ``x``."""
        return self._call("broadcast", x.reshape(-1).view(np.uint8), src, desc, later=later)


class _InWindowPath(_Path):
    """All-reduce or all-gather of an array that ``shared_memory_array`` placed in the window: no copy in."""

    def all_reduce(self, src: Any, dst: Any, op: ReduceOp, desc: tuple, later: bool = False) -> Work:
        return self._call("all_reduce_in_window", dst.reshape(-1), op.name, desc, later=later)

    def all_gather(self, x: Any, out: Any, desc: tuple, later: bool = False) -> Work:
        return self._call("all_gather_in_window", x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8),
                          desc, later=later, result=out)


def timed_out(exc: Exception, engine: Any, pg: Any, op_name: str) -> CollectiveTimeoutError:
    """The engine's timeout, told in the group's terms: its name, and the missing ranks' global numbers."""
    missing = [pg.ranks[k] for k in getattr(exc, "missing", [])]
    error = CollectiveTimeoutError(
        f"{op_name} on group {pg.name} {list(pg.ranks)} timed out after {engine.timeout:g} s in the "
        f"shared-memory path; missing ranks: {missing}")
    error.missing = getattr(exc, "missing", [])  # group ranks, as the engine's
    return error


# dtype -> {op value -> the kernels' name} for the ops they finish alone (AVG only for floats).
# Keyed by the op's value: an Enum's hash is a Python-level call, too slow for the hot path.
FUSED = {dtype: {op.value: op.name for op in ReduceOp if op is not ReduceOp.AVG or dtype.kind == "f"}
         for dtype in _KERNEL_DTYPES}


def plain_route(pg: Any) -> Tuple[Optional[Any], Optional[Any]]:
    """How a plain blocking call on ``pg`` runs: ``(engine, backend)`` (collective if the window is not made yet).

    ``engine``: the group's shared-memory engine, if any; ``backend``: for what the engine does not
    take, when a reduction's order may vary (not deterministic mode); both None: the general path.
    Neither is offered in debug mode, under a timeout (the general path names where missing ranks are)
    or with a non-native algorithm. Kept on the group per change of the settings or its
    ``timeout``/``debug``. The caller has checked membership.
    """
    key = (settings.revision, pg.timeout, pg.debug)
    state = pg.collective_state or state_of(pg)  # state_of only on first use: no call on the hot path
    cached = state.route
    if cached is not None and cached[0] == key:
        return cached[1]
    engine = backend = None
    if (pg.size > 1 and not pg.debug_enabled() and settings.allreduce_algorithm == "native"
            and pg.effective_timeout() is None):
        if settings.shm_collectives != "off":
            engine = engine_for(pg.backend, settings.shm_slot_bytes, settings.shm_slots, pg.on_one_node)
        if engine is not None:
            set_timeout(engine, pg)
        if not settings.deterministic:
            backend = pg.backend
    state.route = (key, (engine, backend))
    return engine, backend


def fixed_order(x: Any, op: ReduceOp) -> bool:
    """True if ``settings.deterministic`` asks for a fixed order and the order could change the bits."""
    return (settings.deterministic and np.dtype(x.dtype).kind == "f"
            and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT))


def path(pg: Any, x: Any, op_name: str, reduction: bool, any_size: bool = False,
         op: Optional[ReduceOp] = None) -> Optional[_Path]:
    """The shared-memory path for this call, or None for MPI (collective on a group's first use).

    ``any_size`` takes it whatever the message size (deterministic mode). ``op``: the reduction, if known; one
    that runs on a widened copy (an integer AVG, ``widen``) cannot reduce an array in the window where it lies.
    """
    if settings.shm_collectives == "off" or pg.size == 1:
        return None
    small = x.nbytes < settings.shm_min_bytes and not any_size
    if small and not shm_backend.ANY_ARRAYS:
        return None  # the common case of a small message, decided in a few attribute reads
    if is_cupy_array(x):
        return None
    if op_name == "all_gather" or (op_name == "all_reduce" and np.dtype(x.dtype) in _KERNEL_DTYPES
                                   and (op is None or work_dtype(x.dtype, op) is None)):
        in_window = engine_in_window(pg.backend, x)
        if in_window is not None:  # every rank's array is in the window (allocated collectively)
            set_timeout(in_window, pg)
            return _InWindowPath(in_window, pg, op_name)
    if small or (op_name == "all_gather" and x.nbytes * pg.size > settings.shm_allgather_max_bytes):
        return None
    if reduction and np.dtype(x.dtype) not in _KERNEL_DTYPES and not is_low_precision_float(x.dtype):
        return None  # 16-bit floats are reduced widened to float32, which the kernels take
    engine = engine_for(pg.backend, settings.shm_slot_bytes, settings.shm_slots, pg.on_one_node)
    if engine is None:
        return None
    set_timeout(engine, pg)
    return _Path(engine, pg, op_name)


def set_timeout(engine: Any, pg: Any) -> None:
    """The engine's waits give up after the group's timeout (0: never); it compares calls unless the settings say not."""
    engine.check = settings.check_collectives
    timeout = pg.effective_timeout()
    engine.timeout = 0.0 if timeout is None else float(timeout)


def shared_memory_array(shape: Any, dtype: Any, group: Any = None) -> Any:
    """A zeroed array in the node's shared window, or a plain one (collective over the group).

    ``all_reduce`` of the whole array, passed by every rank, reads the other ranks' arrays in place
    instead of copying them into the slots (DDP keeps its large buckets here). A plain numpy array comes
    back when shared memory cannot be used. The memory lives as long as the process.
    """
    from ..groups import resolve_group

    pg = resolve_group(group)
    if not isinstance(shape, tuple):
        shape = (int(shape),)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if settings.shm_collectives != "off" and pg.size > 1:
        raw = allocate_array(pg.backend, count * dtype.itemsize, pg.on_one_node)
        if raw is not None:
            array = raw.view(dtype).reshape(shape)
            array[...] = 0
            return array
    return np.zeros(shape, dtype=dtype)


def _done(result: Any = None) -> Work:
    work = CompletedWork(result)
    work.wait()
    return work


def in_shared_memory(array: Any, group: Any = None) -> bool:
    """True if ``array`` lies in a shared window of the group (``shared_memory_array`` gave one)."""
    from ..groups import resolve_group

    return engine_in_window(resolve_group(group).backend, array) is not None


def free_shared_memory_array(array: Any, group: Any = None) -> None:
    """Give back a ``shared_memory_array`` (collective); a plain array is left to the garbage collector."""
    from ..groups import resolve_group

    pg = resolve_group(group)
    if engine_in_window(pg.backend, array) is not None:
        free_array(pg.backend, array)


__all__ = ["path", "shared_memory_array", "in_shared_memory", "free_shared_memory_array"]
