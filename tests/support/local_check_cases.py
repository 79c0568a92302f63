"""Checks made before any message, alike on every rank (issue 18): cases run on threads and on MPI ranks.

Each case takes a world, makes every rank raise the documented error, and
then proves that nobody was left waiting: the group runs an all-reduce (or a
correct message) afterwards and gets the right answer. Used by
``tests/collectives/test_local_checks.py`` (``run_local`` at several world sizes, and
real MPI ranks under mpiexec).
"""
import re

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.errors import (CollectiveRefusedError, ConfigurationError, GroupMismatchError, InvalidArgumentError,
                            NonContiguousBufferError, RankError, ReadOnlyBufferError, ShapeError,
                            UnsupportedDtypeError)


def _in_step(world, group=None):
    """Every rank of the group is still in step: an all-reduce of ones gives the group size."""
    pg = group or world.default_group
    y = np.ones(1)
    ax.all_reduce(y, group=pg)
    assert y[0] == pg.size


def case_read_only_broadcast_is_refused_on_every_rank(world):
    n = world.world_size
    for src in range(n):
        x = np.arange(4.0)
        x.flags.writeable = False
        with pytest.raises(ReadOnlyBufferError) as info:
            ax.broadcast(x, src=src)
        text = str(info.value)
        assert f"group rank {world.rank}" in text and f"src={src}" in text and "read-only" in text
        if world.rank == src:
            assert "(the source)" in text
        _in_step(world)
    # The same through the asynchronous path.
    x = np.zeros(3)
    x.flags.writeable = False
    with pytest.raises(ReadOnlyBufferError):
        ax.broadcast(x, src=0, async_op=True)
    y = np.full(3, 5.0) if world.rank == 0 else np.zeros(3)
    ax.broadcast(y, src=0)
    assert y.tolist() == [5.0] * 3


def case_new_group_with_different_lists_raises_on_every_rank(world):
    n = world.world_size
    if n == 1:
        return
    mine = list(range(n))[::-1] if world.rank == 0 else list(range(n))
    with pytest.raises(GroupMismatchError) as info:
        world.new_group(mine)
    text = str(info.value)
    assert f"rank 0 passed {list(range(n))[::-1]}" in text
    others = list(range(1, n))
    assert f"rank{'s' if len(others) > 1 else ''} {others if len(others) > 1 else others[0]} passed {list(range(n))}" \
        in text, text
    _in_step(world)
    # One rank's list is invalid (out of range), the others' fine: every rank raises, naming it.
    mine = [n + 5] if world.rank == n - 1 else [0]
    with pytest.raises(GroupMismatchError, match=rf"rank {n - 1} passed \[{n + 5}\]"):
        world.new_group(mine)
    _in_step(world)
    # Every rank passes the same invalid list: every rank raises the local RankError.
    with pytest.raises(RankError, match="repeat"):
        world.new_group([0, 0])
    _in_step(world)
    # And a good call still works after all that.
    pg = world.new_group(list(range(n)))
    _in_step(world, pg)


def case_split_with_a_bad_color_on_one_rank_raises_on_every_rank(world):
    n = world.world_size
    if n == 1:
        return
    color = "red" if world.rank == 1 else 0
    with pytest.raises(GroupMismatchError) as info:
        world.split(color, key=world.rank)
    assert "rank 1 passed color='red', key=1" in str(info.value)
    _in_step(world)
    with pytest.raises(InvalidArgumentError, match="split key must be an integer, got 0.5"):
        world.split(0, key=0.5)  # every rank: the local error everywhere
    _in_step(world)
    halves = world.split(world.rank % 2, key=world.rank)
    _in_step(world, halves)
    # split of a group compares over that group, and names world ranks.
    if halves.size > 1:
        with pytest.raises(GroupMismatchError, match=re.escape(f"split of group {halves.name}: ") + ".*"
                                                     + re.escape(f"rank {halves.ranks[0]} passed color='x'")):
            halves.split("x" if halves.rank == 0 else 0)
        _in_step(world, halves)
    _in_step(world)


def case_mesh_with_different_sizes_raises_on_every_rank(world):
    n = world.world_size
    if n == 1:
        return
    with pytest.raises(GroupMismatchError) as info:
        world.mesh(dp=n) if world.rank == 0 else world.mesh(tp=n)
    others = list(range(1, n))
    assert f"rank 0 passed mesh(dp={n}, tp=1, pp=1)" in str(info.value)
    assert (f"rank{'s' if n > 2 else ''} {others if n > 2 else 1} passed mesh(dp=1, tp={n}, pp=1)"
            in str(info.value)), str(info.value)
    _in_step(world)


