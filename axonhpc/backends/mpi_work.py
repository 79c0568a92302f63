"""How the MPI backend's operations reach MPI: mpi4py on first use, datatypes and ops, chunks, ``MPIWork``.

An operation is a ``ChunkPlan`` of chunk steps (counts are C ints), each a blocking call, its
nonblocking twin and what to do after; ``ChunkPlan.run`` makes the blocking calls or starts the
nonblocking ones under an ``MPIWork``.
"""
from __future__ import annotations

import os
import time
from threading import get_ident
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .._dtypes import bfloat16_dtype
from ..errors import replacing
from .base import PROGRESS, CompletedWork, ReduceOp, Work
from .failures import peer_failed
from .folding import min_max_kernel


_MPI = None
_DATATYPES: dict = {}
_OPS: dict = {}


def load_mpi():
    """mpi4py.MPI, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def mpi_datatype(dtype: np.dtype):
    """The MPI datatype that moves (and, for reducible dtypes, reduces) ``dtype``."""
    try:
        return _DATATYPES[dtype]
    except KeyError:
        pass
    MPI = load_mpi()
    table = {
        np.dtype(np.float32): MPI.FLOAT,
        np.dtype(np.float64): MPI.DOUBLE,
        np.dtype(np.int32): MPI.INT32_T,
        np.dtype(np.int64): MPI.INT64_T,
        np.dtype(np.uint8): MPI.UINT8_T,
        # 16-bit floats are only moved, never reduced here (the collective
        # layer widens them first), so an opaque 16-bit type is exact.
        np.dtype(np.float16): MPI.UINT16_T,
    }
    bf16 = bfloat16_dtype()
    if bf16 is not None:
        table[bf16] = MPI.UINT16_T
    _DATATYPES.update(table)
    return _DATATYPES[np.dtype(dtype)]


def mpi_op(op: ReduceOp, dtype: Optional[np.dtype] = None):
    """The MPI op that reduces ``dtype`` with ``op`` (``dtype`` None: the built-in op).

    [Note: MIN and MAX of floats over MPI]
    MPI leaves NaN in ``MPI_MIN``/``MPI_MAX`` unspecified, and the libraries differ by rank and algorithm
    (MPICH gave [40, 40, nan, 40] on 4 ranks for MAX of [10, nan, 30, 40]); nor does it say which zero
    the min of -0.0 and +0.0 is. Float MIN and MAX therefore use user ops that run the node engine's own
    element function on each piece MPI hands them (``folding.min_max_kernel``): IEEE 754-2019 minimum and
    maximum, a NaN anywhere gives NaN and -0.0 is below +0.0 ([Note: MIN and MAX of floats are IEEE
    754-2019 minimum and maximum] in ``backends.folding``). The ops used to be ``np.minimum``/``np.maximum``,
    which return the second of two zeros: MPICH's recursive doubling folds the pieces in another order on
    each rank, and the ranks of one all-reduce ended with different signs of zero. The IEEE ops are
    commutative and associative bit for bit, so they are declared commutative truthfully (a non-commutative
    op, which MPI reduces in rank order, cost 30% (MPICH) to 100% (Open MPI) more at 16 MiB), and every rank,
    order and MPI library gives the bits of the engine and the thread backend. The element function is
    compiled (one pass, no temporaries) and costs about what ``np.minimum`` did, less at 4 KiB and within
    6% at 16 MiB, where numpy's AVX-512 loop beats this build's SSE2 one: at 2 ranks, float32, in-place
    ``MPI_Allreduce`` (benchmarks/minmax_op.py, medians of 31 interleaved rounds, two runs), MPICH 5.0.2
    4 KiB built-in 4.0-5.1 us, np.minimum op 4.0-5.6 us, this op 3.2-4.3 us; 16 MiB 3.4-3.6, 4.9-5.2 and
    4.9 ms; Open MPI 5.0.11 4 KiB 2.3-4.4, 4.1-8.7 and 2.4-5.7 us; 16 MiB 3.7-4.2, 3.7-3.9 and 3.9-4.2 ms.
    Integers keep the built-in ops, and so does everything but MIN and MAX.
    """
    # Keyed by the member's string value: hashing an Enum member runs Python
    # code, hashing a str is cached, and this is on every call's path.
    if not _OPS:
        MPI = load_mpi()
        _OPS.update({ReduceOp.SUM.value: MPI.SUM, ReduceOp.PRODUCT.value: MPI.PROD,
                     ReduceOp.MIN.value: MPI.MIN, ReduceOp.MAX.value: MPI.MAX})
    if dtype is not None and host_only_op(op, dtype):
        return _float_op(op, dtype)
    return _OPS[op._value_]


_FLOAT_OPS: dict = {}


def _float_op(op: ReduceOp, dtype: np.dtype):
    """The IEEE user op for MIN or MAX of a float dtype (see the note in ``mpi_op``)."""
    key = (op._value_, dtype)
    found = _FLOAT_OPS.get(key)
    if found is None:
        found = _FLOAT_OPS[key] = load_mpi().Op.Create(min_max_kernel(op, dtype), commute=True)
    return found


def host_only_op(op: ReduceOp, dtype: np.dtype) -> bool:
    """True if ``mpi_op`` gives a user op, which runs numpy on the data: a device array must be staged."""
    return dtype.kind == "f" and (op is ReduceOp.MIN or op is ReduceOp.MAX)


# [Note: uint8 sums over MPI]
# Open MPI's AVX ops add uint8 with saturation from 16 elements on (255 + 1 gives 255; open-mpi/ompi#8045),
# where the collectives promise wrapping. uint8 SUM is therefore reduced in an int32 copy and cast back,
# which wraps mod 256 on every MPI library (the same bits MPICH's uint8 SUM gives). PRODUCT wraps there.
def widened_for_mpi(dtype: np.dtype, op: ReduceOp) -> Optional[np.dtype]:
    """The dtype MPI reduces ``dtype`` with ``op`` in, when not ``dtype`` itself; else None."""
    if op is ReduceOp.SUM and dtype == _UINT8:
        return _INT32
    return None


_UINT8, _INT32 = np.dtype(np.uint8), np.dtype(np.int32)


def chunk_bounds(n: int, step: int):
    """[start, stop) blocks of at most ``step`` covering range(n) (one empty block for n == 0)."""
    if n == 0:
        yield 0, 0
        return
    for start in range(0, n, step):
        yield start, min(start + step, n)


def raise_failure(comm: Any, exc: BaseException):
    """Raise ``exc`` (an ``MPI.Exception`` from a call on ``comm``) as ``PeerFailedError`` when a peer died, else
    as it is (``backends.failures``). Call it inside the ``except`` clause."""
    error = peer_failed(load_mpi(), comm, exc)
    if error is exc:
        raise exc
    raise replacing(error, exc)


# [Note: MPI requests in flight while the node's engine waits]
# MPI moves a large message (past its eager limit) only while both ends make progress: a rank that posted a
# receive, or started a send, and then waits inside the node's shared-memory engine makes none, so its peer,
# blocked in the matching send or receive before the same engine call, waits for it for good (a valid MPI
# program: MPI progresses every request inside every call). So each thread's MPI works in flight are noted here
# (``IN_FLIGHT``), and while it has any, its engine calls are polled rather than waited for inside C, and every
# poll tests them (``advance_in_flight``; ``collectives.engine_calls``). A test that ends in an error keeps it for
# the work's own wait. A work is advanced only by the thread that started it (MPI forbids two threads testing
# one request at once).
IN_FLIGHT: Dict[int, List["MPIWork"]] = {}  # thread ident -> its MPI works started and not yet seen done
_PRUNE_AT = 64  # a thread's list is pruned of finished works when it grows past this


def _in_flight(work: "MPIWork") -> bool:
    return not work._finished and bool(work._requests) and work._kept is None


def _forget_finished(works: List["MPIWork"]) -> None:
    works[:] = [work for work in works if _in_flight(work)]


def in_flight_here() -> bool:
    """True if this thread has MPI works in flight (the finished ones are forgotten on the way)."""
    me = get_ident()
    works = IN_FLIGHT.get(me)
    if works is None:
        return False
    _forget_finished(works)
    if not works:
        del IN_FLIGHT[me]
        return False
    return True


def advance_in_flight() -> None:
    """Test this thread's MPI works in flight, which lets MPI move their data (see the note above)."""
    works = IN_FLIGHT.get(get_ident())
    if works:
        for work in list(works):
            if _in_flight(work):
                work.advance()


