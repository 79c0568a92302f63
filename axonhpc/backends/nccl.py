"""NCCL backend: cupy arrays over ``cupy.cuda.nccl``, one NCCL communicator per process group.

UNTESTED ON A GPU: the pure parts (tables, unique-id bootstrap, readiness vote) are tested; the device calls
follow cupy's documented NCCL API and have never run.

[Note: NCCL backend]
- Bootstrap: ``ncclCommInitRank`` waits for every rank, so the ranks first vote over MPI on readiness and
  compare devices: a failure raises on every rank, and none waits inside NCCL for one that failed early.
- Streams: calls run on the backend's own stream after the caller's; a blocking call makes the caller's
  stream wait for its event without a host wait (as PyTorch does), so later kernels, host reads and pool
  reuse come after it. ``barrier()`` and ``wait(timeout)`` wait on the host (a timeout is a host clock).
- Capture: a captured event cannot be queried, so ``is_completed()`` answers False during a capture.
- Point to point: NCCL matches in call order per peer, with no tags. Sends and receives that must run
  concurrently (a ring step) must share one ``groupStart``/``groupEnd``, so non-blocking ones are queued and
  issued together when one of their Works is waited on, or with the next operation (a blocking send or receive
  joins their group: an ``irecv`` then a blocking ``send`` on both ranks of a pair is one group each), or before
  the world's next host operation (``DeviceDispatchBackend``), so that no send waits unissued while its rank
  waits on the host. Each message is announced over the host and checked by its receive
  ([Note: envelopes] in ``nccl_envelopes``).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import is_integer
from ..errors import BackendUnavailableError, ShapeError, UnsupportedDtypeError
from .base import Backend, CompletedWork, ReduceOp, Work
from .devices import nccl_version_tuple
from .nccl_envelopes import Envelopes, Expected
from .shared_device import agree_distinct_devices, device_identity

NCCL_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h

# ncclDataType_t and ncclRedOp_t from nccl.h: fixed by NCCL's C ABI. cupy's
# constants are used when cupy is there (``nccl_constants``); this table is the
# fallback and what the tests check cupy against.
NCCL_DATATYPES: Dict[str, int] = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
NCCL_OPS: Dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

# ncclAvg and ncclBfloat16 arrived together in NCCL 2.10.3.
AVG_SINCE = (2, 10, 3)
BFLOAT16_SINCE = (2, 10, 3)

_REDUCE_OP_NAMES = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                    ReduceOp.AVG: "avg"}


def nccl_constants(module: Any = None) -> Dict[str, int]:
    """Datatype and op codes by name ("float32", "sum", ...): cupy's where it has them, else nccl.h's."""
    table = {**NCCL_DATATYPES, **{f"op:{k}": v for k, v in NCCL_OPS.items()}}
    if module is None:
        return table
    out = {}
    for key, value in table.items():
        name = "NCCL_" + key.split(":")[-1].upper()
        out[key] = int(getattr(module, name, value))
    return out


def nccl_datatype(dtype: Any, version: Optional[Tuple[int, int, int]] = None,
                  constants: Optional[Dict[str, int]] = None, reducing: bool = False) -> int:
    """The NCCL datatype code that moves (and, when ``reducing``, reduces) ``dtype``.

    Raises:
        UnsupportedDtypeError: NCCL has no such type, or this NCCL cannot reduce it (bfloat16 needs >= 2.10.3).
    """
    table = constants or nccl_constants()
    name = np.dtype(dtype).name
    if name == "bfloat16" and version is not None and tuple(version) < BFLOAT16_SINCE:
        if reducing:
            raise UnsupportedDtypeError(
                f"NCCL {'.'.join(map(str, version))} cannot reduce bfloat16 (needs NCCL >= 2.10.3); "
                "reduce in float32 or update NCCL")
        name = "float16"  # same width: moving the bytes is exact
    if name not in NCCL_DATATYPES:
        raise UnsupportedDtypeError(f"NCCL has no datatype for {name}; use one of {sorted(NCCL_DATATYPES)}")
    return table[name]


def reduction_plan(op: ReduceOp, dtype: Any, version: Optional[Tuple[int, int, int]] = None) -> Tuple[str, bool]:
    """(NCCL op name, divide the result by the group size afterwards) for ``op`` on ``dtype``."""
    if op is not ReduceOp.AVG:
        return _REDUCE_OP_NAMES[op], False
    if is_integer(dtype) or (version is not None and tuple(version) < AVG_SINCE):
        return "sum", True
    return "avg", False


# -- bootstrap ----------------------------------------------------------------------------------------
def unique_id_bytes(uid: Any) -> bytes:
    """A unique id as cupy returns it (bytes, or before cupy 14 a tuple of signed chars) as 128 bytes; else ShapeError."""
    if isinstance(uid, (bytes, bytearray)):
        raw = bytes(uid)
    else:
        raw = bytes(int(v) & 0xFF for v in uid)
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ShapeError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def unique_id_tuple(raw: bytes) -> Tuple[int, ...]:
    """The 128 bytes as the tuple of signed chars older cupy's ``NcclCommunicator`` takes."""
    return tuple(b - 256 if b > 127 else b for b in raw)