def _pair(world):
    """(this rank's peer, whether it sends) for ranks 0 and 1; None elsewhere."""
    if world.rank == 0:
        return 1, True
    if world.rank == 1:
        return 0, False
    return None


def case_recv_into_a_buffer_of_another_size_names_both(world):
    if world.world_size == 1:
        return
    role = _pair(world)
    for timeout in (None, 60.0):  # with a timeout the blocking recv waits by polling (another code path)
        ax.settings.timeout = timeout
        try:
            if role is not None:
                peer, sender = role
                for sent, buffer in ((np.arange(8.0), np.empty(4)),               # too small
                                     (np.arange(2.0), np.empty(4)),               # too large
                                     (np.arange(4.0), np.empty(4, np.float32))):  # another dtype
                    if sender:
                        ax.send(sent, dst=peer, tag=3)
                    else:
                        with pytest.raises(ShapeError) as info:
                            ax.recv(buffer, src=peer, tag=3)
                        text = str(info.value)
                        assert f"{sent.nbytes} bytes" in text and f"{buffer.nbytes} bytes" in text, text
                        assert "dropped" in text
                # The pair is still in step: the next message arrives whole.
                if sender:
                    ax.send(np.arange(5.0), dst=peer, tag=4)
                else:
                    got = ax.recv(np.empty(5), src=peer, tag=4)
                    assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        finally:
            ax.settings.timeout = None
        _in_step(world)


def case_irecv_of_a_larger_message_raises_a_shape_error(world):
    if world.world_size == 1:
        return
    role = _pair(world)
    if role is not None:
        peer, sender = role
        if sender:
            ax.send(np.arange(8.0), dst=peer, tag=5)
            ax.send(np.arange(2.0), dst=peer, tag=6)
        else:
            work = ax.irecv(np.empty(4), src=peer, tag=5)
            with pytest.raises(ShapeError, match="32 bytes"):
                work.wait()
            work = ax.irecv(np.empty(4), src=peer, tag=6)
            with pytest.raises(ShapeError, match="16 bytes"):
                work.wait()
    _in_step(world)


def case_a_message_of_another_dtype_and_the_same_size_is_refused(world):
    """4 float64 into 8 float32: the same 32 bytes, which MPI alone would fill with garbage. recv (blocking, and
    polled under a timeout) and irecv raise ShapeError naming both dtypes, and the pair stays in step."""
    if world.world_size == 1:
        return
    role = _pair(world)
    for timeout in (None, 60.0):
        ax.settings.timeout = timeout
        try:
            if role is not None:
                peer, sender = role
                if sender:
                    ax.send(np.arange(4.0), dst=peer, tag=7)
                    ax.send(np.arange(4.0), dst=peer, tag=8)
                    ax.send(np.arange(4, dtype=np.int32), dst=peer, tag=9)  # then one that fits
                else:
                    with pytest.raises(ShapeError, match=r"float64.*but the receive buffer is 8 elements of float32"):
                        ax.recv(np.full(8, -1.0, np.float32), src=peer, tag=7)
                    work = ax.irecv(np.full(8, -1.0, np.float32), src=peer, tag=8)
                    with pytest.raises(ShapeError, match=r"float64.*but the receive buffer is 8 elements of float32"):
                        work.wait()
                    got = ax.recv(np.empty(4, np.int32), src=peer, tag=9)
                    assert got.tolist() == [0, 1, 2, 3]
        finally:
            ax.settings.timeout = None
        _in_step(world)


