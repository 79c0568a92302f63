"""The NCCL backend's envelopes over each host backend (threads, and MPI under mpiexec), with host arrays as
the receive buffers they describe ([Note: envelopes] in ``axonhpc.backends.nccl_envelopes``).

On a GPU the envelopes travel over MPI while the data goes over NCCL; here only the envelopes travel, which is
the part that must hold on every MPI: each rank announces messages to the rank on its right and the right
rank's receives take them in order, whatever order they are checked in.
"""
import numpy as np
import pytest

from axonhpc.backends.nccl_envelopes import Envelopes
from axonhpc.errors import ShapeError, UsageError


def _envelopes(world):
    backend = world.default_group.backend
    return Envelopes(backend.split(0, backend.rank), lambda r: backend.global_ranks[r])


def _ring(world):
    n, r = world.world_size, world.rank
    return (r + 1) % n, (r - 1) % n


def case_envelopes_in_the_order_sent_are_checked_whatever_order_the_receives_are_checked_in(world):
    env = _envelopes(world)
    right, left = _ring(world)
    sent = [(1, np.zeros(3, np.float32)), (2, np.zeros(5, np.int64)), (1, np.zeros(2)), (9, np.zeros(1, np.uint8))]
    for step in range(20):
        for tag, buf in sent:
            env.announce(buf, right, tag)
        expected = [env.expect(np.empty_like(buf), left, tag) for tag, buf in sent]
        order = expected[::-1] if step % 2 else expected[1::2] + expected[::2]
        for e in order:
            env.check(e)
        assert all(e.checked and e.error is None for e in expected)
    env.free()


def case_a_receive_out_of_order_or_of_another_dtype_or_size_is_refused_naming_both(world):
    env = _envelopes(world)
    right, left = _ring(world)
    peer = world.default_group.backend.global_ranks[left]
    env.announce(np.zeros(4, np.float32), right, 1)
    env.announce(np.zeros(4, np.float32), right, 2)
    with pytest.raises(UsageError, match=rf"^recv from rank {peer} tag 2: the next device array rank {peer} sent "
                                         r"this rank has tag 1 \(4 elements of float32\)"):
        env.check(env.expect(np.empty(4, np.float32), left, 2))
    env.check(env.expect(np.empty(4, np.float32), left, 2))  # the next one is the tag-2 array, as sent
    for buf, said in ((np.empty(4, np.int32), r"4 elements of int32 \(16 bytes; shape \(4,\)\)"),
                      (np.empty((2, 3), np.float32), r"6 elements of float32 \(24 bytes; shape \(2, 3\)\)")):
        env.announce(np.zeros(4, np.float32), right, 5)
        with pytest.raises(ShapeError, match=rf"^recv from rank {peer} tag 5: the incoming message holds 4 elements "
                                             rf"of float32, but the receive buffer is {said}"):
            env.check(env.expect(buf, left, 5))
    env.free()


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}
