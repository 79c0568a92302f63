"""Thread-level stand-ins for cupy and ``cupy.cuda.nccl``: strict wrappers of host memory play device arrays.

They check what axonhpc's device code asks of cupy and NCCL (pointers, counts,
datatype and op codes, groups, call order) with real data movement between
ranks that are threads of one process. They do not check NCCL, CUDA streams or
cupy: nothing here runs on a GPU.

- ``DeviceArray``: the strict stand-in of ``strict_cupy`` (not a numpy
  subclass; it refuses what cupy refuses), installed as ``cupy.ndarray`` so
  the library takes it for a device array.
- ``FakeCupy``: the strict ``cupy`` module plus ``cuda.Stream``/``Event``/
  ``get_current_stream``/``runtime``, and stream capture into a ``Graph``
  (``begin_capture``/``end_capture``/``launch``: see ``strict_cupy``), with
  ``MemoryPool``/``using_allocator`` as objects only (the memory is numpy's).
- ``FakeNccl``: the module, with ``NcclCommunicator`` ranks that meet in a hub
  keyed by the unique id, and a log of every call.
- ``run_device_world(fn, n)``: ``fn(world)`` on n threads, each world on a
  ``DeviceDispatchBackend`` (in-process host backend + ``NCCLBackend`` over the fakes).
"""
import contextlib
import ctypes
import os
import sys
import threading
import types
import weakref
from collections import defaultdict, deque

import numpy as np

from axonhpc.backends.nccl import NCCL_DATATYPES, NCCL_OPS
from support import strict_cupy
from support.strict_cupy import DeviceArray, StrictCupy, device

# What the tests take from here, the stand-in's arrays among them (re-exported).
__all__ = ["DeviceArray", "FakeCupy", "FakeNccl", "StrictCupy", "bench_device", "current_allocator", "device", "install",
           "run_device_world"]

WAIT = 30.0  # seconds any fake wait may take before the test fails instead of hanging


class _Graph:
    """``cupy.cuda.Graph``: the operations a stream capture recorded, run in order by ``launch``."""

    def __init__(self, ops):
        self._ops = ops
        self.launches = 0

    def launch(self, stream=None):
        strict_cupy.refuse_in_capture("Graph.launch", "cudaErrorStreamCaptureUnsupported: a graph is launched "
                                                      "outside a capture here")
        for op in self._ops:
            op()
        self.launches += 1

    def upload(self, stream=None):
        pass


_capture_streams = threading.local()  # this thread's capture: the streams it has joined (CUDA's fork/join)


class _Stream:
    """A stream: its pointer, and CUDA's rules of capture (begin/end, joining other streams through events).

    A stream that waits for an event recorded in a capture joins the capture; its later work is
    captured, and before the capture ends another captured stream must wait for an event recorded
    on it after its last work (else ``cudaErrorStreamCaptureUnjoined``).
    """

    _current = threading.local()
    _by_ptr = weakref.WeakValueDictionary()

    def __init__(self, null=False, non_blocking=False):
        self.ptr = 0 if null else id(self)
        self.waited = 0
        self._capturing = False  # the capture's origin stream
        self._joined = False  # joined a capture through an event
        self.work = 0  # captured operations issued on it (the fake NCCL's)
        self._joined_at = 0  # ``work`` when another captured stream last waited for it
        if not null:
            _Stream._by_ptr[self.ptr] = self

    @staticmethod
    def at(ptr):
        """The stream with this pointer (None: the default stream, or one no longer alive)."""
        return _Stream._by_ptr.get(ptr)

    def wait_event(self, event):
        self.waited += 1
        if event.captured:
            if not self.is_capturing():
                self._joined = True
                self._joined_at = self.work
                _capture_streams.__dict__.setdefault("joined", []).append(self)
            source = event.source
            if source is not None and source is not self and source._joined and event.work == source.work:
                source._joined_at = source.work  # joined back: everything issued there comes before this

    def record(self, event=None):
        event = _Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self):
        strict_cupy.refuse_in_capture("stream.synchronize", "cudaErrorStreamCaptureUnsupported: operation not "
                                                            "permitted when stream is capturing")
        strict_cupy._synced("stream.synchronize")

    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        strict_cupy.begin_tape()
        self._capturing = True
        _capture_streams.joined = []

    def end_capture(self):
        if not self._capturing:
            raise RuntimeError("cudaErrorIllegalState: the stream is not capturing")
        self._capturing = False
        joined, _capture_streams.joined = _capture_streams.joined, []
        ops = strict_cupy.end_tape()
        for stream in joined:
            stream._joined = False
        unjoined = [s for s in joined if s.work != s._joined_at]
        if unjoined:
            raise RuntimeError(f"cudaErrorStreamCaptureUnjoined: {len(unjoined)} stream(s) joined the capture "
                               "and were not joined back into the origin stream before it ended")
        return _Graph(ops)

    def is_capturing(self):
        return self._capturing or self._joined

    def __enter__(self):
        stack = _Stream._current.__dict__.setdefault("stack", [])
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _Stream._current.stack.pop()