def case_messages_of_two_dtypes_under_one_tag_arrive_in_the_order_sent(world):
    """A flag (uint8) then an array (float64) under one tag, round a ring, as elastic.buddy sends them: the
    array may arrive while the flag's receive waits, and is the next message, not a mismatch. Looked for on
    every poll (CHECK_EVERY 0), irecv and recv alike, many times over: no ShapeError, every value right."""
    if world.world_size == 1 or type(world.default_group.backend).__name__ != "MPIBackend":
        return
    from axonhpc.backends import mpi_p2p

    n, rank = world.world_size, world.rank
    left, right = (rank - 1) % n, (rank + 1) % n
    saved = mpi_p2p.CHECK_EVERY
    mpi_p2p.CHECK_EVERY = 0.0
    try:
        for step in range(300):
            flag_in, data_in = np.zeros(1, np.uint8), np.empty(64)
            sends = [ax.isend(np.full(1, step % 256, np.uint8), dst=right, tag=11),
                     ax.isend(np.full(64, float(step)), dst=right, tag=11)]
            if step % 2:
                ax.irecv(flag_in, src=left, tag=11).wait()
                ax.irecv(data_in, src=left, tag=11).wait()
            else:
                ax.recv(flag_in, src=left, tag=11)
                ax.recv(data_in, src=left, tag=11)
            for work in sends:
                work.wait()
            assert flag_in[0] == step % 256 and (data_in == step).all(), (step, flag_in, data_in[:3])
    finally:
        mpi_p2p.CHECK_EVERY = saved
    _in_step(world)


def case_a_tag_beyond_what_mpi_carries_is_refused(world):
    if world.world_size == 1 or type(world.default_group.backend).__name__ != "MPIBackend":
        return
    from mpi4py import MPI

    largest = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - 7) // 8
    role = _pair(world)
    if role is not None:
        peer, sender = role
        with pytest.raises(ax.errors.InvalidArgumentError, match=rf"tag {largest + 1} is too large: point-to-point "
                                                                 rf"tags go up to {largest}"):
            if sender:
                ax.send(np.arange(4.0), dst=peer, tag=largest + 1)
            else:
                ax.recv(np.empty(4), src=peer, tag=largest + 1)
        if sender:  # the largest tag travels
            ax.send(np.arange(4.0), dst=peer, tag=largest)
        else:
            assert ax.recv(np.empty(4), src=peer, tag=largest).tolist() == [0.0, 1.0, 2.0, 3.0]
    _in_step(world)


def case_blocking_send_to_oneself_is_refused(world):
    x = np.arange(3.0)
    with pytest.raises(RankError, match=f"dst={world.rank} is this rank itself"):
        ax.send(x, dst=world.rank)
    # isend to oneself, then recv, works.
    work = ax.isend(x, dst=world.rank, tag=9)
    got = ax.recv(np.empty(3), src=world.rank, tag=9)
    work.wait()
    assert got.tolist() == [0.0, 1.0, 2.0]
    _in_step(world)


def _one_rank_refuses(world, bad_rank, bad, good, error, match, async_op=False):
    """Rank ``bad_rank`` makes the call ``bad()``, which fails its own checks; the others make ``good()``.

    The refusing rank raises ``error`` (matching ``match``); every other rank raises
    ``CollectiveRefusedError`` naming it and its error; nobody is left waiting (issue 42). Shared memory
    on and off under MPI (threads have none).
    """
    routes = ("auto", "off") if world.default_group.backend.name != "local" else ("auto",)
    for route in routes:
        ax.settings.shm_collectives = route
        try:
            call = bad if world.rank == bad_rank else good
            expected = error if world.rank == bad_rank or world.world_size == 1 else CollectiveRefusedError
            result = None
            with pytest.raises(expected) as info:
                result = call()
                if async_op:
                    result.wait()
            if result is not None:  # the check failed in the wait: waiting again says the same
                with pytest.raises(expected):
                    result.wait()
            if expected is error:
                assert re.search(match, str(info.value)), str(info.value)
            else:
                assert info.value.rank == bad_rank, (info.value.rank, str(info.value))
                assert re.match(r"\w+Error: ", info.value.reason), info.value.reason  # the refusing rank's class
                assert re.search(match, info.value.reason), info.value.reason
                assert f"rank {bad_rank} refused its part before anything was sent" in str(info.value)
            _in_step(world)
        finally:
            ax.settings.shm_collectives = "auto"


