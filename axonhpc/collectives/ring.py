"""Explicit all-reduce algorithms on point-to-point messages: ring and recursive halving-doubling.

[Note: ring all-reduce]
The flat array of n elements is cut into P chunks of nearly equal size (the
first ``n % P`` chunks hold one element more; chunks may be empty when
n < P). In P - 1 reduce-scatter steps every rank sends one chunk to its right
neighbour and receives one from its left neighbour, which it reduces into its
own copy; afterwards rank r holds the full reduction of chunk r + 1. In
P - 1 all-gather steps the finished chunks travel once more around the ring.
Each rank sends ``2 (P - 1) / P * n`` elements in ``2 (P - 1)`` steps:
bandwidth-optimal, but the step count grows linearly with P.

[Note: recursive halving-doubling (Rabenseifner)]
With P' the largest power of two <= P and r = P - P', the first 2r ranks
fold pairwise: each even rank among them sends its whole array to its odd
neighbour, which reduces it, and sits out. The remaining P' ranks (the odd
ones of the first 2r, then the rest) split the array into P' chunks and run
log2(P') halving steps: at distance 1, 2, 4, ... each rank exchanges half of
the chunk range it still holds with its partner (virtual rank XOR distance)
and reduces the half it keeps. Then the doubling steps retrace the halving
in reverse, exchanging finished ranges until every rank holds everything,
and the odd ranks of the fold send the result back to their even
neighbours. The P' ranks send the same ``2 (P' - 1) / P' * n`` elements as
the ring but in ``2 log2(P')`` steps; a non-power of two adds two steps of n
elements each for the folded pairs. The first, largest exchange is between
neighbouring ranks, which a block rank placement keeps inside a node.

[Note: schedules are data]
``ring_schedule`` and ``rhd_schedule`` are pure functions of (size, rank):
the list of ``Step`` each rank executes (to whom it sends which chunk range,
from whom it receives which, and whether the received data is reduced or
copied). One executor runs either list. Both fix the order of every
reduction for a given (P, n): each chunk is reduced along one path and then
only copied, so repeated runs are bit-identical, every rank ends with the
same bits, and for P <= 2 the result equals the native all-reduce bit for
bit (one addition of two numbers is exact in either operand order). For
larger P the association differs from the MPI library's, so float results
agree with native within rounding (integers, MIN and MAX exactly).

[Note: a private channel for the messages]
The messages travel on a communicator of their own, split once from the
group's backend (``backend.split(0, rank)``: the same ranks in the same
order, a fresh MPI context) on the first ring or rhd call on the group and
kept on the group. A user's ``send``/``isend`` on the group, with any tag,
can therefore never match one of these messages, even while in flight. On
that channel every rank runs the same sequence of schedules, and MPI keeps
messages between two ranks on one (communicator, tag) in order, so one tag
per algorithm (``RING_TAG``, ``RHD_TAG``) is enough. Creating the channel is
collective over the group, like the first call of the hierarchical
algorithm; it costs one ``MPI_Comm_split``.

AVG is a SUM divided by P at the end (floor division for integers), and
float16/bfloat16 are reduced in a float32 copy and rounded once, both as in
``collectives.core``. Every step posts its receive and its send before
waiting for either, so no size of message can deadlock.
"""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from .._dtypes import array_module
from ..backends.base import Backend, ReduceOp
from ..groups import ProcessGroup
from .group_state import private_channel
from .widen import reduce_widened

RING_TAG = 1
RHD_TAG = 2


class Step(NamedTuple):
    """One step of an all-reduce schedule on one rank.

    Ranges are ``[lo, hi)`` in chunk indices. A step with ``send_to`` None
    only receives; with ``recv_from`` None it only sends.

    Attributes:
        send_to: group rank this step sends to, or None.
        send: chunk range sent.
        recv_from: group rank this step receives from, or None.
        recv: chunk range received.
        reduce: the received data is reduced into the local range (else it replaces it).
    """

    send_to: Optional[int]
    send: Tuple[int, int]
    recv_from: Optional[int]
    recv: Tuple[int, int]
    reduce: bool


