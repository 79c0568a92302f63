"""The backend interface: what a communication library must provide.

[Note: backend contract]
The collective layer has already checked every buffer and turned ``AVG`` into ``SUM`` and 16-bit
reductions into float32 ones, so a backend sees only SUM/PRODUCT/MIN/MAX on float32/64, int32/64 and
uint8. With ``async_op=False`` a backend should complete before returning (MPI's blocking calls are
faster than their nonblocking twins).
"""
from __future__ import annotations

import abc
import enum
import math
import numbers
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._choices import parse_choice
from ..errors import ArgumentTypeError, InvalidArgumentError


class ReduceOp(enum.Enum):
    """Reduction operations of ``all_reduce`` and ``reduce_scatter``; ``AVG`` on integers floors (``[1, 2]`` -> ``1``)."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    @classmethod
    def parse(cls, op: Any) -> "ReduceOp":
        """Accept a ReduceOp or its name in any case ("sum", "AVG"); "mean" and "average" are AVG, "prod" PRODUCT.

        A name is looked up once (``parse_choice`` walks the enum: 20 us a call, more than a small all-reduce);
        the spellings seen are kept.

        Raises:
            UnknownChoiceError: ``op`` names no reduce op (an ``InvalidArgumentError``).
        """
        if type(op) is cls:
            return op
        found = REDUCE_OP_NAMES.get(op) if type(op) is str else None
        if found is None:
            found = parse_choice(cls, op, "reduce op", _OP_ALIASES)
            if type(op) is str and len(REDUCE_OP_NAMES) < 256:
                REDUCE_OP_NAMES[op] = found
        return found


_OP_ALIASES = {"mean": "AVG", "average": "AVG", "prod": "PRODUCT"}  # spellings users already type
REDUCE_OP_NAMES: Dict[str, ReduceOp] = {}  # the names ReduceOp.parse has been given, as typed


# (enter(work) -> key or None, leave(key)): the collectives' watchdog notes the waits, which may block for good.
WAIT_OBSERVER: Optional[Tuple[Callable[["Work"], Any], Callable[[Any], None]]] = None
# While asynchronous calls wait unissued for their check, the collective layer's hook that issues those whose
# check is done (``collectives.agreement.progress``); a wait then polls and calls it each round instead of
# blocking inside MPI. None otherwise.
PROGRESS: List[Optional[Callable[[], None]]] = [None]


class Work:
    """Handle of an operation that may still be running; ``wait()`` returns its output array or None."""

    # What ``wait()`` with no timeout waits at most: the collective layer sets its group's timeout on the Work
    # of a call (``pg.timeout``, ``AXONHPC_TIMEOUT``); None waits forever.
    default_timeout: Optional[float] = None
    # The collective layer's error for a wait that timed out (naming the missing ranks where it can tell).
    explain_timeout: Optional[Callable[[float], Exception]] = None

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
            progress = PROGRESS[0]
            if progress is not None:
                progress()
                if self._test():
                    break
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
        """Run ``callback()`` once the transfer is complete, before ``wait`` returns (at once if already done)."""
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

        ``timeout``: seconds; None takes the group's timeout for the Work of a collective or message (the
        ``timeout`` a blocking call would wait), forever where the group has none; ``math.inf`` waits forever.

        Raises:
            CollectiveTimeoutError: not complete within the timeout.
            InvalidArgumentError: a negative or NaN ``timeout``; ArgumentTypeError: one that is not a number.
        """
        if timeout is not None:
            timeout = _wait_timeout(timeout)
        if not self._finished:
            if timeout is None:
                timeout = self.default_timeout
            elif timeout == math.inf:
                timeout = None
            observer = WAIT_OBSERVER
            key = observer[0](self) if observer is not None else None
            try:
                if not self._block(timeout):
                    explain = self.explain_timeout
                    if explain is None:
                        raise self._timeout_error(timeout)
                    raise explain(timeout)
            finally:
                if key is not None:
                    observer[1](key)
            self._finish()
        return self._result

    def result(self) -> Any:
        """Same as ``wait()``."""
        return self.wait()


