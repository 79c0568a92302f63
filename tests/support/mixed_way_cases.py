"""Ranks that make the same collective blocking on some and nonblocking on others get its result everywhere.

MPI never matches a blocking collective with a nonblocking one, so a rank that passed ``async_op=True``
(or waits under a timeout) beside ranks that did not used to wait forever wherever MPI carried the call:
across nodes, with shared memory off, and on one node for an all-gather too large for the engine
([Note: blocking and nonblocking twins] in ``collectives/agreement.py``). Each case runs every
collective with some ranks' calls nonblocking. Run on threads and on MPI ranks with the shared-memory
path on and off
(``tests/collectives/test_mixed_ways.py``).
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.errors import CollectiveMismatchError, ShapeError


def _call(world, nonblocking, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, nonblocking (its Work waited for) on the ranks where ``nonblocking`` holds."""
    if nonblocking:
        return fn(*args, async_op=True, **kwargs).wait()
    return fn(*args, **kwargs)


def _every_collective(world, nonblocking):
    n, r = world.world_size, world.rank
    for size, dtype in ((3, np.float64), (200_000, np.float32), (5, np.float16), (7, np.int32)):
        x = np.full(size, r + 1, dtype=dtype)
        _call(world, nonblocking, ax.all_reduce, x)
        assert (x == n * (n + 1) // 2).all(), (size, dtype, x[:4])
    x = np.full(4, float(r))
    _call(world, nonblocking, ax.all_reduce, x, op="max")
    assert (x == n - 1).all()
    x = np.full(6, 2.0 * r)
    _call(world, nonblocking, ax.all_reduce, x, op="mean")
    assert np.allclose(x, n - 1)
    for size in (5, 100_000):  # the larger one's result is over the engine's limit: MPI carries it
        x = np.full(size, r, dtype=np.float32) if r == n - 1 else np.zeros(size, dtype=np.float32)
        _call(world, nonblocking, ax.broadcast, x, src=n - 1)
        assert (x == n - 1).all()
        got = _call(world, nonblocking, ax.all_gather, np.full(size, r, dtype=np.int64))
        assert (got == np.arange(n)[:, None]).all()
    got = _call(world, nonblocking, ax.reduce_scatter, np.ones(3 * n))
    assert (got == n).all() and got.shape == (3,)
    got = _call(world, nonblocking, ax.gather, np.full(2, r), dst=0)
    assert (got == np.arange(n)[:, None]).all() if r == 0 else got is None
    parts = np.arange(2 * n, dtype=np.float64).reshape(n, 2) if r == 1 % n else None
    got = _call(world, nonblocking, ax.scatter, parts, src=1 % n)
    assert (got == [2 * r, 2 * r + 1]).all()
    _call(world, nonblocking, ax.barrier)


def _twice(world, nonblocking):
    for _ in range(2):  # twice: the second time the MPI check expects the call (``carried``)
        _every_collective(world, nonblocking)


def case_first_rank_nonblocking(world):
    _twice(world, world.rank == 0)


def case_last_rank_nonblocking(world):
    _twice(world, world.rank == world.world_size - 1)


def case_all_but_the_first_nonblocking(world):
    _twice(world, world.rank != 0)


def case_ways_change_from_call_to_call(world):
    for step in range(4):
        _every_collective(world, (world.rank + step) % 2 == 0)


def case_groups_made_after_a_call_still_waiting_for_its_check(world):
    # new_group and split compare their arguments over the group's communicator; a rank whose nonblocking
    # call had not been issued yet (it waits for its check) sent that first, and the ranks that made the
    # call blocking waited in it for good (over MPI).
    n, r = world.world_size, world.rank
    for make in (lambda: world.new_group(list(range(n))), lambda: world.split(r % 2),
                 lambda: world.default_group.split(0, n - r, name="reversed")):
        x = np.full(4, float(r))
        work = ax.all_reduce(x, op=ax.ReduceOp.MAX, async_op=True) if r == 0 else ax.all_reduce(x, op="max")
        group = make()
        if work is not None:
            work.wait()
        assert (x == n - 1).all(), x
        y = np.ones(2)
        ax.all_reduce(y, group=group)
        assert (y == group.size).all(), (y, group.size)


def case_another_groups_calls_while_one_waits_for_its_check(world):
    # Rank 0's nonblocking call waits unissued for its check; it goes on to calls on another group. A rank
    # that made the call blocking waits in it, then reaches those calls: over MPI both used to wait for
    # good. Then the other order, which MPI allows too: the others make the other group's calls first.
    n, r = world.world_size, world.rank
    other = world.new_group(list(range(n)))
    # On one node the engine makes a nonblocking call before returning (docs/performance.md): rank 0 would
    # wait in it while the others wait in the other group's calls. Over MPI both orders work.
    for others_first in (False, True) if ax.settings.shm_collectives == "off" else (False,):
        x = np.full(4, float(r))
        work = ax.all_reduce(x, op=ax.ReduceOp.MAX, async_op=True) if r == 0 else None
        if r != 0 and not others_first:
            ax.all_reduce(x, op=ax.ReduceOp.MAX)
        small, large = np.ones(3), np.ones(70_000)
        ax.all_reduce(small, group=other)
        ax.all_reduce(large, group=other)
        got = ax.all_gather(np.full(2, r), group=other)
        ax.barrier(group=other)
        if r != 0 and others_first:
            ax.all_reduce(x, op=ax.ReduceOp.MAX)
        if work is not None:
            work.wait()
        assert (x == n - 1).all() and (small == n).all() and (large == n).all(), (others_first, x, small[0])
        assert (got == np.arange(n)[:, None]).all(), got
    # A message sent or received meanwhile, both ways, small and large (MPI_Send waits for the receive).
    for size, sender in ((4, 0), (4, 1), (200_000, 0), (200_000, 1)):
        x = np.full(4, float(r))
        work = ax.all_reduce(x, op=ax.ReduceOp.MAX, async_op=True) if r == 0 else None
        if r != 0:
            ax.all_reduce(x, op=ax.ReduceOp.MAX)
        if r == sender:
            ax.send(np.full(size, 7.0), dst=1 - sender)
        elif r == 1 - sender:
            got = np.zeros(size)
            ax.recv(got, src=sender)
            assert (got == 7.0).all(), (size, sender, got[:2])
        if work is not None:
            work.wait()
        assert (x == n - 1).all(), (size, sender, x)
    x = np.ones(5)
    ax.all_reduce(x)  # and the fast path again
    assert (x == n).all()


def case_a_mismatch_found_while_another_groups_call_waits(world):
    # Rank 0's nonblocking call differs from the others' blocking one; rank 0 learns it while it waits in a
    # call on another group (the wait issues calls whose check is back): the call is never issued, its wait
    # raises the mismatch, and the other group's call completes.
    n, r = world.world_size, world.rank
    other = world.new_group(list(range(n)))
    y = np.ones(3)
    if r == 0:
        try:
            work = ax.all_reduce(np.ones(3), async_op=True)
        except CollectiveMismatchError:  # the node's engine compares the call as it makes it
            work = None
        ax.all_reduce(y, group=other)
        if work is not None:
            with pytest.raises(CollectiveMismatchError):
                work.wait()
    else:
        with pytest.raises(CollectiveMismatchError):
            ax.all_reduce(np.ones(4))
        ax.all_reduce(y, group=other)
    assert (y == n).all(), y
    x = np.ones(2)
    ax.all_reduce(x)
    assert (x == n).all(), x


def case_asynchronous_calls_of_two_groups_in_opposite_orders(world):
    # MPI lets a rank start nonblocking calls of two groups in any order. The node's engine used to complete an
    # asynchronous call before returning, so with shared memory on, ranks entering two groups of the same ranks
    # in opposite orders each waited in the first group's call for good (a DeadlockError after 30 s). Each
    # collective the engine carries, one chunk and many (4 KiB slots in test_shm_collectives do more), waited for
    # in either order; then calls of the other group made blocking, a message, an all-gather too large for the
    # engine (MPI, polled), and a group made, all while a call is in flight.
    n, r = world.world_size, world.rank
    a, b = world.new_group(list(range(n))), world.new_group(list(range(n)))
    flip = r % 2 == 1
    for size in (5, 300_000):
        x, y = np.full(size, r + 1.0), np.full(size, 10.0 * (r + 1))
        first, second = ((b, y), (a, x)) if flip else ((a, x), (b, y))
        works = [ax.all_reduce(v, group=g, async_op=True) for g, v in (first, second)]
        for work in (works[::-1] if r % 3 == 2 else works):
            work.wait()
        assert (x == n * (n + 1) / 2).all() and (y == 10 * n * (n + 1) / 2).all(), (size, x[:2], y[:2])
        parts = np.arange(n * 4 * size, dtype=np.float64).reshape(n * size, 4) + r
        calls = [(a, lambda g: ax.reduce_scatter(parts, group=g, async_op=True)),
                 (b, lambda g: ax.broadcast(z, src=n - 1, group=g, async_op=True)),
                 (a, lambda g: ax.all_gather(np.full(3, r), group=g, async_op=True))]
        z = np.full(size, float(r))
        order = [calls[1], calls[0], calls[2]] if flip else calls  # each group's calls in one order everywhere
        results = {id(g_call): g_call[1](g_call[0]) for g_call in order}
        mine = results[id(calls[0])].wait()
        expected = (np.arange(n * 4 * size, dtype=np.float64).reshape(n * size, 4) * n + n * (n - 1) / 2)
        np.testing.assert_array_equal(mine, expected[r * size:(r + 1) * size])
        results[id(calls[1])].wait()
        assert (z == n - 1).all(), z[:3]
        got = results[id(calls[2])].wait()
        assert (got == np.arange(n)[:, None]).all(), got
    x = np.full(1000, r + 1.0)
    work = ax.all_reduce(x, group=a, async_op=True) if r == 0 else None
    if r != 0:
        ax.all_reduce(x, group=a)  # blocking here, in flight on rank 0 while it makes the calls below
    small = np.ones(7)
    ax.all_reduce(small, group=b)  # made blocking on every rank
    gathered = ax.all_gather(np.full(50_000, float(r)), group=b)  # over MPI: too large for the engine
    if n > 1:
        if r == 0:
            ax.send(np.full(100_000, 7.0), dst=1, group=b)
        elif r == 1:
            got = np.zeros(100_000)
            ax.recv(got, src=0, group=b)
            assert (got == 7.0).all()
    made = world.new_group(list(range(n)))
    if work is not None:
        work.wait()
    assert (x == n * (n + 1) / 2).all() and (small == n).all(), (x[:2], small)
    assert (gathered == np.arange(n)[:, None]).all()
    done = np.ones(2)
    ax.all_reduce(done, group=made)
    assert (done == n).all()


def case_a_group_made_while_another_groups_call_is_in_flight_on_one_rank(world):
    # MPI progresses a rank's nonblocking calls while it makes a communicator. Rank 0 starts a call on group a,
    # then makes a group; the others make that group first, then call a. Completing rank 0's call before the
    # group was made waited for good. Then the same with every rank's call in flight, in both orders.
    n, r = world.world_size, world.rank
    a = world.new_group(list(range(n)))
    for blocking in (True, False):
        x = np.full(300_000 if blocking else 5, r + 1.0)
        if r == 0:
            work = ax.all_reduce(x, group=a, async_op=True)
            made = world.new_group(list(range(n)))
            work.wait()
        else:
            made = world.new_group(list(range(n)))
            _call(world, not blocking, ax.all_reduce, x, group=a)
        assert (x == n * (n + 1) / 2).all(), (blocking, x[:2])
        done = np.ones(2)
        ax.all_reduce(done, group=made)
        assert (done == n).all()
    y = np.full(1000, r + 1.0)
    work = ax.all_gather(y, group=a, async_op=True)
    made = world.new_group(list(range(n)), name="made with calls in flight")
    ones = np.ones(3)
    z = ax.all_reduce(ones, group=made, async_op=True)
    got = {id(w): w.wait() for w in ((z, work) if r % 2 else (work, z))}
    assert (got[id(work)] == np.arange(1, n + 1)[:, None]).all() and (ones == n).all(), (got, ones)


def case_a_scatter_made_while_another_groups_call_waits(world):
    # A rank with a nonblocking call of another group still waiting for its check (or in flight in the node's
    # engine) makes a blocking scatter nonblocking. Its check told the others the scatter was blocking, so they
    # waited in MPI_Scatter while it sent MPI_Iscatter, for good. The rank that waits is the source, then not.
    n, r = world.world_size, world.rank
    other = world.new_group(list(range(n)))
    for waiter, src in ((n - 1, n - 1), (n - 1, 0), (0, n - 1)):
        a = np.full(3, r + 1.0)
        parts = np.arange(2 * n, dtype=np.float64).reshape(n, 2) if r == src else None
        if r == waiter:
            work = ax.all_reduce(a, group=other, async_op=True)
            got = ax.scatter(parts, src=src)
            work.wait()
        else:
            got = ax.scatter(parts, src=src)
            ax.all_reduce(a, group=other)
        assert (a == n * (n + 1) / 2).all() and (got == [2 * r, 2 * r + 1]).all(), (waiter, src, a, got)


def case_a_nonblocking_scatter_returns_before_the_others_come(world):
    # scatter(async_op=True) waited for its check and its header, both blocking, before it returned: the source
    # went on to a nonblocking all-reduce of the world only after the others had come to the scatter, and they
    # made that all-reduce first, blocking. Then the receivers nonblocking and the source blocking.
    n, r = world.world_size, world.rank
    other = world.new_group(list(range(n)))
    for async_source in (True, False):
        nonblocking = (r == 0) == async_source
        x = np.full(3, r + 1.0)
        parts = np.arange(2 * n, dtype=np.float64).reshape(n, 2) if r == 0 else None
        if nonblocking:
            scattered = ax.scatter(parts, src=0, group=other, async_op=True)
            reduced = ax.all_reduce(x, async_op=True)
            got = scattered.wait()
            reduced.wait()
        else:
            ax.all_reduce(x)
            got = ax.scatter(parts, src=0, group=other)
        assert (x == n * (n + 1) / 2).all() and (got == [2 * r, 2 * r + 1]).all(), (async_source, x, got)


def case_nonblocking_scatters_then_the_groups_next_calls(world):
    # Two nonblocking scatters of different shapes and sources, then the group's next calls before either is
    # waited for, the scatters waited in the other order, beside ranks that made them all blocking: each part
    # follows its own header, ahead of the calls made after it. Then a source with a wrong array: every rank's
    # wait raises, and the group's next call is made alike.
    n, r = world.world_size, world.rank
    other = world.new_group(list(range(n)))
    # With shared memory on, the ranks that make the scatters nonblocking beside blocking ones are left out: a
    # rank whose MPI_Iscatter is in flight then waits in the node's engine (the next scatter's check, the
    # all-reduce), which does not advance MPI, while a blocking rank waits in MPI_Scatter for that rank's part
    # of the tree (3 ranks and more; the engine's waits drive only the checks and the engine's calls).
    for nonblocking in (r == 0, r != 0, True) if ax.settings.shm_collectives == "off" else (True,):
        first = np.arange(2 * n, dtype=np.float64).reshape(n, 2) if r == 0 else None
        second = np.arange(3 * n, dtype=np.int32).reshape(n, 3) if r == n - 1 else None
        y = np.full(4, r + 1.0)
        if nonblocking:
            works = [ax.scatter(first, src=0, group=other, async_op=True),
                     ax.scatter(second, src=n - 1, group=other, async_op=True)]
            ax.all_reduce(y, group=other)
            gathered = ax.all_gather(np.full(2, r), group=other)
            b, a = works[1].wait(), works[0].wait()
        else:
            a = ax.scatter(first, src=0, group=other)
            b = ax.scatter(second, src=n - 1, group=other)
            ax.all_reduce(y, group=other)
            gathered = ax.all_gather(np.full(2, r), group=other)
        assert (a == [2 * r, 2 * r + 1]).all() and a.dtype == np.float64, (nonblocking, a)
        assert (b == [3 * r, 3 * r + 1, 3 * r + 2]).all() and b.dtype == np.int32, (nonblocking, b)
        assert (y == n * (n + 1) / 2).all() and (gathered == np.arange(n)[:, None]).all(), (nonblocking, y)
    for nonblocking in (r == 0, r != 0):
        bad = np.zeros((n + 1, 2)) if r == 0 else None
        with pytest.raises(ShapeError, match="scatter: the source array on group rank 0"):
            if nonblocking:
                ax.scatter(bad, src=0, group=other, async_op=True).wait()
            else:
                ax.scatter(bad, src=0, group=other)
        z = np.ones(2)
        ax.all_reduce(z, group=other)
        assert (z == n).all(), z


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def arrivals_compared_after_a_call_still_waiting_for_its_check(world, every):
    # Run with ``settings.straggler_every`` set to ``every``. The straggler comparison's gather came right
    # after a nonblocking call whose check had not been waited for: that rank had not issued the call the
    # blocking ranks waited in, and every rank waited for good.
    for step in range(3 * every + 1):
        x = np.full(4, float(world.rank))
        _call(world, (world.rank + step) % 2 == 0, ax.all_reduce, x, op=ax.ReduceOp.MAX)
        assert (x == world.world_size - 1).all(), (step, x)
        got = _call(world, world.rank == step % world.world_size, ax.all_gather, np.full(3, world.rank))
        assert (got == np.arange(world.world_size)[:, None]).all(), (step, got)


COMPARED_CASES = {"arrivals_compared_after_a_call_still_waiting_for_its_check":
                  arrivals_compared_after_a_call_still_waiting_for_its_check}