def bootstrap_unique_id(rank: int, broadcast_bytes: Callable[[bytes], bytes], make_id: Callable[[], Any]) -> bytes:
    """Collective: rank 0 makes an NCCL unique id and every rank gets it (a status byte first, so a failure raises everywhere).

    Raises:
        BackendUnavailableError: rank 0 could not make the id (on every rank).
    """
    payload = bytes(1 + NCCL_UNIQUE_ID_BYTES)
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            payload = b"\0" + unique_id_bytes(make_id())
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = exc
            payload = b"\1" + bytes(NCCL_UNIQUE_ID_BYTES)
    got = bytes(broadcast_bytes(payload))
    if len(got) != 1 + NCCL_UNIQUE_ID_BYTES:
        raise ShapeError(f"the unique-id broadcast returned {len(got)} bytes, expected {1 + NCCL_UNIQUE_ID_BYTES}")
    if got[0] != 0:
        detail = f": {type(error).__name__}: {error}" if error is not None else " (see the error on rank 0)"
        raise BackendUnavailableError(f"rank 0 could not create the NCCL unique id{detail}") from error
    return got[1:]


def agree_ready(problem: Optional[str], gather_flags: Callable[[int], Sequence[int]],
                global_ranks: Sequence[int]) -> None:
    """Collective: raise BackendUnavailableError on every rank, naming them, when any rank is not ready for NCCL."""
    flags = list(gather_flags(0 if problem else 1))
    bad = [global_ranks[i] for i, f in enumerate(flags) if not f]
    if bad:
        mine = f"; here: {problem}" if problem else ""
        raise BackendUnavailableError(f"NCCL cannot start: ranks {bad} are not ready{mine}")


def _host_bytes_broadcast(host: Backend) -> Callable[[bytes], bytes]:
    def broadcast_bytes(payload: bytes) -> bytes:
        buf = np.frombuffer(payload, dtype=np.uint8).copy()
        host.broadcast(buf, 0, async_op=False).wait()
        return buf.tobytes()

    return broadcast_bytes


def _host_bytes_gather(host: Backend) -> Callable[[bytes], Sequence[bytes]]:
    def gather(payload: bytes) -> Sequence[bytes]:
        mine = np.frombuffer(payload, dtype=np.uint8).copy()
        table = np.empty((host.size, mine.size), dtype=np.uint8)
        host.all_gather(mine, table, async_op=False).wait()
        return [row.tobytes() for row in table]

    return gather


def _host_flag_gather(host: Backend) -> Callable[[int], Sequence[int]]:
    def gather(flag: int) -> Sequence[int]:
        mine = np.array([flag], dtype=np.int32)
        table = np.empty((host.size, 1), dtype=np.int32)
        host.all_gather(mine, table, async_op=False).wait()
        return table[:, 0].tolist()

    return gather