_NULL_STREAM = _Stream(null=True)


class _Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False
        self.captured = False  # last recorded on a capturing stream: a dependency inside the graph
        self.source, self.work = None, 0

    def record(self, stream=None):
        stream = _current_stream() if stream is None else stream
        self.recorded = True
        self.captured = stream.is_capturing()
        self.source, self.work = stream, stream.work

    @property
    def done(self):
        if self.captured:
            raise RuntimeError("cudaErrorCapturedEvent: the event was last recorded in a stream capture, "
                               "so it cannot be queried")
        return True

    def synchronize(self):
        if self.captured:
            raise RuntimeError("cudaErrorCapturedEvent: the event was last recorded in a stream capture")
        strict_cupy.refuse_in_capture("event.synchronize", "cudaErrorStreamCaptureUnsupported: operation not "
                                                           "permitted when stream is capturing")
        strict_cupy._synced("event.synchronize")


class _MemoryPool:
    """``cupy.cuda.MemoryPool``: host memory underneath, so only the object and ``malloc`` are played.

    It remembers the memory of the arrays made while its ``malloc`` is the allocator in force (a graph's
    capture): between launches, a kernel writing into that memory is refused, as it is unsafe on a GPU.
    A graph reuses a freed temporary's block for a later allocation within one launch, so what the host
    wrote there before the launch may be overwritten by an earlier node before it is read (the first
    captured optimizer step on an H100 read gradients as its learning rate that way).
    """

    def __init__(self):
        self.ranges = []  # (first byte, end) of each array allocated from this pool
        _pools.add(self)

    def malloc(self, size):
        raise NotImplementedError("the stand-in's arrays are numpy memory: its MemoryPool allocates nothing")

    def used_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


_allocators = threading.local()
_pools = weakref.WeakSet()


def _default_malloc(size):
    """cupy's default pool's ``malloc`` (what ``get_allocator`` returns where no other is in force)."""
    raise NotImplementedError("the stand-in's arrays are numpy memory: nothing is allocated through it")


def _bounds(a):
    lo = a.__array_interface__["data"][0]
    return lo, lo + max(a.nbytes, 1)


def _note_allocation(a):
    pool = getattr(current_allocator(), "__self__", None)
    if isinstance(pool, _MemoryPool):
        pool.ranges.append(_bounds(a))


def _check_write(a, kernel):
    lo, hi = _bounds(a)
    for pool in list(_pools):
        if any(lo < end and start < hi for start, end in pool.ranges):
            raise RuntimeError(f"{kernel}: writing, between a graph's launches, into memory allocated from the "
                               "graph's own pool during its capture; the graph's temporaries reuse such blocks "
                               "within a launch, so this may be overwritten before the graph reads it (allocate "
                               "what the host writes outside the graph's pool)")


