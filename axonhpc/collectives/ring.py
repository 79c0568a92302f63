"""Explicit all-reduce algorithms on point-to-point messages: ring and recursive halving-doubling.

[Note: ring and rhd]
The ring sends ``2 (P - 1) / P * n`` elements (bandwidth-optimal) in ``2 (P - 1)`` steps. Rabenseifner's
halving-doubling sends the same in ``2 log2(P')`` steps (P' the largest power of two <= P; the first 2r
ranks fold pairwise first, two more steps of n elements), and its first, largest exchange is between
neighbours, which a block placement keeps inside a node.

[Note: schedules are data]
``ring_schedule`` and ``rhd_schedule`` are pure functions of (size, rank) returning the ``Step`` list one
executor runs. Each chunk is reduced along one fixed path and then only copied, so runs are bit-identical,
every rank gets the same bits, and for P <= 2 the result equals the native all-reduce.

[Note: a private channel for the messages]
The messages travel on a communicator split once from the group's backend (collective, on the first ring or
rhd call), so a user's ``send`` with any tag can never match them; MPI keeps messages on one (communicator,
tag) in order, so one tag per algorithm suffices. Every step posts its receive and send before waiting for
either, so no message size can deadlock.
"""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from .._dtypes import array_module
from ..backends.base import Backend, ReduceOp
from ..backends.folding import fold
from ..groups import ProcessGroup
from .group_state import private_channel
from .widen import reduce_widened

RING_TAG = 1
RHD_TAG = 2


class Step(NamedTuple):
    """One step of a schedule on one rank: chunk ranges ``[lo, hi)``, peers (None: that half is skipped), ``reduce`` or replace."""

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

    The first ``n % parts`` chunks hold one element more; with ``n < parts`` the last are empty.
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


def channel(pg: ProcessGroup) -> Backend:
    """The private communicator of ``pg`` for these algorithms (collective on the first call)."""
    return private_channel(pg, "ring")


def execute(flat: Any, schedule: Schedule, op: ReduceOp, backend: Backend, tag: int,
            timeout: Optional[float] = None, name: str = "all_reduce") -> None:
    """Run one rank's ``schedule`` on the contiguous 1-d array ``flat`` in place (not 16-bit floats)."""
    xp = array_module(flat)
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
            fold(op, flat[ra:rb], into)  # float MIN/MAX: backends.folding's note


def _all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup, make: Callable[[int, int], Schedule], tag: int,
                name: str) -> None:
    if pg.size == 1 or x.size == 0:
        return  # the identity for every op (AVG too: x // 1 == x / 1 == x)
    label = f"{name} all_reduce on group {pg.name} {list(pg.ranks)}"

    def body(work: Any, base: ReduceOp) -> None:
        execute(work.reshape(-1), make(pg.size, pg.rank), base, channel(pg), tag, pg.effective_timeout(), label)

    reduce_widened(x, op, pg.size, body)


def ring_all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup) -> None:
    """All-reduce ``x`` in place by reduce-scatter and all-gather around a ring."""
    _all_reduce(x, op, pg, ring_schedule, RING_TAG, "ring")


def ring_reduce_scatter(x: Any, out: Any, op: ReduceOp, pg: ProcessGroup) -> Any:
    """Reduce-scatter around the ring in a fixed order (deterministic mode); a finished ``Work`` returning ``out``."""
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
    """All-reduce ``x`` in place by recursive halving and doubling (Rabenseifner), any group size."""
    _all_reduce(x, op, pg, rhd_schedule, RHD_TAG, "rhd")


__all__ = ["Step", "Schedule", "chunk_offsets", "ring_schedule", "ring_reduce_scatter_schedule", "rhd_schedule", "channel", "execute",
           "ring_all_reduce", "ring_reduce_scatter", "rhd_all_reduce", "RING_TAG", "RHD_TAG"]