# -- device side --------------------------------------------------------------------------------------
class NCCLWork(Work):
    """An NCCL operation: done when the event recorded after it on the backend's stream has fired."""

    def __init__(self, backend: "NCCLBackend", event, keep: Tuple, result=None, host_wait: bool = False,
                 expected: Optional[Expected] = None):
        super().__init__(result)
        self._backend = backend
        self._event = event  # None while queued (a non-blocking send/receive not issued yet)
        self._keep = keep
        self._host_wait = host_wait  # a barrier: wait() waits on the host
        self._expected = expected  # a receive's envelope, checked before its data is waited for

    def _issued(self):
        if self._event is None:
            self._backend._flush()
        return self._event

    def _check(self) -> None:
        if self._expected is not None:
            self._backend._envelopes.check(self._expected)

    def _test(self) -> bool:
        event = self._issued()
        if self._backend.capturing():  # a captured event cannot be queried (nothing has run yet)
            return False
        if not event.done:
            return False
        self._check()  # the data is there, so its envelope, sent before it, is too
        return True

    def _block(self, timeout: Optional[float]) -> bool:
        if timeout is None and self._expected is not None:  # before the data: the wrong size would wait forever
            self._backend._envelopes.check(self._expected, before_wait=self._backend._before_envelope_wait)
        event = self._issued()
        if timeout is None or self._backend.capturing():  # in a capture: ordered on the stream, never on the host
            self._backend._wait_for(event, self._host_wait)
            return True
        return super()._block(timeout)

    def _finish(self) -> None:
        self._keep = ()
        super()._finish()