strict_cupy.allocation_hook = _note_allocation
strict_cupy.write_hook = _check_write


@contextlib.contextmanager
def _using_allocator(allocator=None):
    """``cupy.cuda.using_allocator``: this thread's allocator inside the block (recorded, not used)."""
    stack = _allocators.__dict__.setdefault("stack", [])
    stack.append(allocator)
    try:
        yield
    finally:
        stack.pop()


def current_allocator():
    """The allocator ``using_allocator`` put in force on this thread (None: cupy's default pool)."""
    stack = _allocators.__dict__.get("stack")
    return stack[-1] if stack else None


def _get_allocator():
    """``cupy.cuda.get_allocator``: the allocator in force on this thread."""
    return current_allocator() or _default_malloc


def _current_stream():
    stack = _Stream._current.__dict__.get("stack")
    return stack[-1] if stack else _NULL_STREAM


class FakeCupy(StrictCupy):
    """``cupy`` for the tests: the strict stand-in's arrays and functions, plus ``cuda``."""

    def __init__(self, devices=1):
        super().__init__()
        self.bound = []
        runtime = types.SimpleNamespace(getDeviceCount=lambda: devices, getDevice=lambda: 0, driverGetVersion=lambda: 13000,
                                        runtimeGetVersion=lambda: 13000)
        runtime.streamCaptureModeRelaxed = 2
        self.cuda = types.SimpleNamespace(Stream=_Stream, Event=_Event, get_current_stream=_current_stream,
                                          runtime=runtime, Graph=_Graph, MemoryPool=_MemoryPool,
                                          using_allocator=_using_allocator, get_allocator=_get_allocator,
                                          Device=lambda i: types.SimpleNamespace(use=lambda: self.bound.append(i)))


_DTYPES = {code: name for name, code in NCCL_DATATYPES.items()}
_REDUCERS = {NCCL_OPS["sum"]: np.add, NCCL_OPS["prod"]: np.multiply, NCCL_OPS["max"]: np.maximum,
             NCCL_OPS["min"]: np.minimum}


def _memory(ptr, count, code):
    """The ``count`` elements of NCCL datatype ``code`` at address ``ptr``, as a writable numpy view."""
    name = _DTYPES[code]
    if name == "bfloat16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(name)
    if count == 0:
        return np.empty(0, dtype=dtype)
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dtype)


class _Hub:
    """The ranks of one fake NCCL communicator."""

    def __init__(self, size):
        self.size = size
        self.lock = threading.Condition()
        self.slots = {}
        self.mail = defaultdict(deque)
        self.failed = None

    def wait(self, ready):
        if not self.lock.wait_for(lambda: ready() or self.failed is not None, WAIT):
            raise TimeoutError("fake NCCL: ranks never met (a rank missed a call)")
        if self.failed is not None and not ready():
            raise RuntimeError(f"fake NCCL: {self.failed}")