def _note_in_flight(work: "MPIWork") -> None:
    works = IN_FLIGHT.setdefault(get_ident(), [])
    works.append(work)
    if len(works) > _PRUNE_AT:
        _forget_finished(works)


class MPIWork(Work):
    """The requests of one operation (several when it is chunked).

    Collective chunks run one after the other: Open MPI 5.0 returns wrong sums for concurrent
    ``MPI_Ireduce_scatter_block`` calls (seen here with 3 ranks), and posting all chunks gains nothing.
    Point-to-point chunks are all posted at once: a receiver waiting for chunk 2 must not depend on its
    peer calling ``wait`` on the send. ``comm``: the communicator, whose failed peers an error names.
    Subclasses test their requests in ``_test_requests``.
    """

    def __init__(self, steps: List[Tuple[Callable[[], Any], Optional[Callable[[], None]]]], result=None,
                 sequential: bool = True, comm: Any = None):
        super().__init__(result)
        self._steps = steps
        self._sequential = sequential
        self._comm = comm
        self._next = 0
        self._kept: Optional[BaseException] = None  # what a test made by another wait ended with (``advance``)
        try:
            if sequential:
                self._requests = [steps[0][0]()]
            else:
                self._requests = [start() for start, _ in steps]
        except load_mpi().Exception as exc:
            raise_failure(comm, exc)
        _note_in_flight(self)

    def advance(self) -> None:
        """Test from a wait of something else: what the test raises is kept for this work's own wait."""
        try:
            self._test()
        except Exception:  # noqa: BLE001 - kept by _test, raised again by this work's wait
            pass

    def _test(self) -> bool:
        if self._kept is not None:
            raise self._kept
        try:
            return self._test_requests()
        except Exception as exc:
            self._kept = exc  # the requests' state is MPI's error now: every later wait raises it
            raise

    def _advance(self) -> bool:
        """The requests in flight are done: finish them, start the next chunk; True when all are done."""
        if not self._sequential:
            for _, after in self._steps:
                if after is not None:
                    after()
            self._requests = []
            return True
        _, after = self._steps[self._next]
        if after is not None:
            after()
        self._next += 1
        if self._next == len(self._steps):
            self._requests = []
            return True
        self._requests = [self._steps[self._next][0]()]
        return False

    def _test_requests(self) -> bool:
        MPI = load_mpi()
        try:
            while self._requests:
                if not MPI.Request.Testall(self._requests):
                    return False
                if self._advance():
                    return True
        except MPI.Exception as exc:
            raise_failure(self._comm, exc)
        return True

    def _block(self, timeout: Optional[float]) -> bool:
        if self._kept is not None:
            raise self._kept
        if PROGRESS[0] is not None:
            return self._poll(timeout)
        if timeout is None:
            MPI = load_mpi()
            try:
                while self._requests:
                    MPI.Request.Waitall(self._requests)
                    self._advance()
            except MPI.Exception as exc:
                raise_failure(self._comm, exc)
            return True
        return super()._block(timeout)

    def _poll(self, timeout: Optional[float]) -> bool:
        """Wait by testing (``poll``), which calls the collective layer's hook: calls waiting for their check may
        be issued meanwhile (``base.PROGRESS``)."""
        return poll(self._test, None if timeout is None else time.monotonic() + timeout)


