"""MPI backend over any mpi4py intracommunicator.

[Note: MPI backend]
The backend works on a ``Dup`` of its communicator, so its messages never match the user's. Blocking calls
use MPI's blocking collectives, which libraries tune better than the ``I*`` twins. MPI counts are C ints, so
buffers beyond ``settings.max_message_elements`` move in chunks. Device arrays go to a CUDA-aware MPI as they
are, else through pinned host twins (neither path has run on a GPU yet).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import array_module, is_cupy_array
from ..errors import BackendUnavailableError, InvalidArgumentError, ShapeError, UsageError
from ..settings import settings
from .base import Backend, CompletedWork, ReduceOp, Work
from .mpi_arrivals import Arrivals
from .mpi_p2p import Looker, drop, largest_tag, refuse_other, wire_tag
from .mpi_work import (ChunkPlan, MPIWork, chunk_bounds, host_only_op, load_mpi, mpi_datatype, mpi_op, raise_failure,
                       poll, widened_for_mpi)


def _cuda_aware() -> bool:
    from .cuda_aware import cuda_aware_mpi

    return cuda_aware_mpi().aware


def _cuda_aware_reason() -> str:
    from .cuda_aware import cuda_aware_mpi

    return cuda_aware_mpi().how


def pinned_staging():
    """The process's pinned staging area for device arrays MPI cannot take; BackendUnavailableError if impossible."""
    from .staging import cupy_staging

    try:
        return cupy_staging()
    except Exception as exc:  # noqa: BLE001 - no pinned memory: say which path failed and why
        raise BackendUnavailableError(
            f"cupy arrays reached the MPI backend, MPI is not CUDA-aware ({_cuda_aware_reason()}), and "
            f"staging through pinned host memory failed: {type(exc).__name__}: {exc}"
        ) from exc


def _accept(backend: "MPIBackend", buf, flat, message, status, a: int, b: int, src: int, tag: int, blocking: bool):
    """Receive the matched ``message`` into ``flat[a:b]`` (its request when not ``blocking``), or drop it and raise
    ``ShapeError`` when its size differs ([Note: checking a receive's size])."""
    MPI = load_mpi()
    got = status.Get_count(MPI.BYTE)
    if got != (b - a) * flat.dtype.itemsize:
        drop(message, got)
        raise backend._size_problem(buf, src, tag, got, b - a, chunk=None if (a, b) == (0, flat.size) else (a, b))
    spec = [flat[a:b], b - a, mpi_datatype(flat.dtype)]
    if blocking:
        message.Recv(spec)
        return None
    return message.Irecv(spec)


def _probe(backend: "MPIBackend", buf, src: int, tag: int, wire: int, looker: Looker, status) -> Any:
    """The receive's next message (``Improbe``) if it has arrived, else None, having looked for one of another
    dtype; that one is refused only if this receive's own message is still not there after it
    ([Note: the next message is not a mismatch])."""
    comm = backend.comm
    message = comm.Improbe(src, wire, status)
    if message is None:
        other = looker.look()
        if other is not None:
            message = comm.Improbe(src, wire, status)
            if message is None:
                raise refuse_other(comm, src, other, buf, lambda: backend.describe_receive(src, tag))
    return message


def _receive(backend: "MPIBackend", buf, flat, a: int, b: int, src: int, tag: int, wire: int,
             looker: Optional[Looker]) -> None:
    """Wait for the message of ``flat[a:b]`` (polled: see ``mpi_work.poll``), check its size, receive it.

    ``looker``: None makes one only if the message is not there at the first probe.
    """
    status = load_mpi().Status()
    message = backend.comm.Improbe(src, wire, status)
    if message is None:
        looker = looker or Looker(backend.comm, src, wire)
        found = [None]

        def arrived() -> bool:
            found[0] = _probe(backend, buf, src, tag, wire, looker, status)
            return found[0] is not None

        poll(arrived)
        message = found[0]
    _accept(backend, buf, flat, message, status, a, b, src, tag, blocking=True)


