"""Staging device arrays through reusable host buffers, for an MPI that is not CUDA-aware.

[Note: staging]
``run_staged`` runs a host operation on leased host twins of the device buffers and copies results back
once it completes (in ``wait``/``is_completed``), so ``async_op`` keeps working and no buffer is leased
twice while in use. ``run_pipelined`` chunks an in-place reduction over two copy streams: the copy in of
chunk k+1 and out of k-1 overlap the reduction of k, so the whole takes about the slowest stage, not the
sum. ``HostBuffers`` allocates powers of two and drops smaller free ones, so the pool tracks the largest
messages instead of growing.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from .base import Work

_MIN_BYTES = 4096


def _rounded(nbytes: int) -> int:
    size = _MIN_BYTES
    while size < nbytes:
        size *= 2
    return size


class HostBuffers:
    """A pool of reusable host byte buffers (pinned on a GPU machine).

    ``allocate(nbytes)`` returns a new 1-d uint8 array of that size.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray]):
        self._allocate = allocate
        self._free: List[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far (a test and benchmark counter)

    def lease(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` bytes, the caller's until ``release``."""
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free = [b for b in self._free if b is not best]
                return best
            size = _rounded(nbytes)
            self._free = [b for b in self._free if b.nbytes >= size]
            self.allocations += 1
        return self._allocate(size)

    def release(self, buf: np.ndarray) -> None:
        """Give a leased buffer back."""
        with self._lock:
            self._free.append(buf)

    @property
    def free_bytes(self) -> int:
        """Bytes held by buffers not leased now."""
        with self._lock:
            return sum(b.nbytes for b in self._free)


def host_view(raw: np.ndarray, shape, dtype) -> np.ndarray:
    """The first bytes of a leased buffer seen as an array of ``shape`` and ``dtype``."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    return raw[:count * dtype.itemsize].view(dtype).reshape(shape)


@dataclass
class DeviceCopies:
    """How bytes cross between a device array and a host twin.

    Attributes:
        to_host: ``to_host(device, host)``; the host array holds the values when it returns.
        to_device: ``to_device(host, device)``; may return before the copy is done.
        synchronize: waits until every ``to_device`` copy issued so far is done.
    """

    to_host: Callable[[Any, np.ndarray], None]
    to_device: Callable[[np.ndarray, Any], None]
    synchronize: Callable[[], None]


class CopySession(Protocol):
    """The asynchronous copies of one ``run_pipelined`` call (see the module note)."""

    def to_host(self, device: Any, host: np.ndarray) -> Callable[[], None]:
        """Queue ``device -> host``; returns a call that waits until the host array holds the values."""

    def to_device(self, host: np.ndarray, device: Any) -> None:
        """Queue ``host -> device`` (``host`` must not change until ``end``)."""

    def end(self) -> None:
        """Wait until every copy queued in this session is done."""


class Staging:
    """A buffer pool and its copies; ``pipeline`` starts a ``run_pipelined`` copy session (None: no chunking)."""

    def __init__(self, buffers: HostBuffers, copies: DeviceCopies,
                 pipeline: Optional[Callable[[], CopySession]] = None):
        self.buffers = buffers
        self.copies = copies
        self.pipeline = pipeline


def run_staged(call: Callable[..., Work], args: Sequence[Any], reads: Collection[int], writes: Collection[int],
               staging: Staging) -> Work:
    """Run ``call(*host_args)`` on host twins of the device arrays in ``args``; its Work, with device results.

    ``reads`` are copied in, ``writes`` copied back on completion.
    """
    host_args = list(args)
    leased: List[np.ndarray] = []
    try:
        for i in sorted(set(reads) | set(writes)):
            dev = args[i]
            if dev is None:
                continue
            raw = staging.buffers.lease(dev.nbytes)
            leased.append(raw)
            twin = host_view(raw, dev.shape, dev.dtype)
            if i in reads:
                staging.copies.to_host(dev, twin)
            host_args[i] = twin
        work = call(*host_args)
    except BaseException:
        for raw in leased:
            staging.buffers.release(raw)
        raise

    def copy_back() -> None:
        try:
            for i in writes:
                if args[i] is not None:
                    staging.copies.to_device(host_args[i], args[i])
            staging.copies.synchronize()  # the host buffers are reused at once
        finally:
            for raw in leased:
                staging.buffers.release(raw)

    for i in writes:
        if args[i] is not None and work._result is host_args[i]:
            work._result = args[i]
    return work.then(copy_back)


def run_pipelined(device: Any, reduce: Callable[[np.ndarray], None], staging: Staging, chunk_elements: int) -> None:
    """Reduce the device array in place through host chunks; ``reduce(chunk)`` is blocking and the same on every rank."""
    flat = device.reshape(-1)
    n = int(flat.size)
    step = max(1, int(chunk_elements))
    blocks = [(a, min(a + step, n)) for a in range(0, n, step)]
    raw = staging.buffers.lease(device.nbytes)
    session: Optional[CopySession] = None
    try:
        host = host_view(raw, (n,), device.dtype)
        session = staging.pipeline() if staging.pipeline is not None else _InTurn(staging.copies)
        arrived = [session.to_host(flat[a:b], host[a:b]) for a, b in blocks]
        for (a, b), wait in zip(blocks, arrived):
            wait()
            reduce(host[a:b])
            session.to_device(host[a:b], flat[a:b])
    finally:
        try:
            if session is not None:
                session.end()  # no copy may still use the buffer once another call leases it
        finally:
            staging.buffers.release(raw)


class _InTurn:
    """A session of blocking copies, for a staging area without copy streams: chunked, but nothing overlaps."""

    def __init__(self, copies: DeviceCopies):
        self._copies = copies

    def to_host(self, device: Any, host: np.ndarray) -> Callable[[], None]:
        self._copies.to_host(device, host)
        return lambda: None

    def to_device(self, host: np.ndarray, device: Any) -> None:
        self._copies.to_device(host, device)

    def end(self) -> None:
        self._copies.synchronize()


class _CupySession:
    """Copies on two streams of their own: to the host on one, back to the device on the other."""

    def __init__(self, cuda: Any, to_host: Any, to_device: Any):
        self._cuda, self._d2h, self._h2d = cuda, to_host, to_device
        ready = cuda.Event(disable_timing=True)
        ready.record(cuda.get_current_stream())
        to_host.wait_event(ready)  # after the kernels that wrote the array
        to_device.wait_event(ready)

    def to_host(self, device: Any, host: np.ndarray) -> Callable[[], None]:
        device.get(stream=self._d2h, out=host, blocking=False)
        done = self._cuda.Event(disable_timing=True)
        done.record(self._d2h)
        return done.synchronize

    def to_device(self, host: np.ndarray, device: Any) -> None:
        device.set(host, stream=self._h2d)  # asynchronous: ``host`` is pinned

    def end(self) -> None:
        self._d2h.synchronize()
        self._h2d.synchronize()


def cupy_pipeline(cupy: Any) -> Callable[[], CopySession]:
    """``Staging.pipeline`` on a GPU: two non-blocking copy streams per device (UNTESTED ON A GPU; run on ``fake_cuda``)."""
    cuda = cupy.cuda
    streams: Dict[int, Tuple[Any, Any]] = {}
    lock = threading.Lock()

    def start() -> CopySession:
        device = cuda.runtime.getDevice()
        with lock:
            pair = streams.get(device)
            if pair is None:
                pair = streams[device] = (cuda.Stream(non_blocking=True), cuda.Stream(non_blocking=True))
        return _CupySession(cuda, *pair)

    return start


_default: Optional[Staging] = None
_default_lock = threading.Lock()


def cupy_staging() -> Staging:
    """The process's staging area on a GPU: pinned host buffers and cupy's copies (UNTESTED ON A GPU)."""
    global _default
    with _default_lock:
        if _default is None:
            import cupy
            import cupyx

            def allocate(nbytes: int) -> np.ndarray:
                return cupyx.empty_pinned((nbytes,), dtype=np.uint8)

            _default = Staging(HostBuffers(allocate), DeviceCopies(
                to_host=lambda dev, host: dev.get(out=host),  # blocking, after the stream's earlier work
                to_device=lambda host, dev: dev.set(host),
                synchronize=lambda: cupy.cuda.get_current_stream().synchronize(),
            ), cupy_pipeline(cupy))
        return _default


__all__ = ["HostBuffers", "DeviceCopies", "CopySession", "Staging", "host_view", "run_staged", "run_pipelined",
           "cupy_pipeline", "cupy_staging"]