_SPINS = 200  # polls before a wait starts to yield the core


def poll(done: Callable[[], bool], deadline: Optional[float] = None) -> bool:
    """Call ``done()`` until it holds (True) or ``deadline`` (``time.monotonic``) passes (False): a spin first,
    as MPI's own waits spin, then the core yielded between polls (an oversubscribed node)."""
    polls = 0
    while not done():
        polls += 1
        if polls < _SPINS:
            continue
        os.sched_yield()
        progress = PROGRESS[0]
        if progress is not None:  # calls waiting for their check (collectives.agreement): issue those ready
            progress()
        if deadline is not None and polls % 64 == 0 and time.monotonic() >= deadline:
            return False
    return True


class ChunkPlan:
    """Steps of one (possibly chunked) operation on ``comm``: each starts a transfer, then finishes it."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.steps: List[Tuple[Callable[[], Any], Callable[[], Any], Optional[Callable[[], None]]]] = []

    def add(self, blocking: Callable[[], Any], nonblocking: Callable[[], Any],
            after: Optional[Callable[[], None]] = None) -> None:
        self.steps.append((blocking, nonblocking, after))

    def run(self, async_op: bool, result=None, sequential: bool = True) -> Work:
        if not async_op:
            try:
                for blocking, _, after in self.steps:
                    blocking()
                    if after is not None:
                        after()
            except load_mpi().Exception as exc:
                raise_failure(self.comm, exc)
            return CompletedWork(result)
        return MPIWork([(nonblocking, after) for _, nonblocking, after in self.steps], result, sequential, self.comm)


__all__ = ["IN_FLIGHT", "MPIWork", "advance_in_flight", "in_flight_here", "host_only_op", "mpi_op", "poll",
           "raise_failure", "widened_for_mpi"]
