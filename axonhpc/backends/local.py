"""In-process backend: ranks are threads of one process, data really moves.

[Note: local backend]
The k-th collective of every rank lands in slot k of a shared ``_Hub``; the last to arrive computes
the result for all (in rank order, so results are deterministic). Calls never block before
completion is needed, so ``async_op=True`` behaves as with MPI. Sends are buffered; receives block.
Mismatched collectives raise ``CollectiveMismatchError`` on every rank, and ``abort()`` (or a dying
``run_local`` thread) wakes every waiting rank with an error, so a test can fail but never hang.
"""
from __future__ import annotations

import collections
import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, InvalidArgumentError, LocalAbort, ShapeError
from .base import PROGRESS, Backend, CompletedWork, ReduceOp, Work
from .folding import fold

_POLL = 0.05  # seconds between checks of the abort flag while waiting


class _Hub:
    """State shared by all ranks of one local world (and its subgroups)."""

    _ids = itertools.count()

    def __init__(self):
        self.lock = threading.Condition()
        self.aborted: Optional[str] = None
        self.comms: Dict[Any, "_Comm"] = {}

    def abort(self, reason: str) -> None:
        with self.lock:
            if self.aborted is None:
                self.aborted = reason
            self.lock.notify_all()

    def comm(self, key: Any, global_ranks: Tuple[int, ...]) -> "_Comm":
        with self.lock:
            if key not in self.comms:
                self.comms[key] = _Comm(self, global_ranks, next(self._ids))
                self.comms[key].key = key
            return self.comms[key]


class _Slot:
    """The k-th collective of one communicator."""

    def __init__(self, size: int):
        self.entries: Dict[int, Tuple[str, Tuple, Callable]] = {}
        self.done = False
        self.error: Optional[BaseException] = None
        self.size = size


class _Comm:
    """One communicator: collective slots and point-to-point mailboxes."""

    def __init__(self, hub: _Hub, global_ranks: Tuple[int, ...], ident: int):
        self.hub = hub
        self.global_ranks = global_ranks
        self.ident = ident
        self.size = len(global_ranks)
        self.key: Any = None  # its entry in the hub's table (``LocalBackend.free`` removes it)
        self.slots: Dict[int, _Slot] = {}
        self.mail: Dict[Tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)

    def wait_for(self, ready: Callable[[], bool], timeout: Optional[float]) -> bool:
        """Wait under the hub lock until ``ready()``; False on timeout."""
        lock = self.hub.lock
        remaining = timeout
        while not ready():
            if self.hub.aborted is not None:
                raise LocalAbort(f"local world aborted: {self.hub.aborted}")
            if remaining is not None and remaining <= 0:
                return False
            step = _POLL if remaining is None else min(_POLL, remaining)
            lock.wait(step)
            if remaining is not None:
                remaining -= step
        return True


class _LocalWork(Work):
    def __init__(self, comm: _Comm, ready: Callable[[], bool], describe: Callable[[], str], result=None):
        super().__init__(result)
        self._comm = comm
        self._ready = ready
        self._describe = describe

    def started(self, async_op: bool) -> "_LocalWork":
        """Self, after waiting for completion unless the caller asked for ``async_op``."""
        if not async_op:
            self.wait()
        return self

    def _test(self) -> bool:
        with self._comm.hub.lock:
            if self._comm.hub.aborted is not None:
                raise LocalAbort(f"local world aborted: {self._comm.hub.aborted}")
            return self._ready()

    def _block(self, timeout: Optional[float]) -> bool:
        if PROGRESS[0] is not None:  # polled: calls waiting for their check (collectives.agreement) may be ready
            return super()._block(timeout)
        with self._comm.hub.lock:
            return self._comm.wait_for(self._ready, timeout)

    def _timeout_error(self, timeout: float) -> Exception:
        return CollectiveTimeoutError(f"{self.label} timed out after {timeout:g} s: {self._describe()}")