class _MatchedReceive(Work):
    """A receive that matches each message before receiving it, so that its size is checked first.

    [Note: checking a receive's size]
    MPI reports a too-long message only as a raw "Message truncated" error, after the fact. So a receive first
    matches the message (``MPI_Improbe``) and compares sizes; on a difference it drains it into scratch (so the
    sender is not left waiting) and raises ``ShapeError``. While it waits it also looks for the message under
    another dtype's tag ([Note: the dtype in the tag]); seeing one, it probes for its own once more before it
    refuses ([Note: the next message is not a mismatch]). A posted ``irecv`` cannot be matched early without
    changing MPI's semantics, so it checks its statuses on completion (``_PostedReceive``).
    """

    def __init__(self, backend: "MPIBackend", buf, flat, blocks, src: int, tag: int):
        super().__init__(buf)
        self._backend, self._buf, self._flat = backend, buf, flat
        self._pending = list(blocks)
        self._src, self._tag = src, tag
        self._wire = wire_tag(backend.comm, tag, flat.dtype)
        self._looker = Looker(backend.comm, src, self._wire)
        self._requests: List[Any] = []

    def _accept(self, message, status, a: int, b: int, blocking: bool):
        return _accept(self._backend, self._buf, self._flat, message, status, a, b, self._src, self._tag, blocking)

    def _probe(self, status) -> Any:
        """The next message of this receive if it has arrived, else None (having looked for another dtype's)."""
        return _probe(self._backend, self._buf, self._src, self._tag, self._wire, self._looker, status)

    def run_blocking(self) -> Work:
        MPI = load_mpi()
        try:
            while self._pending:
                a, b = self._pending.pop(0)
                _receive(self._backend, self._buf, self._flat, a, b, self._src, self._tag, self._wire, self._looker)
        except MPI.Exception as exc:
            raise_failure(self._backend.comm, exc)
        return CompletedWork(self._buf)

    def _match(self) -> bool:
        """Match every chunk whose message has arrived; True once all are matched."""
        MPI = load_mpi()
        while self._pending:
            status = MPI.Status()
            message = self._probe(status)
            if message is None:
                return False
            a, b = self._pending.pop(0)
            self._requests.append(self._accept(message, status, a, b, blocking=False))
        return True

    def _test(self) -> bool:
        MPI = load_mpi()
        try:
            return self._match() and MPI.Request.Testall(self._requests)
        except MPI.Exception as exc:
            raise_failure(self._backend.comm, exc)