class FakeNccl(types.ModuleType):
    """``cupy.cuda.nccl`` for the tests. ``calls`` logs (rank, call, details) in call order."""

    def __init__(self, version=23203):
        super().__init__("cupy.cuda.nccl")
        self.available = True
        self._version = version
        self._hubs = {}
        self._lock = threading.Lock()
        self._group = threading.local()
        self.calls = []
        for name, code in NCCL_DATATYPES.items():
            setattr(self, f"NCCL_{name.upper()}", code)
        for name, code in NCCL_OPS.items():
            setattr(self, f"NCCL_{name.upper()}", code)
        module = self

        class NcclCommunicator:
            def __init__(self, ndev, commId, rank):
                if not isinstance(commId, bytes) or len(commId) != 128:
                    raise TypeError("commId must be 128 bytes")
                with module._lock:
                    self.hub = module._hubs.setdefault(commId, _Hub(ndev))
                self.rank, self.seq, self.module = rank, 0, module

            def _log(self, *details):
                self.module.calls.append((self.rank, *details, self.module._in_group()))

            def _issue(self, stream, run):
                """Run a collective now, or record it when this thread captures (NCCL's graph capture).

                Captured, it is issued to the tape only on a stream that has joined the capture: NCCL
                on a stream outside it would run now, at the capture, and never in the graph.
                """
                if not strict_cupy.capturing():
                    run()
                    return
                where = _Stream.at(stream)
                if where is None or not where.is_capturing():
                    raise RuntimeError("fake NCCL: a collective issued during a capture on a stream outside it "
                                       "(it would run now and never in the graph); order the stream after an "
                                       "event recorded in the capture")
                where.work += 1
                strict_cupy._run(run, in_place=True)

            def _collective(self, entry, compute):
                hub, seq = self.hub, self.seq
                self.seq += 1
                with hub.lock:
                    slot = hub.slots.setdefault(seq, {})
                    slot[self.rank] = entry
                    if len(slot) == hub.size:
                        entries = [slot[r] for r in range(hub.size)]
                        if len({e[0] for e in entries}) != 1:
                            hub.failed = f"ranks called different collectives: {[e[0] for e in entries]}"
                        else:
                            compute(entries)
                        slot["done"] = True
                        hub.lock.notify_all()
                    hub.wait(lambda: slot.get("done"))
                    if hub.failed is not None:
                        raise RuntimeError(f"fake NCCL: {hub.failed}")

            def allReduce(self, send, recv, count, dtype, op, stream):
                def run():
                    self._log("allReduce", count, dtype, op)

                    def compute(entries):
                        total = _memory(entries[0][1], count, dtype).copy()
                        if op == NCCL_OPS["avg"]:
                            for e in entries[1:]:
                                total += _memory(e[1], count, dtype)
                            total /= len(entries)
                        else:
                            for e in entries[1:]:
                                _REDUCERS[op](total, _memory(e[1], count, dtype), out=total)
                        for e in entries:
                            _memory(e[2], count, dtype)[...] = total

                    self._collective(("allReduce", send, recv), compute)

                self._issue(stream, run)

            def broadcast(self, send, recv, count, dtype, root, stream):
                def run():
                    self._log("broadcast", count, dtype, root)

                    def compute(entries):
                        src = _memory(entries[root][1], count, dtype).copy()
                        for e in entries:
                            _memory(e[2], count, dtype)[...] = src

                    self._collective(("broadcast", send, recv), compute)

                self._issue(stream, run)

            def allGather(self, send, recv, count, dtype, stream):
                def run():
                    self._log("allGather", count, dtype)

                    def compute(entries):
                        parts = [_memory(e[1], count, dtype).copy() for e in entries]
                        for e in entries:
                            _memory(e[2], count * len(entries), dtype)[...] = np.concatenate(parts)

                    self._collective(("allGather", send, recv), compute)

                self._issue(stream, run)

            def reduceScatter(self, send, recv, count, dtype, op, stream):
                def run():
                    self._log("reduceScatter", count, dtype, op)

                    def compute(entries):
                        n = len(entries)
                        total = _memory(entries[0][1], count * n, dtype).copy()
                        for e in entries[1:]:
                            _REDUCERS[op](total, _memory(e[1], count * n, dtype), out=total)
                        for r, e in enumerate(entries):
                            _memory(e[2], count, dtype)[...] = total[r * count:(r + 1) * count]

                    self._collective(("reduceScatter", send, recv), compute)

                self._issue(stream, run)

            def send(self, buf, count, dtype, peer, stream):
                strict_cupy.refuse_in_capture("fake NCCL send", "the stand-in does not play captured messages")
                self._log("send", count, dtype, peer)
                with self.hub.lock:
                    self.hub.mail[(self.rank, peer)].append((count, dtype, _memory(buf, count, dtype).copy()))
                    self.hub.lock.notify_all()

            def recv(self, buf, count, dtype, peer, stream):
                strict_cupy.refuse_in_capture("fake NCCL recv", "the stand-in does not play captured messages")
                self._log("recv", count, dtype, peer)
                pending = (self.hub, peer, self.rank, buf, count, dtype)
                if self.module._in_group():
                    self.module._group.pending.append(pending)
                else:
                    FakeNccl._deliver(pending)

            def destroy(self):
                self.module.calls.append((self.rank, "destroy", False))

            def abort(self):
                with self.hub.lock:
                    self.hub.failed = "aborted"
                    self.hub.lock.notify_all()

        self.NcclCommunicator = NcclCommunicator

    def _in_group(self):
        return getattr(self._group, "depth", 0) > 0

    @staticmethod
    def _deliver(pending):
        hub, src, dst, buf, count, dtype = pending
        box = hub.mail[(src, dst)]
        with hub.lock:
            hub.wait(lambda: bool(box))
            got_count, got_dtype, data = box.popleft()
        if (got_count, got_dtype) != (count, dtype):
            raise RuntimeError(f"fake NCCL: rank {src} sent {got_count} of type {got_dtype}, "
                               f"rank {dst} receives {count} of type {dtype}")
        _memory(buf, count, dtype)[...] = data

    def get_version(self):
        return self._version

    def get_unique_id(self):
        return os.urandom(128)

    def groupStart(self):
        g = self._group
        g.depth = getattr(g, "depth", 0) + 1
        if g.depth == 1:
            g.pending = []

    def groupEnd(self):
        g = self._group
        g.depth -= 1
        if g.depth == 0:
            pending, g.pending = g.pending, []
            for p in pending:
                FakeNccl._deliver(p)


