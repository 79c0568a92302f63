"""The shared-memory window behind intra-node collectives (the engine is ``axonhpc._ext._shm``).

[Note: one window per communicator]
``engine_for`` is collective on first use for a one-node backend: one ``MPI.Win.Allocate_shared``
segment per rank (page-aligned on its owner's memory), each rank zeroing its own counters, then a
barrier so no rank reads a counter before its owner zeroed it. The engine is kept on the backend and
reused (nothing is allocated per call); open windows are freed at exit, before ``MPI_Finalize``. A
multi-node communicator gets ``None``, once. The geometry comes from the settings, which every rank
reads from the same environment, so it is the same everywhere.
"""
from __future__ import annotations

import atexit
import os
from typing import Any, List, Optional

import numpy as np

from ..errors import ConfigurationError, InvalidArgumentError, SharedMemoryError
from ..settings import settings

_ATTR = "_axonhpc_shm"  # where a backend keeps its engine (or False: not one node)
_ARRAYS = "_axonhpc_shm_arrays"  # where it keeps the windows of arrays allocated in shared memory
ANY_ARRAYS = False  # has this process allocated any (lets small calls skip the lookup)


class SharedWindow:
    """One node's shared segments and the compiled engine that runs collectives through them."""

    def __init__(self, comm: Any, slot_bytes: int, nslots: int):
        from mpi4py import MPI

        from .._ext import _shm

        self.slot_bytes, self.nslots = int(slot_bytes), int(nslots)
        if self.slot_bytes < 4096 or self.slot_bytes % 4096 or not 1 <= self.nslots <= _shm.MAX_SLOTS:
            raise ConfigurationError(f"shared-memory slots must be a positive multiple of 4096 bytes, 1 to "
                                     f"{_shm.MAX_SLOTS} of them; got shm_slot_bytes={slot_bytes}, shm_slots={nslots}")
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self.win = MPI.Win.Allocate_shared(_shm.CTRL_BYTES + self.nslots * self.slot_bytes, 1, info, comm)
        finally:
            info.Free()
        self._views = []
        addresses = []
        for r in range(comm.Get_size()):
            buf, _ = self.win.Shared_query(r)
            view = np.frombuffer(buf, dtype=np.uint8)
            self._views.append(view)
            addresses.append(view.ctypes.data)
        self._views[comm.Get_rank()][:_shm.CTRL_BYTES] = 0
        comm.Barrier()
        self.engine = _shm.Engine(addresses, comm.Get_rank(), self.slot_bytes, self.nslots)
        self.data = self._views[comm.Get_rank()][_shm.CTRL_BYTES:]  # this rank's slots, or its array
        if not _OPEN:
            atexit.register(_free_open_windows)  # after mpi4py's import: runs before MPI_Finalize
        _OPEN.append(self)

    def close(self) -> None:
        """Free the window (collective over the communicator)."""
        self._views = []
        _OPEN.remove(self)
        self.win.Free()


# Windows not yet freed, in the order this rank made them (the same order, per communicator, on
# every rank: each was made collectively). They are freed at exit, before MPI_Finalize: some
# network modules (MPICH's OFI netmod) fail MPI_Finalize while a window is still open.
_OPEN: List[SharedWindow] = []


def abandon_open_windows() -> None:
    """Local: forget every window made so far without freeing it (their communicator lost a rank, see
    ``axonhpc.elastic``; a free would wait for it). Their memory stays mapped until the process ends."""
    _ABANDONED.extend(_OPEN)
    _OPEN.clear()


_ABANDONED: List[SharedWindow] = []  # kept alive: the engines' memory must outlive any view of it


def _free_open_windows() -> None:
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    for window in list(_OPEN):
        window.close()


def _one_node(comm: Any) -> bool:
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_size() == comm.Get_size()
    finally:
        local.Free()


def engine_for(backend: Any, slot_bytes: int, nslots: int, one_node: Optional[bool] = None) -> Optional[Any]:
    """The shared-memory engine of ``backend``'s communicator, or None (collective on first use).

    None for a backend without an MPI communicator (threads, NCCL) or spanning nodes. ``one_node``: the
    caller knows (``ProcessGroup.on_one_node``); None asks the communicator (collective across nodes too).
    """
    backend = backend.host_side()  # a host/device dispatch backend: its MPI side
    cached = getattr(backend, _ATTR, None)
    if cached is not None:
        return cached.engine if cached else None
    comm = getattr(backend, "comm", None)
    if comm is None or not hasattr(comm, "Split_type"):
        return None
    if one_node is None:
        one_node = _one_node(comm)
    window: Any = SharedWindow(comm, slot_bytes, nslots) if one_node else False
    setattr(backend, _ATTR, window)
    return window.engine if window else None