class _PostedReceive(MPIWork):
    """``irecv``'s posted receives, whose statuses are checked when they complete (see ``_MatchedReceive``).

    ``where()``: the receive as messages name it.
    """

    def __init__(self, steps, buf, problem, facts, comm, looker: Looker, where: Callable[[], str]):
        super().__init__(steps, buf, sequential=False, comm=comm)
        self._problem, self._facts, self._looker, self._where = problem, facts, looker, where
        self._statuses: Optional[list] = None  # made on the first test, then reused by every poll

    def _complete(self, call) -> Optional[list]:
        """``call(requests, statuses)`` (Testall or Waitall): the statuses once every request is done, else None.

        A message longer than its chunk raises ``ShapeError`` here (MPI's ERR_TRUNCATE).
        """
        MPI = load_mpi()
        statuses = self._statuses
        if statuses is None or len(statuses) != len(self._requests):
            statuses = self._statuses = [MPI.Status() for _ in self._requests]
        try:
            done = call(self._requests, statuses)
        except MPI.Exception as exc:
            # One request reports ERR_TRUNCATE itself; with statuses MPI reports ERR_IN_STATUS and puts
            # each request's error code in its status.
            big = [i for i, s in enumerate(statuses) if MPI.Get_error_class(s.Get_error()) == MPI.ERR_TRUNCATE]
            if not big and exc.Get_error_class() != MPI.ERR_TRUNCATE:
                raise_failure(self._comm, exc)
            buf, blocks, src, tag = self._facts
            a, b = blocks[(big or [0])[0]]
            raise self._problem(buf, src, tag, None, b - a, larger=True,
                                chunk=None if len(blocks) == 1 else (a, b)) from None
        return None if done is False else statuses

    def _test_requests(self) -> bool:
        if not self._requests:
            return True
        MPI = load_mpi()
        try:
            return self._test_now(MPI)
        except MPI.Exception as exc:  # the look for another dtype's message (Iprobe), a cancel, a refusal's receive
            raise_failure(self._comm, exc)

    def _test_now(self, MPI) -> bool:
        statuses = self._complete(MPI.Request.Testall)
        if statuses is None:
            other = self._looker.look()
            if other is None:
                return False
            # A message of another dtype waits under this tag: a mismatch only if no message of this receive
            # came before it. One that did is matched to these requests already, and their cancel fails
            # ([Note: the next message is not a mismatch]).
            for request in self._requests:
                request.Cancel()
            statuses = self._complete(MPI.Request.Waitall)
            if any(status.Is_cancelled() for status in statuses):
                buf, _, src, _ = self._facts
                raise refuse_other(self._comm, src, other, buf, self._where)
        buf, blocks, src, tag = self._facts
        for (a, b), status in zip(blocks, statuses):
            got = status.Get_count(MPI.BYTE)
            if got != (b - a) * buf.dtype.itemsize:
                raise self._problem(buf, src, tag, got, b - a, chunk=None if len(blocks) == 1 else (a, b))
        return self._advance()

    def _block(self, timeout: Optional[float]) -> bool:
        # Polled, not MPI_Waitall: the wait must look for the message under another dtype's tag (a test that ended
        # in an error, from another wait, raises it again: ``MPIWork._test``).
        return poll(self._test, None if timeout is None else time.monotonic() + timeout)


def new_communicator(make: Callable[[], Any], what: str) -> Any:
    """``make()``'s communicator, or UsageError when MPI has run out of them (a raw mpi4py error otherwise).

    Each process group holds two or three MPI communicators (its own, the side channel of timed calls, and
    a shared-memory window's), more with the collective layer's private channels, until
    ``ProcessGroup.destroy`` frees them: MPICH allows about 2,000 in all.
    """
    MPI = load_mpi()
    try:
        return make()
    except MPI.Exception as exc:
        text = exc.Get_error_string()
        # MPICH: "Too many communicators (0/2048 free ...)"; Open MPI: out of context ids / resources.
        if not any(sign in text.lower() for sign in ("too many communicators", "context id", "out of resource")):
            raise
        raise UsageError(f"MPI could not make the communicator of {what}: it has run out of them. Every process "
                         f"group (new_group, split, each group of a mesh) keeps two or three MPI communicators until "
                         f"it is destroyed, and MPI has a few thousand: make each group once and reuse it, and call "
                         f"group.destroy() (mesh.destroy() for a mesh's groups) on every member of a group you are "
                         f"done with. MPI said: {text.strip()}") from exc


