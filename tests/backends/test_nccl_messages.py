"""NCCL point-to-point messages against the fake NCCL: envelopes, order, and when queued messages are issued.

NCCL matches the messages two ranks exchange in the order issued, with no tags and no check of dtype or size
([Note: envelopes] in ``axonhpc.backends.nccl_envelopes``). The fake NCCL delivers in that order too, so a
receive posted for another message than the next one takes that message's bytes here as on a GPU, unless the
envelope check refuses it. Nothing here runs on a GPU.
"""
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.errors import ShapeError, UsageError
from support.fake_cuda import FakeCupy, FakeNccl, device, run_device_world


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def _refused(call):
    """The message of the axonhpc error ``call()`` raised, or "no error"."""
    try:
        call()
    except (ShapeError, UsageError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _nccl_receives(nccl, rank):
    return [c for c in nccl.calls if c[0] == rank and c[1] == "recv"]


def test_a_receive_in_another_order_than_the_sends_is_refused_naming_both_tags(fake_cupy):
    """Two arrays of one shape: NCCL would hand the tag-1 array to the tag-2 receive, with no error."""
    nccl = FakeNccl()

    def body(world):
        if world.rank == 0:
            ax.send(device(np.full(4, 1.0, dtype=np.float32)), 1, tag=1)
            ax.send(device(np.full(4, 2.0, dtype=np.float32)), 1, tag=2)
            return None
        return _refused(lambda: ax.recv(device(np.zeros(4, dtype=np.float32)), 0, tag=2))

    message = run_device_world(body, 2, nccl)[1]
    assert message.startswith("UsageError: recv from rank 0 tag 2: the next device array rank 0 sent this rank "
                              "has tag 1 (4 elements of float32)"), message
    assert "in the order they were sent" in message
    assert _nccl_receives(nccl, 1) == []  # refused before its NCCL receive was issued


@pytest.mark.parametrize("blocking", [True, False], ids=["recv", "irecv"])
@pytest.mark.parametrize("sent, into, said", [
    ((4, np.float32), (4, np.int32), "holds 4 elements of float32, but the receive buffer is 4 elements of int32 "
                                     "(16 bytes; shape (4,))"),
    ((4, np.float32), (6, np.float32), "holds 4 elements of float32, but the receive buffer is 6 elements of "
                                       "float32 (24 bytes; shape (6,))"),
], ids=["dtype", "size"])
def test_a_receive_of_another_dtype_or_size_raises_before_nccl_receives(fake_cupy, blocking, sent, into, said):
    nccl = FakeNccl()

    def body(world):
        if world.rank == 0:
            ax.send(device(np.ones(sent[0], dtype=sent[1])), 1, tag=7)
            return None
        buf = device(np.zeros(into[0], dtype=into[1]))
        return _refused((lambda: ax.recv(buf, 0, tag=7)) if blocking else (lambda: ax.irecv(buf, 0, tag=7).wait()))

    message = run_device_world(body, 2, nccl)[1]
    assert message.startswith(f"ShapeError: recv from rank 0 tag 7: the incoming message {said}"), message
    assert _nccl_receives(nccl, 1) == []


def test_messages_of_several_tags_and_dtypes_in_order_arrive_whatever_order_they_are_waited_in(fake_cupy):
    def body(world):
        if world.rank == 0:
            works = [ax.isend(device(np.arange(3, dtype=np.float32)), 1, tag=1),
                     ax.isend(device(np.arange(5, dtype=np.int64) * 10), 1, tag=2),
                     ax.isend(device(np.full(2, 7.0)), 1, tag=1)]
            ax.send(device(np.ones(1, dtype=np.uint8)), 1, tag=9)
            for w in works:
                w.wait()
            return None
        a, b, c = device(np.zeros(3, dtype=np.float32)), device(np.zeros(5, dtype=np.int64)), device(np.zeros(2))
        works = [ax.irecv(a, 0, tag=1), ax.irecv(b, 0, tag=2), ax.irecv(c, 0, tag=1)]
        for w in reversed(works):  # the last waited for first: the envelopes before it are checked on the way
            w.wait()
        flag = device(np.zeros(1, dtype=np.uint8))
        ax.recv(flag, 0, tag=9)
        return a.get().tolist(), b.get().tolist(), c.get().tolist(), flag.get().tolist()

    assert run_device_world(body, 2)[1] == ([0.0, 1.0, 2.0], [0, 10, 20, 30, 40], [7.0, 7.0], [1])


def test_is_completed_checks_the_envelope_once_the_data_is_there(fake_cupy):
    def body(world):
        if world.rank == 0:
            ax.send(device(np.full(4, 1.0)), 1, tag=1)
            ax.send(device(np.full(4, 2.0)), 1, tag=2)
            return None
        second, first = device(np.zeros(4)), device(np.zeros(4))
        works = [ax.irecv(second, 0, tag=2), ax.irecv(first, 0, tag=1)]

        def poll():
            while not works[0].is_completed():
                pass

        return _refused(poll)

    message = run_device_world(body, 2)[1]
    assert message.startswith("UsageError: recv from rank 0 tag 2: the next device array rank 0 sent this rank "
                              "has tag 1"), message


def test_an_irecv_then_a_blocking_send_on_both_ranks_of_a_pair_share_one_group(fake_cupy):
    """MPI allows it; on NCCL the blocking send must join the queued receive's group, else each rank's receive
    waits for a send queued behind the other rank's receive."""
    nccl = FakeNccl()

    def body(world):
        r = world.rank
        into = device(np.zeros(3))
        work = ax.irecv(into, 1 - r, tag=4)
        ax.send(device(np.full(3, float(r + 1))), 1 - r, tag=4)
        work.wait()
        return into.get().tolist()

    assert run_device_world(body, 2, nccl) == [[2.0] * 3, [1.0] * 3]


def test_a_queued_device_send_is_issued_before_its_rank_waits_on_the_host(fake_cupy):
    """A pipeline's pattern: stage 0 sends its output with isend, then waits on the host for a message the next
    stage sends only once it has that output (interleaved 1F1B's shape header)."""
    nccl = FakeNccl()

    def body(world):
        if world.rank == 0:
            work = ax.isend(device(np.arange(4.0)), 1, tag=3)
            reply = np.zeros(1)
            ax.recv(reply, 1, tag=4)  # host: over the host backend, not NCCL
            work.wait()
            return reply.tolist()
        got = device(np.zeros(4))
        ax.recv(got, 0, tag=3)
        ax.send(np.array([float(got.get().sum())]), 0, tag=4)
        return None

    assert run_device_world(body, 2, nccl)[0] == [6.0]
