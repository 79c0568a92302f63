"""Point-to-point messages: ``send``, ``recv``, ``isend``, ``irecv``.

Each is one row of a small table (``_Kind``), checked alike before anything is sent and run through
``core.run_call``. Messages carry no sequence number: a message is matched by peer and tag, not order.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from .._dtypes import check_array
from ..backends.base import Work
from ..errors import InvalidArgumentError, RankError
from ..groups import ProcessGroup
from . import graphed
from .core import member, run_call


class _Kind(NamedTuple):
    name: str  # "send", "recv", "isend" or "irecv"
    peer: str  # how messages name the peer: "dst" or "src"
    fills: bool  # the message is written into ``x``
    async_op: bool  # returns a Work at once
    call: Callable[[Any], Callable]  # the backend's method that carries it


_SEND = _Kind("send", "dst", False, False, lambda backend: backend.send)
_ISEND = _Kind("isend", "dst", False, True, lambda backend: backend.send)
# A blocking recv is waited for at once, so the backend may match the message and check its size
# before receiving it (recv_now); irecv keeps MPI's posted-receive semantics.
_RECV = _Kind("recv", "src", True, False, lambda backend: backend.recv_now)
_IRECV = _Kind("irecv", "src", True, True, lambda backend: backend.recv)


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
    label = f"{kind.name} with group rank {peer} (tag {tag}) on group {pg.name}"  # p2p: no sequence number
    return run_call(pg, label, lambda nb: call(x, peer, tag, nb), kind.async_op)


def send(x, dst: int, tag: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Send ``x`` to group rank ``dst`` (returns once ``x`` may be reused).

    Raises:
        RankError: ``dst`` is out of range, or this rank itself (a blocking send to oneself could wait forever;
            ``isend`` to oneself works).
    """
    _p2p(_SEND, x, dst, tag, group)


def recv(x, src: int, tag: int = 0, group: Optional[ProcessGroup] = None):
    """Fill ``x`` with the message from group rank ``src``; returns ``x``.

    Raises:
        ShapeError: the message's size or dtype differs from ``x``'s (both in the message; the message is
            consumed, so its sender is not left waiting). MPI's tags carry the dtype ([Note: the dtype in the
            tag]), which bounds ``tag`` there (InvalidArgumentError beyond it).
    """
    return _p2p(_RECV, x, src, tag, group)


def isend(x, dst: int, tag: int = 0, group: Optional[ProcessGroup] = None) -> Work:
    """Start sending ``x``; do not modify it before ``wait()``."""
    return _p2p(_ISEND, x, dst, tag, group)


def irecv(x, src: int, tag: int = 0, group: Optional[ProcessGroup] = None) -> Work:
    """Start receiving into ``x``; ``wait()`` returns ``x`` once filled."""
    return _p2p(_IRECV, x, src, tag, group)