class MPIBackend(Backend):
    """Backend over an mpi4py intracommunicator (a private ``Dup`` of it).

    ``dup``: False adopts ``comm`` itself, for communicators this library created.
    """

    name = "mpi"

    def __init__(self, comm, dup: bool = True):
        MPI = load_mpi()
        if comm == MPI.COMM_NULL:
            raise InvalidArgumentError("MPIBackend needs a communicator, got MPI.COMM_NULL")
        if comm.Is_inter():
            raise InvalidArgumentError("MPIBackend needs an intracommunicator, got an intercommunicator")
        self.comm = new_communicator(comm.Dup, "a process group") if dup else comm
        # The side channel of timed collectives' arrival notices (see Arrivals): made now, while every
        # rank takes part, because a timeout is exactly when some rank would not come to a Dup.
        self._side = new_communicator(self.comm.Dup, "a process group's side channel")
        self._silent: set = set()  # peers that sent no arrival notice for a call that completed (``Arrivals.drain``)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # The world that owns this backend renames these to its own ranks.
        self.global_ranks = tuple(range(self.size))
        self._layout: Optional[Tuple[int, int, int, int]] = None

    # -- helpers --------------------------------------------------------------
    @staticmethod
    def _flat(buf) -> np.ndarray:
        if is_cupy_array(buf):
            # Only the CUDA-aware path gets here with a device array: MPI reads
            # it without knowing about streams, so the kernels that wrote it
            # must be done.
            sys.modules["cupy"].cuda.get_current_stream().synchronize()
        return buf.reshape(-1)

    def _staged(self, buf) -> bool:
        """True when ``buf`` is a device array that MPI cannot take directly (it is staged)."""
        return is_cupy_array(buf) and not _cuda_aware()

    def stages(self, buf) -> bool:
        """A device array, and MPI is not CUDA-aware: each operation runs on pinned host twins."""
        return self._staged(buf)

    def _on_host(self, method, args: tuple, reads, writes) -> Work:
        """Run ``method`` on pinned host twins of the device arrays in ``args``."""
        from .staging import run_staged

        work = run_staged(lambda *host: method(self, *host), args, reads, writes, pinned_staging())
        if not args[-1]:  # async_op=False: the copy back happens before returning
            work.wait()
        return work

    @staticmethod
    def _spec(flat: np.ndarray, start: int, stop: int):
        return [flat[start:stop], stop - start, mpi_datatype(flat.dtype)]

    def _limit(self, per_rank_parts: int = 1) -> int:
        return max(1, settings.max_message_elements // per_rank_parts)

    def reducer(self, buf: np.ndarray, op: ReduceOp, nonblocking: bool = False) -> Callable[[], None]:
        """One ``Allreduce`` (or ``Iallreduce`` and its wait) on the prepared buffer (see ``Backend.reducer``).

        A buffer longer than ``settings.max_message_elements`` goes in ``all_reduce``'s chunks, so that the calls
        still meet those of ``all_reduce(buf, op, True)`` on a rank under a timeout (read at each call, as there).
        """
        if widened_for_mpi(buf.dtype, op) is not None:
            return super().reducer(buf, op, nonblocking)
        MPI, comm = load_mpi(), self.comm
        args = (MPI.IN_PLACE, [buf, mpi_datatype(buf.dtype)], mpi_op(op, buf.dtype))
        chunked = super().reducer(buf, op, nonblocking)

        def reduce() -> None:
            if buf.size > settings.max_message_elements:
                return chunked()
            try:
                comm.Allreduce(*args)
            except MPI.Exception as exc:
                raise_failure(comm, exc)

        def reduce_nonblocking() -> None:
            if buf.size > settings.max_message_elements:
                return chunked()
            try:
                comm.Iallreduce(*args).Wait()
            except MPI.Exception as exc:
                raise_failure(comm, exc)

        return reduce_nonblocking if nonblocking else reduce

    def _widened(self, method, args: tuple, wide: np.dtype, reads, writes) -> Work:
        """Run ``method`` on ``wide`` twins of the arrays ``args[i]``: ``reads`` filled, ``writes`` cast back on
        completion (as ``_on_host`` stages device arrays; ``args`` ends with ``async_op``)."""
        twins = list(args)
        for i in set(reads) | set(writes):
            twins[i] = args[i].astype(wide) if i in reads else array_module(args[i]).empty(args[i].shape, dtype=wide)

        def back() -> None:
            for i in writes:
                args[i][...] = twins[i].astype(args[i].dtype)

        work = method(self, *twins).then(back)
        for i in writes:
            if work._result is twins[i]:  # the call's result is the caller's array, not its twin
                work._result = args[i]
        if not args[-1]:  # async_op=False: the cast back happens before returning
            work.wait()
        return work

    # -- collectives ------------------------------------------------------------
    def all_reduce(self, buf, op: ReduceOp, async_op: bool) -> Work:
        MPI, comm, mop = load_mpi(), self.comm, mpi_op(op, buf.dtype)
        wide = widened_for_mpi(buf.dtype, op)
        if wide is not None:  # mpi_work's note on uint8 sums
            return self._widened(MPIBackend.all_reduce, (buf, op, async_op), wide, (0,), (0,))
        if is_cupy_array(buf):
            if self._staged(buf) or host_only_op(op, buf.dtype):
                return self._on_host(MPIBackend.all_reduce, (buf, op, async_op), (0,), (0,))
        elif not async_op and buf.size <= settings.max_message_elements:
            # The common case, kept short: small messages are dominated by
            # per-call overhead.
            try:
                comm.Allreduce(MPI.IN_PLACE, [buf, mpi_datatype(buf.dtype)], mop)
            except MPI.Exception as exc:
                raise_failure(comm, exc)
            return CompletedWork()
        flat = self._flat(buf)
        plan = ChunkPlan(comm)
        for a, b in chunk_bounds(flat.size, self._limit()):
            spec = self._spec(flat, a, b)
            plan.add(lambda s=spec: comm.Allreduce(MPI.IN_PLACE, s, mop),
                     lambda s=spec: comm.Iallreduce(MPI.IN_PLACE, s, mop))
        return plan.run(async_op)

    def broadcast(self, buf, root: int, async_op: bool) -> Work:
        if self._staged(buf):
            mine = self.rank == root
            return self._on_host(MPIBackend.broadcast, (buf, root, async_op), (0,) if mine else (), () if mine else (0,))
        comm = self.comm
        flat = self._flat(buf)
        plan = ChunkPlan(comm)
        for a, b in chunk_bounds(flat.size, self._limit()):
            spec = self._spec(flat, a, b)
            plan.add(lambda s=spec: comm.Bcast(s, root), lambda s=spec: comm.Ibcast(s, root))
        return plan.run(async_op)

    def all_gather(self, send, recv, async_op: bool) -> Work:
        if self._staged(send):
            return self._on_host(MPIBackend.all_gather, (send, recv, async_op), (0,), (1,))
        comm, size = self.comm, self.size
        sflat = self._flat(send)
        rows = self._flat(recv).reshape(size, sflat.size)
        plan = ChunkPlan(comm)
        limit = self._limit(size)
        if sflat.size <= limit:
            s, r = self._spec(sflat, 0, sflat.size), [rows, sflat.size, mpi_datatype(sflat.dtype)]
            plan.add(lambda: comm.Allgather(s, r), lambda: comm.Iallgather(s, r))
        else:
            for a, b in chunk_bounds(sflat.size, limit):
                tmp = array_module(sflat).empty((size, b - a), dtype=sflat.dtype)
                s, r = self._spec(sflat, a, b), [tmp, b - a, mpi_datatype(sflat.dtype)]
                plan.add(lambda s=s, r=r: comm.Allgather(s, r), lambda s=s, r=r: comm.Iallgather(s, r),
                         lambda a=a, b=b, tmp=tmp: rows.__setitem__((slice(None), slice(a, b)), tmp))
        return plan.run(async_op, recv)

    def reduce_scatter(self, send, recv, op: ReduceOp, async_op: bool) -> Work:
        wide = widened_for_mpi(send.dtype, op)
        if wide is not None:  # mpi_work's note on uint8 sums
            return self._widened(MPIBackend.reduce_scatter, (send, recv, op, async_op), wide, (0,), (1,))
        if self._staged(send) or (is_cupy_array(send) and host_only_op(op, send.dtype)):
            return self._on_host(MPIBackend.reduce_scatter, (send, recv, op, async_op), (0,), (1,))
        comm, size, mop = self.comm, self.size, mpi_op(op, send.dtype)
        rflat = self._flat(recv)
        rows = self._flat(send).reshape(size, rflat.size)
        plan = ChunkPlan(comm)
        limit = self._limit(size)
        T = mpi_datatype(rflat.dtype)
        if rflat.size <= limit:
            s, r = [rows, rflat.size, T], self._spec(rflat, 0, rflat.size)
            plan.add(lambda: comm.Reduce_scatter_block(s, r, mop), lambda: comm.Ireduce_scatter_block(s, r, mop))
        else:
            for a, b in chunk_bounds(rflat.size, limit):
                tmp = array_module(rows).ascontiguousarray(rows[:, a:b])
                s, r = [tmp, b - a, T], self._spec(rflat, a, b)
                plan.add(lambda s=s, r=r: comm.Reduce_scatter_block(s, r, mop),
                         lambda s=s, r=r: comm.Ireduce_scatter_block(s, r, mop))
        return plan.run(async_op, recv)

    def gather(self, send, recv, root: int, async_op: bool) -> Work:
        if self._staged(send):
            return self._on_host(MPIBackend.gather, (send, recv, root, async_op), (0,), (1,))
        comm, size = self.comm, self.size
        sflat = self._flat(send)
        is_root = self.rank == root
        rows = self._flat(recv).reshape(size, sflat.size) if is_root else None
        T = mpi_datatype(sflat.dtype)
        plan = ChunkPlan(comm)
        limit = self._limit(size)
        if sflat.size <= limit:
            s, r = self._spec(sflat, 0, sflat.size), ([rows, sflat.size, T] if is_root else None)
            plan.add(lambda: comm.Gather(s, r, root), lambda: comm.Igather(s, r, root))
        else:
            for a, b in chunk_bounds(sflat.size, limit):
                tmp = array_module(sflat).empty((size, b - a), dtype=sflat.dtype) if is_root else None
                s, r = self._spec(sflat, a, b), ([tmp, b - a, T] if is_root else None)
                after = (lambda a=a, b=b, tmp=tmp: rows.__setitem__((slice(None), slice(a, b)), tmp)) if is_root else None
                plan.add(lambda s=s, r=r: comm.Gather(s, r, root), lambda s=s, r=r: comm.Igather(s, r, root), after)
        return plan.run(async_op, recv)

    def scatter(self, send, recv, root: int, async_op: bool) -> Work:
        if self._staged(recv):
            return self._on_host(MPIBackend.scatter, (send, recv, root, async_op), (0,), (1,))
        comm, size = self.comm, self.size
        rflat = self._flat(recv)
        is_root = self.rank == root
        rows = self._flat(send).reshape(size, rflat.size) if is_root else None
        T = mpi_datatype(rflat.dtype)
        plan = ChunkPlan(comm)
        limit = self._limit(size)
        if rflat.size <= limit:
            s, r = ([rows, rflat.size, T] if is_root else None), self._spec(rflat, 0, rflat.size)
            plan.add(lambda: comm.Scatter(s, r, root), lambda: comm.Iscatter(s, r, root))
        else:
            for a, b in chunk_bounds(rflat.size, limit):
                s = [array_module(rows).ascontiguousarray(rows[:, a:b]), b - a, T] if is_root else None
                r = self._spec(rflat, a, b)
                plan.add(lambda s=s, r=r: comm.Scatter(s, r, root), lambda s=s, r=r: comm.Iscatter(s, r, root))
        return plan.run(async_op, recv)

    def barrier(self, async_op: bool) -> Work:
        comm = self.comm
        plan = ChunkPlan(comm)
        plan.add(comm.Barrier, comm.Ibarrier)
        return plan.run(async_op)

    # -- point to point -----------------------------------------------------------
    def send(self, buf, dst: int, tag: int, async_op: bool) -> Work:
        comm = self.comm
        if async_op and type(buf) is np.ndarray and buf.size <= settings.max_message_elements:  # one message
            spec, wire = [buf, mpi_datatype(buf.dtype)], wire_tag(comm, tag, buf.dtype)
            return MPIWork([(lambda: comm.Isend(spec, dst, wire), None)], None, sequential=False, comm=comm)
        if self._staged(buf):
            return self._on_host(MPIBackend.send, (buf, dst, tag, async_op), (0,), ())
        flat = self._flat(buf)
        wire = wire_tag(comm, tag, flat.dtype)  # [Note: the dtype in the tag]
        plan = ChunkPlan(comm)
        for a, b in chunk_bounds(flat.size, self._limit()):
            spec = self._spec(flat, a, b)
            plan.add(lambda s=spec: comm.Send(s, dst, wire), lambda s=spec: comm.Isend(s, dst, wire))
        return plan.run(async_op, sequential=False)

    def recv(self, buf, src: int, tag: int, async_op: bool) -> Work:
        """Receive into ``buf``; see the note of ``_MatchedReceive`` for how sizes are checked."""
        comm = self.comm
        if async_op and type(buf) is np.ndarray and buf.size <= settings.max_message_elements:  # one message
            spec, wire, blocks = [buf, mpi_datatype(buf.dtype)], wire_tag(comm, tag, buf.dtype), [(0, buf.size)]
            steps = [(lambda: comm.Irecv(spec, src, wire), None)]
        else:
            if self._staged(buf):
                return self._on_host(MPIBackend.recv, (buf, src, tag, async_op), (), (0,))
            flat = self._flat(buf)
            blocks = list(chunk_bounds(flat.size, self._limit()))
            if not async_op:
                return _MatchedReceive(self, buf, flat, blocks, src, tag).run_blocking()
            wire = wire_tag(comm, tag, flat.dtype)
            steps = [(lambda s=self._spec(flat, a, b): comm.Irecv(s, src, wire), None) for a, b in blocks]
        return _PostedReceive(steps, buf, self._size_problem, (buf, blocks, src, tag), comm, Looker(comm, src, wire),
                              lambda: self.describe_receive(src, tag))

    def recv_now(self, buf, src: int, tag: int, nonblocking: bool) -> Work:
        """A receive whose caller waits for it at once (a blocking ``recv`` under a timeout).

        Each message is matched (``Improbe``) and its size checked before it is received.
        """
        if self._staged(buf):
            return self._on_host(MPIBackend.recv_now, (buf, src, tag, nonblocking), (), (0,))
        flat = self._flat(buf)
        receive = _MatchedReceive(self, buf, flat, list(chunk_bounds(flat.size, self._limit())), src, tag)
        return receive if nonblocking else receive.run_blocking()

    def largest_tag(self) -> int:
        return largest_tag(self.comm)  # [Note: the dtype in the tag]

    def send_plain(self, buf, dst: int, tag: int) -> bool:
        """A blocking send of a numpy array in one message (``Backend.send_plain``): one ``MPI_Send``."""
        if buf.size > settings.max_message_elements:
            return False
        MPI, comm = load_mpi(), self.comm
        wire = wire_tag(comm, tag, buf.dtype)  # [Note: the dtype in the tag]
        try:
            comm.Send([buf, mpi_datatype(buf.dtype)], dst, wire)
        except MPI.Exception as exc:
            raise_failure(comm, exc)
        return True

    def recv_plain(self, buf, src: int, tag: int) -> bool:
        """A blocking receive of one message into a numpy array (``Backend.recv_plain``), size and dtype checked
        as ``recv_now`` checks them."""
        if buf.size > settings.max_message_elements:
            return False
        MPI, comm = load_mpi(), self.comm
        try:
            _receive(self, buf, buf.reshape(-1), 0, buf.size, src, tag, wire_tag(comm, tag, buf.dtype), None)
        except MPI.Exception as exc:
            raise_failure(comm, exc)
        return True

    def describe_receive(self, src: int, tag: int) -> str:
        """How errors name a receive: ``recv from rank 2 tag 5`` (the source's world rank, the user's tag)."""
        return f"recv from rank {self.global_ranks[src]} tag {tag}"

    def _size_problem(self, buf, src: int, tag: int, got_bytes: Optional[int], want: int, larger: bool = False,
                      chunk: Optional[Tuple[int, int]] = None) -> ShapeError:
        """The error of a message whose size differs from the receive buffer's (both sizes named)."""
        itemsize = buf.dtype.itemsize
        where = "" if chunk is None else f" (chunk [{chunk[0]}, {chunk[1]}) of the buffer)"
        buffer = (f"the receive buffer{where} of {want} elements of {buf.dtype} ({want * itemsize} bytes; buffer "
                  f"shape {tuple(buf.shape)})")
        if larger:
            said = (f"the incoming message is larger than {buffer}, so MPI cut it off (a posted irecv cannot tell "
                    f"the message's full size; a blocking recv names it)")
        else:
            elements = f" = {got_bytes // itemsize} elements of {buf.dtype}" if got_bytes % itemsize == 0 else ""
            said = f"the incoming message holds {got_bytes} bytes{elements}, but {buffer}"
        return ShapeError(f"{self.describe_receive(src, tag)}: {said}; the message was received and dropped")

    # -- communicators ------------------------------------------------------------
    def announce(self, seq: int, op: str) -> "Arrivals":
        """Tell every peer this rank entered collective ``seq`` (``op``); see ``Arrivals``."""
        return Arrivals(self._side, seq, op, self.rank, self.global_ranks, self._silent)

    def split(self, color: Optional[int], key: int) -> Optional["MPIBackend"]:
        MPI = load_mpi()
        new = new_communicator(lambda: self.comm.Split(MPI.UNDEFINED if color is None else int(color), int(key)),
                               "a split group")
        return None if new == MPI.COMM_NULL else MPIBackend(new, dup=False)

    def create_group(self, ranks: Sequence[int]) -> Optional["MPIBackend"]:
        MPI = load_mpi()
        parent = self.comm.Get_group()
        group = parent.Incl(list(ranks))
        try:
            new = new_communicator(lambda: self.comm.Create(group), f"group {list(ranks)}")
        finally:
            group.Free()
        parent.Free()
        return None if new == MPI.COMM_NULL else MPIBackend(new, dup=False)

    def node_layout(self, local_key: Optional[int] = None) -> Tuple[int, int, int, int]:
        """(local_rank, local_size, node_rank, num_nodes); ``local_key`` orders a node's ranks as the launcher numbers them."""
        if self._layout is None:
            MPI = load_mpi()
            key = self.rank if local_key is None else int(local_key)
            local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
            local_rank, local_size = local.Get_rank(), local.Get_size()
            leaders = self.comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, self.rank)
            facts = np.zeros(2, dtype=np.int64)
            if leaders != MPI.COMM_NULL:
                facts[:] = (leaders.Get_rank(), leaders.Get_size())
                leaders.Free()
            local.Bcast([facts, MPI.INT64_T], root=0)
            local.Free()
            self._layout = (local_rank, local_size, int(facts[0]), int(facts[1]))
        return self._layout

    def abort(self, code: int = 1) -> None:
        load_mpi().COMM_WORLD.Abort(code)

    def free(self) -> None:
        MPI = load_mpi()
        if MPI.Is_finalized():
            return
        if getattr(self, "_side", None) is not None:
            self._side.Free()
            self._side = None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


__all__ = ["MPIBackend", "MPIWork", "pinned_staging"]