class Schedule(NamedTuple):
    """The steps of one rank and the number of chunks the array is cut into."""

    chunks: int
    steps: Tuple[Step, ...]


def chunk_offsets(n: int, parts: int) -> List[int]:
    """Offsets of ``parts`` nearly equal chunks of ``n`` elements: chunk i is ``[off[i], off[i + 1])``.

    The first ``n % parts`` chunks hold one element more; with ``n < parts``
    the last chunks are empty.
    """
    base, extra = divmod(n, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets


def ring_schedule(size: int, rank: int) -> Schedule:
    """Reduce-scatter then all-gather around the ring ``rank -> rank + 1`` (see the module note)."""
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for s in range(size - 1):
        send, recv = (rank - s) % size, (rank - s - 1) % size
        steps.append(Step(right, (send, send + 1), left, (recv, recv + 1), True))
    for s in range(size - 1):
        send, recv = (rank + 1 - s) % size, (rank - s) % size
        steps.append(Step(right, (send, send + 1), left, (recv, recv + 1), False))
    return Schedule(size, tuple(steps))


def ring_reduce_scatter_schedule(size: int, rank: int) -> Schedule:
    """The reduce-scatter half of the ring, shifted so that rank r ends holding chunk r (finished)."""
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for s in range(size - 1):
        send, recv = (rank - s - 1) % size, (rank - s - 2) % size
        steps.append(Step(right, (send, send + 1), left, (recv, recv + 1), True))
    return Schedule(size, tuple(steps))


def rhd_schedule(size: int, rank: int) -> Schedule:
    """Recursive halving then doubling, any size, non-powers of two folded (see the module note)."""
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    whole = (0, pof2)

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    if rank < 2 * extra and rank % 2 == 0:  # folds into rank + 1 and sits out
        return Schedule(pof2, (Step(rank + 1, whole, None, whole, False),
                               Step(None, whole, rank + 1, whole, False)))
    steps = []
    if rank < 2 * extra:
        steps.append(Step(None, whole, rank - 1, whole, True))
        v = rank // 2
    else:
        v = rank - extra
    lo, hi = whole
    exchanged = []
    mask = 1
    while mask < pof2:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & mask == 0 else ((mid, hi), (lo, mid))
        peer = real(v ^ mask)
        steps.append(Step(peer, give, peer, keep, True))
        exchanged.append((peer, keep, give))
        lo, hi = keep
        mask <<= 1
    for peer, keep, give in reversed(exchanged):
        steps.append(Step(peer, keep, peer, give, False))
    if rank < 2 * extra:
        steps.append(Step(rank - 1, whole, None, whole, False))
    return Schedule(pof2, tuple(steps))


def _reducer(xp, op: ReduceOp) -> Callable:
    return {ReduceOp.SUM: xp.add, ReduceOp.PRODUCT: xp.multiply,
            ReduceOp.MIN: xp.minimum, ReduceOp.MAX: xp.maximum}[op]


def channel(pg: ProcessGroup) -> Backend:
    """The private communicator of ``pg`` for these algorithms (collective on the first call).

    Same ranks in the same order as ``pg``; see the module note.
    """
    return private_channel(pg, "ring")


def execute(flat: Any, schedule: Schedule, op: ReduceOp, backend: Backend, tag: int,
            timeout: Optional[float] = None, name: str = "all_reduce") -> None:
    """Run one rank's ``schedule`` on the 1-d array ``flat`` in place.

    Args:
        flat: contiguous 1-d array of a dtype the backend reduces (not 16-bit floats).
        schedule: this rank's steps, from ``ring_schedule`` or ``rhd_schedule``.
        op: SUM, PRODUCT, MIN or MAX.
        backend: the channel the messages travel on.
        tag: the message tag on that channel.
        timeout: seconds each step may wait (None: forever).
        name: how timeout messages name the call.
    """
    xp = array_module(flat)
    reduce = _reducer(xp, op)
    off = chunk_offsets(flat.size, schedule.chunks)
    largest = max([off[s.recv[1]] - off[s.recv[0]] for s in schedule.steps if s.reduce] or [0])
    scratch = xp.empty(largest, dtype=flat.dtype) if largest else None
    for i, step in enumerate(schedule.steps):
        works = []
        into = None
        ra, rb = off[step.recv[0]], off[step.recv[1]]
        if step.recv_from is not None and rb > ra:
            into = scratch[:rb - ra] if step.reduce else flat[ra:rb]
            work = backend.recv(into, step.recv_from, tag, True)
            work.label = f"{name} step {i}: receive from group rank {step.recv_from}"
            works.append(work)
        sa, sb = off[step.send[0]], off[step.send[1]]
        if step.send_to is not None and sb > sa:
            work = backend.send(flat[sa:sb], step.send_to, tag, True)
            work.label = f"{name} step {i}: send to group rank {step.send_to}"
            works.append(work)
        for work in works:
            work.wait(timeout)
        if into is not None and step.reduce:
            reduce(flat[ra:rb], into, out=flat[ra:rb])


def _all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup, make: Callable[[int, int], Schedule], tag: int,
                name: str) -> None:
    if pg.size == 1 or x.size == 0:
        return  # the identity for every op (AVG too: x // 1 == x / 1 == x)
    label = f"{name} all_reduce on group {pg.name} {list(pg.ranks)}"

    def body(work: Any, base: ReduceOp) -> None:
        execute(work.reshape(-1), make(pg.size, pg.rank), base, channel(pg), tag, pg.effective_timeout(), label)

    reduce_widened(x, op, pg.size, body)


