"""Point-to-point messages: ``send``, ``recv``, ``isend``, ``irecv``.

Each is one row of a small table (``_Kind``), checked alike before anything is sent and run through
``core.run_call``. Messages carry no sequence number: a message is matched by peer and tag, not order.

[Note: the fast path of send and recv]
A blocking ``send`` or ``recv`` of a plain numpy array, with no timeout, timeline or graph capture, needs only
the watchdog's note and the backend's one call (``Backend.send_plain``/``recv_plain``: on MPI an ``MPI_Send``,
or a matched probe, the size and dtype checks and an ``MPI_Recv``); ``isend``/``irecv`` need only the backend's
call and the Work's label. ``_fast`` takes those calls when every argument is what the general path would
accept; anything else, errors included, goes the general way, so both paths refuse alike. A message cost
37-45 us against raw mpi4py's 2-4 us through the general path (``axonhpc bench p2p``).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from .._dtypes import check_array, is_supported
from ..backends.base import Work
from ..cuda import capture
from ..errors import InvalidArgumentError, RankError
from ..groups import ProcessGroup, resolve_group
from ..observe import tracing
from ..settings import settings
from . import agreement, graphed, watchdog
from .agreement import _PENDING
from .engine_calls import BUSY
from .core import member, run_call
from .group_state import state_of, weak


class _Kind(NamedTuple):
    name: str  # "send", "recv", "isend" or "irecv"
    peer: str  # how messages name the peer: "dst" or "src"
    fills: bool  # the message is written into ``x``
    async_op: bool  # returns a Work at once
    call: Callable[[Any], Callable]  # the backend's method that carries it


class _Label:
    """How messages and the watchdog name one point-to-point call; formatted only when one needs it."""

    __slots__ = ("kind", "peer", "tag", "group")

    def __init__(self, kind: _Kind, peer: int, tag: int, group: ProcessGroup):
        self.kind, self.peer, self.tag, self.group = kind, peer, tag, group

    def __str__(self) -> str:  # p2p: no sequence number
        return f"{self.kind.name} with group rank {self.peer} (tag {self.tag}) on group {self.group.name}"


_SEND = _Kind("send", "dst", False, False, lambda backend: backend.send)
_ISEND = _Kind("isend", "dst", False, True, lambda backend: backend.send)
# A blocking recv is waited for at once, so the backend may match the message and check its size
# before receiving it (recv_now); irecv keeps MPI's posted-receive semantics.
_RECV = _Kind("recv", "src", True, False, lambda backend: backend.recv_now)
_IRECV = _Kind("irecv", "src", True, True, lambda backend: backend.recv)
NOT_TAKEN = object()  # what ``_fast`` returns when the general path must make the call


def _check_tag(tag: Any) -> int:
    if isinstance(tag, bool) or not hasattr(tag, "__index__") or int(tag) < 0:
        raise InvalidArgumentError(f"tag must be a non-negative integer, got {tag!r}")
    return int(tag)


def _p2p(kind: _Kind, x: Any, peer: int, tag: int, group: Optional[ProcessGroup]) -> Any:
    pg = member(group, kind.name)
    peer = pg.check_rank(peer, f"{kind.name} {kind.peer}")
    tag = _check_tag(tag)
    if kind is _SEND and peer == pg.rank:
        raise RankError(f"send: dst={peer} is this rank itself (group rank {pg.rank} of group {pg.name}); a blocking "
                        f"send to oneself waits for a receive that this rank could only post after it returns: use "
                        f"isend (then recv, then wait on the isend's Work)")
    check_array(x, f"{kind.name} buffer", writable=kind.fills)
    graphed.admit(pg, kind.name, x, why_not="axonhpc does not capture point-to-point messages (NCCL queues "
                                            "them until a wait, which a graph's replay would not repeat)")
    call = kind.call(pg.backend)
    return run_call(pg, _Label(kind, peer, tag, pg), lambda nb: call(x, peer, tag, nb), kind.async_op)


def _route(pg: ProcessGroup) -> tuple:
    """``(backend, size, rank)`` of the fast path on ``pg``, backend None where it is not offered (a non-member,
    a timeout); kept on the group per change of the settings or of its ``timeout``."""
    key = (settings.revision, pg.timeout)
    state = pg.collective_state or state_of(pg)
    cached = state.p2p
    if cached is None or cached[0] != key:
        backend = pg.member_backend if pg.effective_timeout() is None else None
        cached = state.p2p = (key, backend, pg.size, pg.rank)
    return cached


def _fast(kind: _Kind, x: Any, peer: Any, tag: Any, group: Optional[ProcessGroup]) -> Any:
    """The call on the fast path ([Note: the fast path of send and recv]): its result (None for ``send``, ``x`` for
    ``recv``, the Work of ``isend``/``irecv``), or ``NOT_TAKEN`` having sent nothing (the general path then checks
    and runs the call)."""
    if type(x) is not np.ndarray or type(peer) is not int or type(tag) is not int or tag < 0:
        return NOT_TAKEN
    flags = x.flags
    if not flags.c_contiguous or (kind.fills and not flags.writeable) or not is_supported(x.dtype):
        return NOT_TAKEN
    if (tracing.EVER_INSTALLED and tracing.active() is not None) or (capture.EVER_RECORDED and capture.capturing()):
        return NOT_TAKEN
    pg = resolve_group(group)
    _, backend, size, rank = _route(pg)
    if backend is None or not 0 <= peer < size or (kind is _SEND and peer == rank):
        return NOT_TAKEN
    label = _Label(kind, peer, tag, pg)
    if kind.async_op:  # started at once: the watchdog sees its wait (Work.wait), named by its label
        work = kind.call(backend)(x, peer, tag, True)
        work.label = label
        state = pg.collective_state  # made by _route; ProcessGroup.destroy waits for the work (GroupState.note_started)
        started = state.started
        started.append(weak(work))
        if len(started) >= state.prune_at:
            state.prune()
        return work
    if not kind.fills and ((_PENDING and agreement.still_waiting_elsewhere(pg, own_too=True)) or BUSY):
        # MPI_Send may wait inside C: made nonblocking and polled instead (agreement's [Note: calls waiting for
        # their check, across groups]; calls in flight in the node's engine likewise, see engine_calls); a
        # receive polls already, and calls the hook.
        return NOT_TAKEN
    key = watchdog.blocking(pg, None, label)
    try:
        done = backend.recv_plain(x, peer, tag) if kind.fills else backend.send_plain(x, peer, tag)
    finally:
        watchdog.unblocked(key)
    if not done:
        return NOT_TAKEN
    return x if kind.fills else None


def largest_tag(group: Optional[ProcessGroup] = None) -> int:
    """The largest ``tag`` that ``send``/``recv`` and their nonblocking twins take on ``group`` (this rank a member).

    On MPI it is ``(MPI_TAG_UB - 7) // 8`` ([Note: the dtype in the tag]): 67,108,863 with the MPICH wheel,
    268,435,455 with Open MPI's, and 4095 with an MPI that has only the standard's minimum of 32767.
    """
    return member(group, "largest_tag").backend.largest_tag()


def send(x, dst: int, tag: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Send ``x`` to group rank ``dst`` (returns once ``x`` may be reused).

    Raises:
        RankError: ``dst`` is out of range, or this rank itself (a blocking send to oneself could wait forever;
            ``isend`` to oneself works).
    """
    if _fast(_SEND, x, dst, tag, group) is NOT_TAKEN:
        _p2p(_SEND, x, dst, tag, group)


def recv(x, src: int, tag: int = 0, group: Optional[ProcessGroup] = None):
    """Fill ``x`` with the message from group rank ``src``; returns ``x``.

    Raises:
        ShapeError: the message's size or dtype differs from ``x``'s (both in the message; the message is
            consumed, so its sender is not left waiting). MPI's tags carry the dtype ([Note: the dtype in the
            tag]), which bounds ``tag`` there (InvalidArgumentError beyond it).
    """
    result = _fast(_RECV, x, src, tag, group)
    return _p2p(_RECV, x, src, tag, group) if result is NOT_TAKEN else result


def isend(x, dst: int, tag: int = 0, group: Optional[ProcessGroup] = None) -> Work:
    """Start sending ``x``; do not modify it before ``wait()``."""
    work = _fast(_ISEND, x, dst, tag, group)
    return _p2p(_ISEND, x, dst, tag, group) if work is NOT_TAKEN else work


def irecv(x, src: int, tag: int = 0, group: Optional[ProcessGroup] = None) -> Work:
    """Start receiving into ``x``; ``wait()`` returns ``x`` once filled."""
    work = _fast(_IRECV, x, src, tag, group)
    return _p2p(_IRECV, x, src, tag, group) if work is NOT_TAKEN else work