def install(modules, devices=1, version=23203):
    """Put a FakeCupy (with ``cuda.nccl``) into ``modules`` (``sys.modules`` or a monkeypatched mapping).

    Returns:
        (cupy, nccl): the two fakes.
    """
    import importlib.machinery

    cupy = FakeCupy(devices)
    nccl = FakeNccl(version)
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.cuda.nccl = nccl
    modules["cupy"] = cupy
    modules["cupy.cuda"] = cupy.cuda
    modules["cupy.cuda.nccl"] = nccl
    return cupy, nccl


def run_device_world(fn, n, nccl=None, cupy=None):
    """``fn(world)`` on n threads over DeviceDispatchBackend(local host, NCCLBackend on the fakes).

    The fake cupy must be in ``sys.modules["cupy"]`` (the caller's monkeypatch) so that the
    library takes DeviceArrays for device arrays. Returns the results in rank order; re-raises
    the first failure.
    """
    import axonhpc as ax
    from axonhpc.backends.dispatch import DeviceDispatchBackend
    from axonhpc.backends.local import LocalBackend
    from axonhpc.backends.nccl import NCCLBackend
    from axonhpc.groups import runtime

    nccl = nccl or FakeNccl()
    cupy = cupy or sys.modules["cupy"]
    hosts = LocalBackend.create_world(n)
    results, errors = [None] * n, [None] * n

    def body(rank):
        try:
            composite = DeviceDispatchBackend(hosts[rank], lambda h: NCCLBackend(h, cupy, nccl))
            world = ax.World(composite)
            runtime._thread.world = world
            results[rank] = fn(world)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc
            hosts[rank].abort_quietly(f"rank {rank} raised {exc!r}")
            for hub in nccl._hubs.values():
                with hub.lock:
                    hub.failed = f"rank {rank} raised {exc!r}"
                    hub.lock.notify_all()
        finally:
            runtime._thread.world = None

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 4)
    failed = [e for e in errors if e is not None]
    if failed:
        raise failed[0]
    return results


def bench_device(fake):
    """``axonhpc.bench.step.Device`` played by the stand-in ``fake``: its arrays, and a fixed description."""
    from axonhpc.bench import step

    class StandIn(step.Device):
        def __init__(self, name):
            self.name, self.xp = name, fake

        def describe(self):
            return "cuda: the strict stand-in"

    return StandIn