class LocalBackend(Backend):
    """One rank of an in-process world (see the module note)."""

    name = "local"

    def __init__(self, comm: _Comm, rank: int):
        self._comm = comm
        self.rank = rank
        self.size = comm.size
        self.global_ranks = comm.global_ranks
        self._seq = 0
        self._groups_made = 0

    @classmethod
    def create_world(cls, n: int) -> List["LocalBackend"]:
        """n backends of one new world, one per thread that will use it."""
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise InvalidArgumentError(f"a local world needs at least one rank, got {n!r}")
        hub = _Hub()
        comm = hub.comm(("world",), tuple(range(int(n))))
        return [cls(comm, r) for r in range(int(n))]

    # -- collective machinery -------------------------------------------
    def _collective(self, kind: str, signature: Tuple, args: Tuple, compute: Callable, async_op: bool,
                    result=None) -> Work:
        """Enter slot ``seq``; the last rank to arrive runs ``compute(entries)``."""
        comm = self._comm
        seq = self._seq
        self._seq += 1
        with comm.hub.lock:
            if comm.hub.aborted is not None:
                raise LocalAbort(f"local world aborted: {comm.hub.aborted}")
            slot = comm.slots.setdefault(seq, _Slot(comm.size))
            slot.entries[self.rank] = (kind, signature, args)
            if len(slot.entries) == comm.size:
                self._complete(seq, slot, compute)
                comm.hub.lock.notify_all()

        def ready() -> bool:
            if slot.done and slot.error is not None:
                raise slot.error
            return slot.done

        def describe() -> str:
            arrived = sorted(comm.global_ranks[r] for r in slot.entries)
            missing = [g for g in comm.global_ranks if g not in arrived]
            return (f"{kind} #{seq} on local group {list(comm.global_ranks)} (rank {comm.global_ranks[self.rank]}); "
                    f"arrived ranks: {arrived}; missing ranks: {missing}")

        return _LocalWork(comm, ready, describe, result).started(async_op)

    def _complete(self, seq: int, slot: _Slot, compute: Callable) -> None:
        entries = [slot.entries[r] for r in range(slot.size)]
        kinds = {(e[0], e[1]) for e in entries}
        try:
            if len(kinds) != 1:
                lines = ", ".join(
                    f"rank {self.global_ranks[r]} called {e[0]} {' '.join(map(str, e[1]))}".rstrip()
                    for r, e in enumerate(entries)
                )
                raise CollectiveMismatchError(f"ranks disagree on the collective: {lines}")
            compute([e[2] for e in entries])
        except BaseException as exc:  # delivered to every rank of the slot
            slot.error = exc
        slot.done = True
        del self._comm.slots[seq]

    # -- collectives ------------------------------------------------------
    def all_reduce(self, buf, op: ReduceOp, async_op: bool) -> Work:
        def compute(args):
            total = args[0][0].copy()
            for (other,) in args[1:]:
                fold(op, total, other)  # float MIN/MAX: folding's note
            for (b,) in args:
                b[...] = total

        return self._collective("all_reduce", (buf.dtype, buf.shape, op.name), (buf,), compute, async_op)

    def broadcast(self, buf, root: int, async_op: bool) -> Work:
        def compute(args):
            src = args[root][0].copy()
            for i, (b,) in enumerate(args):
                if i != root:  # the root's buffer is only read (it may be read-only, as with MPI_Bcast)
                    b[...] = src

        return self._collective("broadcast", (buf.dtype, buf.shape, f"root={root}"), (buf,), compute, async_op)

    def all_gather(self, send, recv, async_op: bool) -> Work:
        def compute(args):
            parts = [s.copy() for s, _ in args]
            for _, r in args:
                for i, p in enumerate(parts):
                    r[i] = p

        return self._collective("all_gather", (send.dtype, send.shape), (send, recv), compute, async_op, recv)

    def reduce_scatter(self, send, recv, op: ReduceOp, async_op: bool) -> Work:
        n = self.size

        def compute(args):
            total = args[0][0].copy()
            for s, _ in args[1:]:
                fold(op, total, s)
            # explicit part length: with a zero in the trailing dimensions, -1 would be ambiguous
            parts = total.reshape((n, total.shape[0] // n) + total.shape[1:]) if total.ndim else total
            for i, (_, r) in enumerate(args):
                r[...] = parts[i].reshape(r.shape)

        return self._collective("reduce_scatter", (send.dtype, send.shape, op.name), (send, recv), compute,
                                async_op, recv)

    def gather(self, send, recv, root: int, async_op: bool) -> Work:
        def compute(args):
            out = args[root][1]
            for i, (s, _) in enumerate(args):
                out[i] = s

        return self._collective("gather", (send.dtype, send.shape, f"root={root}"), (send, recv), compute,
                                async_op, recv)

    def scatter(self, send, recv, root: int, async_op: bool) -> Work:
        def compute(args):
            src = args[root][0]
            if src.shape[1:] != args[0][1].shape:
                raise ShapeError(f"scatter: root sends parts of shape {src.shape[1:]}, "
                                 f"receivers expect {args[0][1].shape}")
            for i, (_, r) in enumerate(args):
                r[...] = src[i]

        return self._collective("scatter", (recv.dtype, recv.shape, f"root={root}"), (send, recv), compute,
                                async_op, recv)

    def barrier(self, async_op: bool) -> Work:
        return self._collective("barrier", (), (), lambda args: None, async_op)

    # -- point to point -----------------------------------------------------
    def send(self, buf, dst: int, tag: int, async_op: bool) -> Work:
        comm = self._comm
        with comm.hub.lock:
            comm.mail[(self.rank, dst, tag)].append(buf.copy())
            comm.hub.lock.notify_all()
        return CompletedWork()

    def recv(self, buf, src: int, tag: int, async_op: bool) -> Work:
        comm = self._comm
        with comm.hub.lock:  # made under the lock the sender takes: a mailbox made twice at once loses a message
            box = comm.mail[(src, self.rank, tag)]
        state = {"taken": False}

        def ready() -> bool:
            if state["taken"]:
                return True
            if not box:
                return False
            msg = box.popleft()
            if msg.size != buf.size or msg.dtype != buf.dtype:
                raise ShapeError(f"recv from rank {comm.global_ranks[src]} tag {tag}: the incoming message is "
                                 f"{msg.size} elements of {msg.dtype} {msg.shape} ({msg.nbytes} bytes), but the "
                                 f"receive buffer is {buf.size} elements of {buf.dtype} {buf.shape} ({buf.nbytes} "
                                 f"bytes); the message was received and dropped")
            buf[...] = msg.reshape(buf.shape)
            state["taken"] = True
            return True

        def describe() -> str:
            return (f"recv from rank {comm.global_ranks[src]} (tag {tag}) on rank {comm.global_ranks[self.rank]}; "
                    f"missing ranks: [{comm.global_ranks[src]}]")

        return _LocalWork(comm, ready, describe, buf).started(async_op)

    # -- communicators --------------------------------------------------------
    def split(self, color: Optional[int], key: int) -> Optional["LocalBackend"]:
        table = np.zeros((self.size, 3), dtype=np.int64)
        mine = np.array([0 if color is None else 1, 0 if color is None else color, key], dtype=np.int64)
        self.all_gather(mine, table, async_op=False)
        tag = self._groups_made
        self._groups_made += 1
        if color is None:
            return None
        members = sorted((int(k), r) for r, (has, c, k) in enumerate(table) if has and c == color)
        ranks = [r for _, r in members]
        return self._subgroup(("split", self._comm.ident, tag, int(color)), ranks)

    def create_group(self, ranks: Sequence[int]) -> Optional["LocalBackend"]:
        tag = self._groups_made
        self._groups_made += 1
        # Every rank of the parent takes part, as with MPI_Comm_create.
        self.barrier(async_op=False)
        if self.rank not in ranks:
            return None
        return self._subgroup(("group", self._comm.ident, tag, tuple(ranks)), list(ranks))

    def _subgroup(self, key, ranks: List[int]) -> "LocalBackend":
        comm = self._comm.hub.comm(key, tuple(self._comm.global_ranks[r] for r in ranks))
        return LocalBackend(comm, ranks.index(self.rank))

    def free(self) -> None:
        """Forget this communicator in the world's table (the ranks that hold it finish what they started on it)."""
        comm = self._comm
        with comm.hub.lock:
            if comm.hub.comms.get(comm.key) is comm:
                del comm.hub.comms[comm.key]

    def abort(self, code: int = 1) -> None:
        self._comm.hub.abort(f"rank {self.global_ranks[self.rank]} called abort({code})")
        raise LocalAbort(f"rank {self.global_ranks[self.rank]} aborted the local world with code {code}")

    def abort_quietly(self, reason: str) -> None:
        """Wake every waiting rank with an error (used when a thread dies)."""
        self._comm.hub.abort(reason)


__all__ = ["LocalBackend", "LocalAbort"]
