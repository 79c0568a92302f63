"""The backend interface: what a communication library must provide.

[Note: backend contract]
A backend moves data for one communicator: ``rank`` of ``size``. The layer
above (``axonhpc.collectives``) has already checked every buffer (dtype,
contiguity, shapes, ranks) and has already turned the operations no library
does natively into ones they do: ``ReduceOp.AVG`` arrives here as ``SUM``
(the division happens after completion) and float16/bfloat16 reductions
arrive widened to float32. So a backend sees only SUM/PRODUCT/MIN/MAX on
float32/64, int32/64 and uint8, plus plain data movement of any supported
dtype. Every operation returns a ``Work``; with ``async_op=False`` a backend
may complete the call before returning (and MPI's blocking calls are faster
than their nonblocking twins, so it should).
"""
from __future__ import annotations

import abc
import enum
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._choices import parse_choice


class ReduceOp(enum.Enum):
    """Reduction operations of ``all_reduce`` and ``reduce_scatter``.

    ``AVG`` is the sum divided by the group size. On integer dtypes it is the
    floor of that quotient (numpy's ``//``), so ``[1, 2]`` averages to ``1``.
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    @classmethod
    def parse(cls, op: Any) -> "ReduceOp":
        """Accept a ReduceOp or its name in any case ("sum", "AVG"); "mean" and "average" are AVG, "prod" PRODUCT.

        Raises:
            UnknownChoiceError: ``op`` names no reduce op (an ``InvalidArgumentError``).
        """
        return parse_choice(cls, op, "reduce op", _OP_ALIASES)


_OP_ALIASES = {"mean": "AVG", "average": "AVG", "prod": "PRODUCT"}  # spellings users already type


# (enter(work) -> key or None, leave(key)): the collectives' watchdog notes the waits, which may block for good.
WAIT_OBSERVER: Optional[Tuple[Callable[["Work"], Any], Callable[[Any], None]]] = None


class Work:
    """Handle of an operation that may still be running.

    ``wait()`` blocks until it is done (or raises ``CollectiveTimeoutError``
    after ``timeout`` seconds) and returns its result: the output array of
    operations that produce one, otherwise None.
    """

    def __init__(self, result: Any = None):
        self._result = result
        self._callbacks: List[Callable[[], None]] = []
        self._finished = False
        self.label = "operation"  # what the collective layer calls it in messages

    # -- subclass hooks -----------------------------------------------------
    def _test(self) -> bool:
        """True once the underlying transfer is complete (non-blocking)."""
        return True

    def _block(self, timeout: Optional[float]) -> bool:
        """Wait for completion; False if ``timeout`` expired first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while not self._test():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            # Back off so that a rank waiting on an oversubscribed node
            # leaves the core to the rank it is waiting for.
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def _timeout_error(self, timeout: float) -> Exception:
        from ..errors import CollectiveTimeoutError

        return CollectiveTimeoutError(
            f"{self.label} timed out after {timeout:g} s; missing ranks: unknown "
            "(this backend cannot tell which ranks never arrived)"
        )

    # -- public API ---------------------------------------------------------
    def then(self, callback: Callable[[], None]) -> "Work":
        """Run ``callback()`` once the transfer is complete, before ``wait`` returns.

        On a Work that has already finished the callback runs at once.
        """
        if self._finished:
            callback()
        else:
            self._callbacks.append(callback)
        return self

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            for callback in self._callbacks:
                callback()

    def is_completed(self) -> bool:
        """True if the operation has finished (finishing it if it just did)."""
        if self._finished:
            return True
        if self._test():
            self._finish()
            return True
        return False

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the result (an array, or None).

        Args:
            timeout: seconds to wait at most; None waits forever.

        Raises:
            CollectiveTimeoutError: the operation did not complete in time.
        """
        if not self._finished:
            observer = WAIT_OBSERVER
            key = observer[0](self) if observer is not None else None
            try:
                if not self._block(timeout):
                    raise self._timeout_error(timeout)
            finally:
                if key is not None:
                    observer[1](key)
            self._finish()
        return self._result

    def result(self) -> Any:
        """Same as ``wait()`` with no timeout."""
        return self.wait()


class CompletedWork(Work):
    """A Work whose transfer finished before it was returned."""


class Backend(abc.ABC):
    """One communicator of one backend library.

    Attributes:
        name: "mpi", "local" or "nccl".
        rank: this process's rank in the communicator.
        size: number of ranks.
        global_ranks: world rank of each communicator rank, in order.
    """

    name: str = "abstract"
    rank: int
    size: int
    global_ranks: Tuple[int, ...]

    # collectives --------------------------------------------------------
    @abc.abstractmethod
    def all_reduce(self, buf, op: ReduceOp, async_op: bool) -> Work:
        """Reduce ``buf`` over all ranks, result in ``buf`` on every rank."""

    @abc.abstractmethod
    def broadcast(self, buf, root: int, async_op: bool) -> Work:
        """Copy ``buf`` of rank ``root`` into ``buf`` of every rank."""

    @abc.abstractmethod
    def all_gather(self, send, recv, async_op: bool) -> Work:
        """``recv[i]`` of every rank becomes ``send`` of rank i."""

    @abc.abstractmethod
    def reduce_scatter(self, send, recv, op: ReduceOp, async_op: bool) -> Work:
        """``recv`` of rank i becomes the reduction of part i of every ``send``.

        ``send`` holds ``size`` equal parts along its first axis.
        """

    @abc.abstractmethod
    def gather(self, send, recv, root: int, async_op: bool) -> Work:
        """``recv[i]`` on ``root`` becomes ``send`` of rank i (``recv`` None elsewhere)."""

    @abc.abstractmethod
    def scatter(self, send, recv, root: int, async_op: bool) -> Work:
        """``recv`` of rank i becomes ``send[i]`` of ``root`` (``send`` None elsewhere)."""

    @abc.abstractmethod
    def barrier(self, async_op: bool) -> Work:
        """Return once every rank has entered the barrier."""

    # point to point -------------------------------------------------------
    @abc.abstractmethod
    def send(self, buf, dst: int, tag: int, async_op: bool) -> Work:
        """Send ``buf`` to rank ``dst``."""

    @abc.abstractmethod
    def recv(self, buf, src: int, tag: int, async_op: bool) -> Work:
        """Fill ``buf`` with a message from rank ``src``."""

    def recv_now(self, buf, src: int, tag: int, nonblocking: bool) -> Work:
        """A receive whose caller waits for it at once (a blocking ``recv``, perhaps under a timeout).

        The same as ``recv`` unless a backend can check more before it
        receives when nothing else may happen in between (MPI matches the
        message first and compares its size with ``buf``'s).
        """
        return self.recv(buf, src, tag, nonblocking)

    # communicators ----------------------------------------------------------
    @abc.abstractmethod
    def split(self, color: Optional[int], key: int) -> Optional["Backend"]:
        """Collective: a new backend per color; None where ``color`` is None."""

    @abc.abstractmethod
    def create_group(self, ranks: Sequence[int]) -> Optional["Backend"]:
        """Collective: a backend over these communicator ranks, in this order; None for non-members."""

    def host_side(self) -> "Backend":
        """The backend that carries this group's host (numpy) messages: this one.

        A backend that sends device arrays one way and host arrays another
        (``dispatch.DeviceDispatchBackend``) returns its host side, which
        carries the checks and headers the collective layer sends as small
        numpy arrays.
        """
        return self

    def stages(self, buf) -> bool:
        """Whether this backend moves ``buf`` through host copies (a device array over an MPI that is not CUDA-aware).

        The collective layer pipelines a large blocking all-reduce of such an
        array in chunks (``collectives.staged_path``) instead of handing it
        over whole. The default: no.
        """
        return False

    def captures(self, buf) -> bool:
        """Whether a collective on ``buf`` can be captured in a CUDA graph (``axonhpc.cuda.graphs``).

        True only for a backend that issues the call on a CUDA stream and
        does no host work for it once issued (NCCL), so that a graph's
        replay repeats all of it. The default: no (MPI is driven by the host).
        """
        return False

    def reducer(self, buf: np.ndarray, op: "ReduceOp") -> Callable[[], None]:
        """A call that replaces ``buf`` (a small host array) by its element-wise ``op`` over the ranks, blocking.

        Made once per buffer by the collective layer's agreement check, which
        runs it before (or, carrying the data, instead of) a checked
        collective, so its latency is the check's whole cost: a backend may
        return something quicker than a general ``all_reduce`` (MPI: one
        ``Allreduce`` call on a prepared buffer). The default is the general
        all-reduce.
        """
        return lambda: self.all_reduce(buf, op, False).wait()

    def announce(self, seq: int, op: str) -> Optional[Any]:
        """Tell every peer that this rank entered collective ``seq`` (``op``), before a timed blocking collective.

        A backend that can report arrivals returns an object the waiting loop
        asks about them (``missing()``, ``elsewhere()``, ``drain()``,
        ``abandon()``; see ``backends.mpi_arrivals.Arrivals``), so that a timeout names
        the ranks that never came. The default reports none: it sends
        nothing and returns None, and a timeout says the missing ranks are
        unknown.
        """
        return None

    def node_layout(self, local_key: Optional[int] = None) -> Tuple[int, int, int, int]:
        """(local_rank, local_size, node_rank, num_nodes) of this rank.

        Args:
            local_key: orders the ranks of a node (the launcher's local rank,
                when it gave one); None orders them by rank.
        """
        return self.rank, self.size, 0, 1

    def abort(self, code: int = 1) -> None:
        """End the whole job (every rank of every communicator)."""
        raise SystemExit(code)

    def free(self) -> None:
        """Release the communicator (no collective may follow)."""


__all__ = ["ReduceOp", "Work", "CompletedWork", "Backend"]
