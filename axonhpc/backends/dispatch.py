"""One backend of two: host arrays to MPI, device arrays to NCCL.

[Note: two backends in one world]
A world on NCCL still needs MPI (numpy arrays, bootstrapping NCCL, the node layout). Rather than
teach every layer about two backends, the world holds one ``DeviceDispatchBackend`` that hands each
call to ``device`` for a cupy array and to ``host`` otherwise.

- Both sides cover the same ranks in the same order: ``split`` and ``create_group`` build the device
  communicator over the split host one, so every group has one NCCL communicator.
- Barrier, node layout, arrival notices and abort are the host's. Host and NCCL are each ordered per
  communicator and every rank issues the same calls in order, so host and device calls cannot cross.
- Both ends of a send/recv must use the same kind of array: a numpy send travels over MPI and never
  meets a cupy receive posted on NCCL.
- NCCL's non-blocking sends and receives wait in a queue to be issued together (``nccl``'s module note).
  Every call that goes to the host issues them first: a host call may wait for a peer that waits for one
  of them (a pipeline stage sends its output with ``isend``, then waits on the host for the next stage's
  shape header, which that stage sends only once it has the output).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

from .._dtypes import is_cupy_array
from .base import Backend, ReduceOp, Work


class DeviceDispatchBackend(Backend):
    """Host arrays to ``host``, cupy arrays to ``device`` (see the module note).

    ``make_device``: builds the device backend over a host backend of the same ranks (collective, e.g.
    ``NCCLBackend``); called now and for every group split from this one.
    """

    def __init__(self, host: Backend, make_device: Callable[[Backend], Backend]):
        self.host = host
        self._make_device = make_device
        self.device = make_device(host)
        self.name = f"{host.name}+{self.device.name}"
        self.rank, self.size = host.rank, host.size

    @property
    def global_ranks(self) -> Tuple[int, ...]:
        """World rank of each rank (the same on both sides)."""
        return self.host.global_ranks

    @global_ranks.setter
    def global_ranks(self, ranks: Sequence[int]) -> None:
        self.host.global_ranks = tuple(ranks)
        self.device.global_ranks = tuple(ranks)

    def _side(self, buf) -> Backend:
        return self.device if is_cupy_array(buf) else self.host

    def _for(self, buf) -> Backend:
        """The side that carries a call on ``buf``; the device side's queued messages are issued before a host call."""
        side = self._side(buf)
        if side is self.host:
            self.device.issue_queued()
        return side

    def _host(self) -> Backend:
        self.device.issue_queued()
        return self.host

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, buf, op: ReduceOp, async_op: bool) -> Work:
        return self._for(buf).all_reduce(buf, op, async_op)

    def broadcast(self, buf, root: int, async_op: bool) -> Work:
        return self._for(buf).broadcast(buf, root, async_op)

    def all_gather(self, send, recv, async_op: bool) -> Work:
        return self._for(send).all_gather(send, recv, async_op)

    def reduce_scatter(self, send, recv, op: ReduceOp, async_op: bool) -> Work:
        return self._for(send).reduce_scatter(send, recv, op, async_op)

    def gather(self, send, recv, root: int, async_op: bool) -> Work:
        return self._for(send).gather(send, recv, root, async_op)

    def scatter(self, send, recv, root: int, async_op: bool) -> Work:
        return self._for(recv).scatter(send, recv, root, async_op)

    def barrier(self, async_op: bool) -> Work:
        return self._host().barrier(async_op)

    def stages(self, buf) -> bool:
        return self._side(buf).stages(buf)

    def captures(self, buf) -> bool:
        return self._side(buf).captures(buf)

    # -- point to point -----------------------------------------------------------------------
    def send(self, buf, dst: int, tag: int, async_op: bool) -> Work:
        return self._for(buf).send(buf, dst, tag, async_op)

    def recv(self, buf, src: int, tag: int, async_op: bool) -> Work:
        return self._for(buf).recv(buf, src, tag, async_op)

    def recv_now(self, buf, src: int, tag: int, nonblocking: bool) -> Work:
        return self._for(buf).recv_now(buf, src, tag, nonblocking)

    def largest_tag(self) -> int:
        return self.host.largest_tag()  # the device side's NCCL has no tags: the host's bound is the bound

    def send_plain(self, buf, dst: int, tag: int) -> bool:
        return self._host().send_plain(buf, dst, tag)  # numpy arrays only

    def recv_plain(self, buf, src: int, tag: int) -> bool:
        return self._host().recv_plain(buf, src, tag)

    def issue_queued(self) -> None:
        self.device.issue_queued()

    # -- communicators ------------------------------------------------------------------------
    def host_side(self) -> Backend:
        """The MPI backend that carries the host arrays (the device side's queued messages issued first)."""
        return self._host()

    def announce(self, seq: int, op: str) -> Optional[Any]:
        return self.host.announce(seq, op)

    def _wrap(self, host: Optional[Backend]) -> Optional["DeviceDispatchBackend"]:
        return None if host is None else DeviceDispatchBackend(host, self._make_device)

    def split(self, color: Optional[int], key: int) -> Optional["DeviceDispatchBackend"]:
        return self._wrap(self._host().split(color, key))

    def create_group(self, ranks: Sequence[int]) -> Optional["DeviceDispatchBackend"]:
        return self._wrap(self._host().create_group(ranks))

    def node_layout(self, local_key: Optional[int] = None) -> Tuple[int, int, int, int]:
        return self.host.node_layout(local_key)

    def abort(self, code: int = 1) -> None:
        self.host.abort(code)

    def free(self) -> None:
        self.device.free()
        self.host.free()


__all__ = ["DeviceDispatchBackend"]