def ring_all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup) -> None:
    """All-reduce ``x`` in place by reduce-scatter and all-gather around a ring.

    Args:
        x: checked, writable, C-contiguous array (same shape and dtype on every rank).
        op: the reduction (AVG divides the sum by the group size at the end).
        pg: the group (every member calls).
    """
    _all_reduce(x, op, pg, ring_schedule, RING_TAG, "ring")


def ring_reduce_scatter(x: Any, out: Any, op: ReduceOp, pg: ProcessGroup) -> Any:
    """Reduce-scatter around the ring in a fixed order: ``out`` gets part ``rank`` (deterministic mode).

    Args:
        x: checked array whose size is divisible by the group size.
        out: contiguous, writable array of one part's shape and ``x``'s dtype.
        op: the reduction (AVG divides at the end; 16-bit floats are reduced in float32).
        pg: the group (every member calls).

    Returns:
        A finished ``Work`` whose ``wait()`` returns ``out``.
    """
    from ..backends.base import CompletedWork

    work_copy = x.reshape(-1).copy()
    if pg.size > 1 and work_copy.size:
        label = f"ring reduce_scatter on group {pg.name} {list(pg.ranks)}"

        def body(buf: Any, base: ReduceOp) -> None:
            execute(buf.reshape(-1), ring_reduce_scatter_schedule(pg.size, pg.rank), base, channel(pg), RING_TAG,
                    pg.effective_timeout(), label)

        reduce_widened(work_copy, op, pg.size, body)
    part = work_copy.size // pg.size
    out.reshape(-1)[...] = work_copy[pg.rank * part:(pg.rank + 1) * part]
    done = CompletedWork(out)
    done.wait()
    return done


def rhd_all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup) -> None:
    """All-reduce ``x`` in place by recursive halving and doubling (Rabenseifner), any group size.

    Args:
        x: checked, writable, C-contiguous array (same shape and dtype on every rank).
        op: the reduction (AVG divides the sum by the group size at the end).
        pg: the group (every member calls).
    """
    _all_reduce(x, op, pg, rhd_schedule, RHD_TAG, "rhd")


__all__ = ["Step", "Schedule", "chunk_offsets", "ring_schedule", "ring_reduce_scatter_schedule", "rhd_schedule", "channel", "execute",
           "ring_all_reduce", "ring_reduce_scatter", "rhd_all_reduce", "RING_TAG", "RHD_TAG"]
