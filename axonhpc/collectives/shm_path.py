"""Which collectives go through the node's shared memory instead of MPI, and how.

[Note: choosing the shared-memory path]
All-reduce, reduce-scatter and broadcast of host arrays of at least
``settings.shm_min_bytes`` take the shared-memory engine
(``axonhpc._ext._shm``, set up by ``axonhpc.backends.shm``) when every rank
of the group is on one node and ``settings.shm_collectives`` is "auto".
Everything the choice depends on is the same on every rank of a correct
program (the group, the message size and dtype, the operation, the settings),
so all ranks choose alike; the first eligible call of a group is the
collective that sets the window up. Across nodes, the hierarchical
all-reduce uses it for its steps inside each node. All-gather stays with
MPI: through the slots it would copy every byte in and out (3 copies of the
result per rank), where MPI's shared memory delivers each rank's data once
(measured: 56 ms against 30 ms for 64 MiB on 2 ranks).

The engine completes the operation before returning, so a call with
``async_op=True`` returns a finished ``Work``: DDP's overlapped buckets
become synchronous on this path, which on a node costs little (the copies
and the reduction are work of the calling rank either way; there is no
network card to overlap with).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._dtypes import is_cupy_array, is_low_precision_float
from ..backends.base import CompletedWork, ReduceOp, Work
from ..backends import shm as shm_backend
from ..backends.shm import allocate_array, engine_for, engine_in_window, free_array
from ..errors import CollectiveTimeoutError
from ..settings import settings

_KERNEL_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.uint8))


class _Path:
    """One call's way through the engine: runs it, and names missing ranks by their global numbers."""

    def __init__(self, engine: Any, pg: Any, op_name: str):
        self.engine, self.pg, self.op_name = engine, pg, op_name

    def fuses(self, op: ReduceOp, x: Any) -> bool:
        """True if the kernels finish ``op`` themselves: every op but AVG, and AVG of float32/float64."""
        if op is ReduceOp.AVG:
            return np.dtype(x.dtype) in (np.dtype(np.float32), np.dtype(np.float64))
        return np.dtype(x.dtype) in _KERNEL_DTYPES

    def _call(self, method: str, *args: Any) -> None:
        try:
            getattr(self.engine, method)(*args)
        except CollectiveTimeoutError as exc:
            missing = [self.pg.ranks[k] for k in getattr(exc, "missing", [])]
            raise CollectiveTimeoutError(
                f"{self.op_name} on group {self.pg.name} {list(self.pg.ranks)} timed out after "
                f"{self.engine.timeout:g} s in the shared-memory path; missing ranks: {missing}") from exc

    def all_reduce(self, src: Any, dst: Any, op: ReduceOp) -> Work:
        """Reduce ``src`` into ``dst`` (the same array, or a copy target) over the node."""
        if dst is not src:
            dst[...] = src
        self._call("all_reduce", dst.reshape(-1), op.name)
        return _done()

    def reduce_scatter(self, src: Any, dst: Any, op: ReduceOp) -> Work:
        """This rank's block of the reduction of ``src`` into ``dst``."""
        self._call("reduce_scatter", np.ascontiguousarray(src).reshape(-1), dst.reshape(-1), op.name)
        return _done(dst)

    def broadcast(self, x: Any, src: int) -> Work:
        """Group rank ``src``'s ``x`` into ``x``."""
        self._call("broadcast", x.reshape(-1).view(np.uint8), src)
        return _done()


class _InWindowPath(_Path):
    """All-reduce of an array that ``shared_memory_array`` placed in the window: no copy in."""

    def all_reduce(self, src: Any, dst: Any, op: ReduceOp) -> Work:
        self._call("all_reduce_in_window", dst.reshape(-1), op.name)
        return _done()


def fixed_order(x: Any, op: ReduceOp) -> bool:
    """True if ``settings.deterministic`` asks for a fixed order and the order could change the bits."""
    return (settings.deterministic and np.dtype(x.dtype).kind == "f"
            and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT))


def path(pg: Any, x: Any, op_name: str, reduction: bool, any_size: bool = False) -> Optional[_Path]:
    """The shared-memory path for this call, or None for MPI (collective on a group's first use).

    ``any_size`` takes it whatever the message size (deterministic mode).
    """
    if settings.shm_collectives == "off" or pg.size == 1:
        return None
    small = x.nbytes < settings.shm_min_bytes and not any_size
    if small and not shm_backend.ANY_ARRAYS:
        return None  # the common case of a small message, decided in a few attribute reads
    if is_cupy_array(x):
        return None
    if op_name == "all_reduce" and np.dtype(x.dtype) in _KERNEL_DTYPES:
        in_window = engine_in_window(pg.backend, x)
        if in_window is not None:  # every rank's array is in the window (allocated collectively)
            _set_timeout(in_window, pg)
            return _InWindowPath(in_window, pg, op_name)
    if small:
        return None
    if reduction and np.dtype(x.dtype) not in _KERNEL_DTYPES and not is_low_precision_float(x.dtype):
        return None  # 16-bit floats are reduced widened to float32, which the kernels take
    engine = engine_for(pg.backend, settings.shm_slot_bytes, settings.shm_slots)
    if engine is None:
        return None
    _set_timeout(engine, pg)
    return _Path(engine, pg, op_name)


def _set_timeout(engine: Any, pg: Any) -> None:
    timeout = pg.effective_timeout()
    engine.timeout = 0.0 if timeout is None else float(timeout)


def shared_memory_array(shape: Any, dtype: Any, group: Any = None) -> Any:
    """A zeroed array in the node's shared window, or a plain one (collective over the group).

    ``all_reduce`` of such an array (the whole array, passed by every rank)
    reads the other ranks' arrays where they lie instead of copying them into
    the slots first: DDP keeps its large gradient buckets here. A plain numpy
    array comes back when shared memory cannot be used (one rank, ranks on
    several nodes, ``shm_collectives="off"``, no MPI). The memory lives as
    long as the process.
    """
    from ..groups import resolve_group

    pg = resolve_group(group)
    if not isinstance(shape, tuple):
        shape = (int(shape),)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if settings.shm_collectives != "off" and pg.size > 1:
        raw = allocate_array(pg.backend, count * dtype.itemsize)
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