def _wait_timeout(timeout: Any) -> float:
    """``Work.wait``'s ``timeout`` checked: a number of seconds, 0 or more (``math.inf``: forever)."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ArgumentTypeError(f"wait(timeout={timeout!r}): the timeout is a number of seconds (math.inf waits "
                                f"forever, None the group's timeout), got {type(timeout).__name__}")
    if not timeout >= 0:  # NaN too: a NaN deadline is never reached
        shown = timeout if type(timeout) in (int, float) else float(timeout)  # np.float64(nan) as nan
        raise InvalidArgumentError(f"wait(timeout={shown!r}): the timeout must be 0 or more seconds (math.inf "
                                   f"waits forever, None the group's timeout)")
    return float(timeout)


class CompletedWork(Work):
    """A Work whose transfer finished before it was returned."""


class Backend(abc.ABC):
    """One communicator of one backend library; ``global_ranks``: the world rank of each communicator rank."""

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
        """``recv`` of rank i becomes the reduction of part i (along the first axis) of every ``send``."""

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
        """A receive its caller waits for at once; a backend may check more here (MPI compares the size first)."""
        return self.recv(buf, src, tag, nonblocking)

    def issue_queued(self) -> None:
        """Issue what this backend queued to issue later (NCCL's non-blocking sends and receives); most queue nothing."""

    def send_plain(self, buf, dst: int, tag: int) -> bool:
        """Send the C-contiguous numpy array ``buf`` the short way and return True, or return False having sent
        nothing (this backend or this size takes the general path, ``send``). The fast path of ``ax.send``."""
        return False

    def recv_plain(self, buf, src: int, tag: int) -> bool:
        """``send_plain``'s receive: fill ``buf`` and return True (checked as ``recv_now`` checks), or return False
        having received nothing."""
        return False

    # communicators ----------------------------------------------------------
    @abc.abstractmethod
    def split(self, color: Optional[int], key: int) -> Optional["Backend"]:
        """Collective: a new backend per color; None where ``color`` is None."""

    @abc.abstractmethod
    def create_group(self, ranks: Sequence[int]) -> Optional["Backend"]:
        """Collective: a backend over these communicator ranks, in this order; None for non-members."""

    def host_side(self) -> "Backend":
        """The backend that carries this group's host (numpy) messages: this one."""
        return self

    def stages(self, buf) -> bool:
        """Whether this backend moves ``buf`` through host copies (so large blocking all-reduces are chunked)."""
        return False

    def largest_tag(self) -> int:
        """The largest tag ``send`` and ``recv`` carry here (MPI's depends on its ``MPI_TAG_UB``)."""
        return 2 ** 31 - 1

    def captures(self, buf) -> bool:
        """Whether a collective on ``buf`` can be captured in a CUDA graph: only stream-issued calls (NCCL), not MPI."""
        return False

    def reducer(self, buf: np.ndarray, op: "ReduceOp", nonblocking: bool = False) -> Callable[[], None]:
        """A blocking call that replaces ``buf`` (small, host) by its ``op`` over the ranks, made once per buffer.

        The agreement check's cost is its latency, so a backend may return something quicker than ``all_reduce``.
        ``nonblocking``: the collective is made as a nonblocking one, then waited for (it must meet the calls of
        ``all_reduce(buf, op, True)`` on other ranks).
        """
        return lambda: self.all_reduce(buf, op, nonblocking).wait()

    def announce(self, seq: int, op: str) -> Optional[Any]:
        """Tell every peer this rank entered collective ``seq``; an object the wait asks for arrivals, or None.

        With it a timeout names the ranks that never came (``backends.mpi_arrivals.Arrivals``).
        """
        return None

    def node_layout(self, local_key: Optional[int] = None) -> Tuple[int, int, int, int]:
        """(local_rank, local_size, node_rank, num_nodes); ``local_key`` orders a node's ranks (None: by rank)."""
        return self.rank, self.size, 0, 1

    def abort(self, code: int = 1) -> None:
        """End the whole job (every rank of every communicator)."""
        raise SystemExit(code)

    def free(self) -> None:
        """Release the communicator (no collective may follow)."""


__all__ = ["ReduceOp", "Work", "CompletedWork", "Backend"]