def cached_engine(backend: Any) -> Optional[Any]:
    """``backend``'s engine if ``engine_for`` already made it, else None: never collective (for another thread)."""
    cached = getattr(backend.host_side(), _ATTR, None)
    return cached.engine if cached else None


SHM_DIR = "/dev/shm"  # where MPI's shared windows live on Linux (a tmpfs, often small in containers)


def free_shm_bytes(path: str = SHM_DIR) -> Optional[int]:
    """Bytes an unprivileged process may still write under ``path``, or None where it cannot be told."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail) * int(st.f_frsize)


def check_room(comm: Any, segment: int, nbytes: int) -> None:
    """Refuse, on every rank alike, a window the node's shared memory cannot hold (collective over ``comm``).

    A full tmpfs does not fail the allocation: the first write past its end kills the process with
    SIGBUS and the others wait forever. So the ranks all-gather their segment sizes and the free bytes
    under ``/dev/shm`` and all decide from the same numbers before anything is allocated.

    Raises:
        SharedMemoryError: the segments of all ranks do not fit in the least
            free space any rank saw.
    """
    from mpi4py import MPI

    from .._ext import _shm

    free = free_shm_bytes()
    mine = np.array([_shm.CTRL_BYTES + segment, -1 if free is None else free], dtype=np.int64)
    table = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    need = int(table[:, 0].sum())
    seen = table[:, 1]
    if (seen < 0).all() or need <= int(seen[seen >= 0].min()):
        return
    least = int(seen[seen >= 0].min())
    who = int(np.flatnonzero(seen == least)[0])
    raise SharedMemoryError(
        f"shared_memory_array of {nbytes} bytes: the {len(table)} ranks of this node need {need} bytes "
        f"({need / 2**20:.1f} MiB: a segment of {segment} bytes plus {_shm.CTRL_BYTES} of counters each) in "
        f"{SHM_DIR}, but only {least} bytes ({least / 2**20:.1f} MiB) are free there (as seen by group rank {who}); "
        f"nothing was allocated or written. Enlarge {SHM_DIR} (docker run --shm-size=..., or the tmpfs size), use a "
        f"smaller array, or set AXONHPC_SHM_COLLECTIVES=off for plain memory")


def allocate_array(backend: Any, nbytes: int, one_node: Optional[bool] = None) -> Optional[np.ndarray]:
    """``nbytes`` of this rank's memory in a shared window of its own, or None (collective).

    Every rank gets its array at the same offset of its own segment, and ``engine_in_window`` finds the
    engine that reduces such arrays in place. The window lives as long as the process.

    Raises:
        SharedMemoryError: the node's ``/dev/shm`` cannot hold the arrays of
            all its ranks (``check_room``); raised on every rank alike.
    """
    backend = backend.host_side()
    if engine_for(backend, settings.shm_slot_bytes, settings.shm_slots, one_node) is None:  # not one node
        return None
    segment = max(4096, -(-int(nbytes) // 4096) * 4096)
    check_room(backend.comm, segment, int(nbytes))
    window = SharedWindow(backend.comm, segment, 1)
    array = window.data[:int(nbytes)]
    start = array.ctypes.data
    global ANY_ARRAYS
    ANY_ARRAYS = True
    arrays = getattr(backend, _ARRAYS, None)
    if arrays is None:
        arrays = []
        setattr(backend, _ARRAYS, arrays)
    arrays.append((start, start + window.slot_bytes, window))
    return array


def free_array(backend: Any, array: np.ndarray) -> None:
    """Free the window of an ``allocate_array`` array (collective); the array must not be used after."""
    backend = backend.host_side()
    arrays = getattr(backend, _ARRAYS, None) or []
    start = array.ctypes.data
    for entry in arrays:
        if entry[0] <= start < entry[1]:
            arrays.remove(entry)
            entry[2].close()
            return
    raise InvalidArgumentError("free_array: the array was not allocated by allocate_array on this backend")


def engine_in_window(backend: Any, x: np.ndarray) -> Optional[Any]:
    """The engine of the shared window ``x`` lies in (see ``allocate_array``), or None."""
    backend = backend.host_side()
    arrays = getattr(backend, _ARRAYS, None)
    if not arrays or not isinstance(x, np.ndarray):
        return None
    start = x.ctypes.data
    end = start + x.nbytes
    for lo, hi, window in arrays:
        if lo <= start and end <= hi:
            return window.engine
    return None


def release(backend: Any) -> None:
    """Free ``backend``'s window if it has one (collective)."""
    backend = backend.host_side()
    window = getattr(backend, _ATTR, None)
    if window:
        window.close()
    if window is not None:
        setattr(backend, _ATTR, None)


__all__ = ["SharedWindow", "engine_for", "cached_engine", "allocate_array", "free_array", "engine_in_window", "release"]