class NCCLBackend(Backend):
    """cupy arrays over one NCCL communicator, bootstrapped over ``host``, the group's MPI backend.

    Raises:
        BackendUnavailableError: on every rank, when cupy/NCCL cannot start on any rank, or ranks share a GPU.
    """

    name = "nccl"

    def __init__(self, host: Backend, cupy_module: Any = None, nccl_module: Any = None):
        self._host = host
        self.rank, self.size, self.global_ranks = host.rank, host.size, tuple(host.global_ranks)
        problem, identity = None, None
        try:  # everything that can fail on one rank alone, before the ranks vote
            if cupy_module is None:
                import cupy as cupy_module
            if nccl_module is None:
                from cupy.cuda import nccl as nccl_module
            if not getattr(nccl_module, "available", False):
                problem = "cupy cannot load NCCL"
            else:
                self.version = nccl_version_tuple(nccl_module.get_version())
                self._codes = nccl_constants(nccl_module)
                self._stream = cupy_module.cuda.Stream(non_blocking=True)
                identity = device_identity(cupy_module)
        except Exception as exc:  # noqa: BLE001 - voted on below
            problem = f"{type(exc).__name__}: {exc}"
        agree_ready(problem, _host_flag_gather(host), self.global_ranks)
        if self.size > 1:  # NCCL refuses two ranks on one GPU: say so on every rank, before it starts
            agree_distinct_devices(identity, _host_bytes_gather(host), self.global_ranks)
        self._cp, self._nccl = cupy_module, nccl_module
        uid = bootstrap_unique_id(self.rank, _host_bytes_broadcast(host), nccl_module.get_unique_id)
        self._comm = self._communicator(uid)
        self._envelopes = Envelopes(host.split(0, self.rank), lambda r: self.global_ranks[r])
        self._pending: List[Tuple[str, Any, int, Optional["NCCLWork"]]] = []
        self._one = None  # the barrier's one-element buffer

    def _communicator(self, uid: bytes):
        make = self._nccl.NcclCommunicator
        try:
            return make(self.size, uid, self.rank)
        except TypeError:  # cupy < 14 takes the id as a tuple of signed chars
            return make(self.size, unique_id_tuple(uid), self.rank)

    def captures(self, buf) -> bool:
        """Yes: every call is issued on a stream (see the module note's "Capture")."""
        return True

    def capturing(self) -> bool:
        """Whether the caller's current stream is capturing a CUDA graph."""
        return bool(self._cp.cuda.get_current_stream().is_capturing())

    # -- issuing ----------------------------------------------------------------------------------
    def _begin(self) -> int:
        """Issue queued sends/receives, order this stream after the caller's; return the stream pointer."""
        if self._pending:
            self._flush()
        cp = self._cp
        ready = cp.cuda.Event(block=False, disable_timing=True)
        ready.record(cp.cuda.get_current_stream())
        self._stream.wait_event(ready)
        return self._stream.ptr

    def _end(self, async_op: bool, keep: Tuple, result=None, host_wait: bool = False) -> Work:
        done = self._cp.cuda.Event(block=False, disable_timing=True)
        done.record(self._stream)
        if async_op:
            return NCCLWork(self, done, keep, result, host_wait)
        self._wait_for(done, host_wait)
        return CompletedWork(result)

    def _wait_for(self, event, host_wait: bool) -> None:
        """Order the caller's current stream after ``event``; with ``host_wait`` wait for it on the host."""
        if host_wait:
            event.synchronize()
        else:
            self._cp.cuda.get_current_stream().wait_event(event)

    def _flush(self) -> Any:
        """Issue the queued sends and receives in one group; the event recorded after them (None if none)."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        stream = self._begin()
        self._group(lambda: [self._p2p(kind, buf, peer, stream) for kind, buf, peer, _ in pending])
        done = self._cp.cuda.Event(block=False, disable_timing=True)
        done.record(self._stream)
        for *_, work in pending:
            if work is not None:
                work._event = done
        return done

    def issue_queued(self) -> None:
        """Issue the queued non-blocking sends and receives now (before the world waits on the host)."""
        if self._pending:
            self._flush()

    def _before_envelope_wait(self) -> None:
        """Before a receive waits on the host for its envelope: issue the queue if it holds a send (the peer may
        need it to get as far as its own send); receives alone stay queued, to be checked before they are issued."""
        if any(kind == "send" for kind, *_ in self._pending):
            self._flush()

    def _group(self, body: Callable[[], Any]) -> None:
        self._nccl.groupStart()
        try:
            body()
        finally:
            self._nccl.groupEnd()

    def _p2p(self, kind: str, buf, peer: int, stream: int) -> None:
        if buf.size == 0:
            return
        dt = nccl_datatype(buf.dtype, self.version, self._codes)
        if kind == "send":
            self._comm.send(buf.data.ptr, buf.size, dt, peer, stream)
        else:
            self._comm.recv(buf.data.ptr, buf.size, dt, peer, stream)

    def _op(self, op: ReduceOp, dtype) -> Tuple[int, bool]:
        name, divide = reduction_plan(op, dtype, self.version)
        return self._codes[f"op:{name}"], divide

    def _divide(self, buf) -> None:
        """Finish a SUM-based AVG on this stream, after the reduction."""
        cp = self._cp
        with self._stream:
            if is_integer(buf.dtype):
                cp.floor_divide(buf, self.size, out=buf)
            else:
                cp.divide(buf, self.size, out=buf)

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, buf, op: ReduceOp, async_op: bool) -> Work:
        return self._all_reduce(buf, op, async_op, host_wait=False)

    def _all_reduce(self, buf, op: ReduceOp, async_op: bool, host_wait: bool) -> Work:
        code, divide = self._op(op, buf.dtype)
        dt = nccl_datatype(buf.dtype, self.version, self._codes, reducing=True)
        stream = self._begin()
        if buf.size:
            self._comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, dt, code, stream)
            if divide:
                self._divide(buf)
        return self._end(async_op, (buf,), host_wait=host_wait)

    def broadcast(self, buf, root: int, async_op: bool) -> Work:
        dt = nccl_datatype(buf.dtype, self.version, self._codes)
        stream = self._begin()
        if buf.size:
            self._comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, dt, root, stream)
        return self._end(async_op, (buf,))

    def all_gather(self, send, recv, async_op: bool) -> Work:
        dt = nccl_datatype(send.dtype, self.version, self._codes)
        stream = self._begin()
        if send.size:
            self._comm.allGather(send.data.ptr, recv.data.ptr, send.size, dt, stream)
        return self._end(async_op, (send, recv), recv)

    def reduce_scatter(self, send, recv, op: ReduceOp, async_op: bool) -> Work:
        code, divide = self._op(op, recv.dtype)
        dt = nccl_datatype(recv.dtype, self.version, self._codes, reducing=True)
        stream = self._begin()
        if recv.size:
            self._comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, dt, code, stream)
            if divide:
                self._divide(recv)
        return self._end(async_op, (send, recv), recv)

    def gather(self, send, recv, root: int, async_op: bool) -> Work:
        stream = self._begin()
        if send.size:
            if self.rank == root:
                rows = recv.reshape(self.size, -1)
                with self._stream:
                    rows[root] = send.reshape(-1)
                self._group(lambda: [self._p2p("recv", rows[r], r, stream) for r in range(self.size) if r != root])
            else:
                self._group(lambda: self._p2p("send", send, root, stream))
        return self._end(async_op, (send, recv), recv)

    def scatter(self, send, recv, root: int, async_op: bool) -> Work:
        stream = self._begin()
        if recv.size:
            if self.rank == root:
                rows = send.reshape(self.size, -1)
                with self._stream:
                    recv.reshape(-1)[...] = rows[root]
                self._group(lambda: [self._p2p("send", rows[r], r, stream) for r in range(self.size) if r != root])
            else:
                self._group(lambda: self._p2p("recv", recv, root, stream))
        return self._end(async_op, (send, recv), recv)

    def barrier(self, async_op: bool) -> Work:
        if self._one is None:
            self._one = self._cp.zeros(1, dtype=np.float32)
        return self._all_reduce(self._one, ReduceOp.SUM, async_op, host_wait=True)

    # -- point to point -----------------------------------------------------------------------------
    def send(self, buf, dst: int, tag: int, async_op: bool) -> Work:
        self._envelopes.announce(buf, dst, tag)
        return self._point_to_point("send", buf, dst, async_op, None, None)

    def recv(self, buf, src: int, tag: int, async_op: bool) -> Work:
        return self._point_to_point("recv", buf, src, async_op, buf, self._envelopes.expect(buf, src, tag))

    def _point_to_point(self, kind: str, buf, peer: int, async_op: bool, result,
                        expected: Optional[Expected]) -> Work:
        if async_op:
            work = NCCLWork(self, None, (buf,), result, expected=expected)
            self._pending.append((kind, buf, peer, work))
            return work
        if expected is not None:
            self._envelopes.check(expected, before_wait=self._before_envelope_wait)
        self._pending.append((kind, buf, peer, None))  # in one group with the queued ones (module note)
        self._wait_for(self._flush(), False)
        return CompletedWork(result)

    # -- communicators ------------------------------------------------------------------------------
    def split(self, color: Optional[int], key: int) -> Optional["NCCLBackend"]:
        host = self._host.split(color, key)
        return None if host is None else NCCLBackend(host, self._cp, self._nccl)

    def create_group(self, ranks: Sequence[int]) -> Optional["NCCLBackend"]:
        host = self._host.create_group(ranks)
        return None if host is None else NCCLBackend(host, self._cp, self._nccl)

    def node_layout(self, local_key: Optional[int] = None) -> Tuple[int, int, int, int]:
        return self._host.node_layout(local_key)

    def abort(self, code: int = 1) -> None:
        comm = getattr(self, "_comm", None)
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - the job is ending either way
                pass
        self._host.abort(code)

    def free(self) -> None:
        comm = getattr(self, "_comm", None)
        if comm is not None and not sys.is_finalizing():
            comm.destroy()
            self._comm = None
        envelopes = getattr(self, "_envelopes", None)
        if envelopes is not None:
            envelopes.free()
            self._envelopes = None


__all__ = ["NCCLBackend", "NCCLWork", "NCCL_DATATYPES", "NCCL_OPS", "NCCL_UNIQUE_ID_BYTES", "nccl_constants",
           "nccl_datatype", "reduction_plan", "unique_id_bytes", "unique_id_tuple", "bootstrap_unique_id",
           "agree_ready"]