def case_a_refusal_on_one_rank_reaches_every_rank(world):
    """Every argument the collectives check, refused on one rank alone (the last, then rank 0)."""
    n = world.world_size
    for bad_rank in sorted({n - 1, 0}):
        frozen = np.zeros(4)
        frozen.flags.writeable = False
        strided = np.zeros(8)[::2]
        refusals = [
            # reduce_scatter: rank 0 with n + 1 elements, the others with 2n (issue 42's example)
            (lambda: ax.reduce_scatter(np.ones(n + 1)), lambda: ax.reduce_scatter(np.ones(2 * n)),
             ShapeError, r"first dimension divisible by the group size" if n > 1 else None),
            (lambda: ax.reduce_scatter(np.ones(2 * n), out=np.empty(3, np.float32)),
             lambda: ax.reduce_scatter(np.ones(2 * n)), ShapeError, r"out is float32 of shape \(3,\)"),
            (lambda: ax.all_reduce(frozen), lambda: ax.all_reduce(np.zeros(4)), ReadOnlyBufferError, "read-only"),
            (lambda: ax.all_reduce(strided), lambda: ax.all_reduce(np.zeros(4)), NonContiguousBufferError,
             "not C-contiguous"),
            (lambda: ax.all_reduce(np.zeros(4, dtype=object)), lambda: ax.all_reduce(np.zeros(4)),
             UnsupportedDtypeError, "dtype object"),
            (lambda: ax.all_reduce([1.0, 2.0]), lambda: ax.all_reduce(np.zeros(2)), UnsupportedDtypeError,
             "must be a numpy or cupy array, got builtins.list"),
            (lambda: ax.all_reduce(np.zeros(4), op="median"), lambda: ax.all_reduce(np.zeros(4)),
             InvalidArgumentError, "median"),
            (lambda: ax.all_reduce(np.zeros(4), algorithm="zigzag"), lambda: ax.all_reduce(np.zeros(4)),
             ConfigurationError, "zigzag"),
            (lambda: ax.broadcast(np.zeros(4), src=n), lambda: ax.broadcast(np.zeros(4), src=0), RankError,
             f"broadcast src={n} is out of range"),
            (lambda: ax.all_gather(np.zeros(2), out=np.empty((n + 1, 2))), lambda: ax.all_gather(np.zeros(2)),
             ShapeError, "all_gather: out is float64"),
            (lambda: ax.gather(np.zeros(2), dst=-1), lambda: ax.gather(np.zeros(2), dst=0), RankError,
             "gather dst=-1 is out of range"),
            (lambda: ax.scatter(None, src=n + 2), lambda: ax.scatter(np.zeros((n, 2)) if world.rank == 0 else None,
                                                                     src=0),
             RankError, f"scatter src={n + 2} is out of range"),
        ]
        for bad, good, error, match in refusals:
            if match is None:
                continue
            _one_rank_refuses(world, bad_rank, bad, good, error, match)
        # The same through the asynchronous path: the others hear it when they wait.
        _one_rank_refuses(world, bad_rank, lambda: ax.reduce_scatter(np.ones(n + 1), async_op=True),
                          lambda: ax.reduce_scatter(np.ones(2 * n), async_op=True), ShapeError,
                          "first dimension divisible" if n > 1 else "^$", async_op=True) if n > 1 else None
        _one_rank_refuses(world, bad_rank, lambda: ax.all_reduce(frozen, async_op=True),
                          lambda: ax.all_reduce(np.zeros(4), async_op=True), ReadOnlyBufferError, "read-only",
                          async_op=True)


def case_a_refusal_on_every_rank_raises_each_ranks_own_error(world):
    n = world.world_size
    if n == 1:
        return
    size = n * (world.rank + 1) + 1  # every rank refuses, each with its own length
    with pytest.raises(ShapeError, match=rf"input shape \({size},\)"):
        ax.reduce_scatter(np.ones(size))
    _in_step(world)


def case_a_refusal_under_debug_mode_reaches_every_rank(world):
    ax.settings.debug = True
    try:
        _one_rank_refuses(world, world.world_size - 1, lambda: ax.all_reduce(np.zeros(4), op="median"),
                          lambda: ax.all_reduce(np.zeros(4)), InvalidArgumentError, "median")
    finally:
        ax.settings.debug = False


def case_sync_gradients_with_an_unusable_gradient_on_one_rank_raises_on_every_rank(world):
    n = world.world_size
    grads = [np.ones(3), np.ones((2, 2))]
    last = world.rank == n - 1
    if last:
        grads[1].flags.writeable = False
    if n == 1:
        with pytest.raises(ReadOnlyBufferError):
            ax.sync_gradients(grads)
        return
    with pytest.raises(ReadOnlyBufferError if last else CollectiveRefusedError) as info:
        ax.sync_gradients(grads)
    assert "gradient 1" in str(info.value), str(info.value)
    if not last:
        assert f"rank {n - 1}" in str(info.value)
    _in_step(world)
    grads = [np.full(3, float(world.rank)), np.full((2, 2), 2.0 * world.rank)]
    ax.sync_gradients(grads)
    assert np.allclose(grads[0], (n - 1) / 2) and np.allclose(grads[1], n - 1)


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
