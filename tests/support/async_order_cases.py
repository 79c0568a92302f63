"""Asynchronous calls that the other ranks make blocking, and later, while this rank goes on to other groups.

MPI lets a rank start nonblocking collectives and go on to calls of other groups before it waits; a rank that
makes the same calls blocking, or in another order allowed by MPI, must not be left waiting for good. Each case is
a hang the fuzzer of valid programs found (``fuzz_program_cases``), reduced. Run on threads and MPI ranks with
shared memory on and off (``tests/collectives/test_async_order.py``); only ranks 0 and 1 differ, the others (if
any) take part in the world's calls, blocking.
"""
import numpy as np

import axonhpc as ax


def case_a_call_whose_check_is_back_is_issued_while_another_groups_call_starts(world):
    # Rank 0's first call (group `other`) waits for its check while rank 0 starts the world's next calls; issuing
    # one of those waited for its own check and issued nothing of the other groups meanwhile, while rank 1, which
    # makes the calls blocking, waited in `other`'s call for good.
    r = world.rank
    other = world.new_group([0, 1])
    a, b, c = np.ones(3), np.ones(3), np.ones(3)
    if r == 0:
        works = [ax.all_reduce(a, group=other, async_op=True), ax.all_reduce(b, async_op=True),
                 ax.all_reduce(c, async_op=True)]
        for work in works:
            work.wait()
    else:
        if r == 1:
            ax.all_reduce(a, group=other)
        ax.all_reduce(b)
        ax.all_reduce(c)
    n = world.world_size
    assert (b == n).all() and (c == n).all() and (r > 1 or (a == 2).all()), (a, b, c)


def case_an_asynchronous_call_that_mpi_carries_returns_before_the_others_come(world):
    # With shared memory on, an asynchronous call the node's engine does not carry (a barrier, a gather, an
    # all-gather over the engine's limit) waited in the engine's comparison of the call for every rank of its
    # group, while rank 1 was in the world's all-reduce, blocking, which rank 0 had not started yet.
    r = world.rank
    other = world.new_group([0, 1])
    calls = {"barrier": lambda **kw: ax.barrier(group=other, **kw),
             "gather": lambda **kw: ax.gather(np.full(3, float(r)), dst=0, group=other, **kw),
             "all_gather": lambda **kw: ax.all_gather(np.full(40_000, float(r)), group=other, **kw)}
    for name, call in calls.items():
        x = np.ones(3)
        got = None
        if r == 0:
            first = call(async_op=True)
            second = ax.all_reduce(x, async_op=True)
            got = first.wait()
            second.wait()
        else:
            ax.all_reduce(x)
            if r == 1:
                got = call()
        assert (x == world.world_size).all(), (name, x)
        if name == "gather" and r == 0:
            assert (got == [[0.0] * 3, [1.0] * 3]).all(), got
        if name == "all_gather" and r < 2:
            assert (got == np.array([0.0, 1.0])[:, None]).all(), got[:, :2]


def case_an_asynchronous_call_after_calls_its_group_expected_to_carry_returns_at_once(world):
    # After a few small all-reduces the group expects the next to carry its check (``carried``): an asynchronous
    # one made that fused call blocking, waiting for rank 1, which was in a barrier of another group first.
    r = world.rank
    other = world.new_group([0, 1])
    for _ in range(6):
        x = np.ones(3)
        ax.all_reduce(x)
        assert (x == world.world_size).all()
    x = np.ones(3)
    if r == 0:
        work = ax.all_reduce(x, async_op=True)
        ax.barrier(group=other)
        work.wait()
    else:
        if r == 1:
            ax.barrier(group=other)
        ax.all_reduce(x)
    assert (x == world.world_size).all(), x


_BIG = 1 << 17  # float64 elements: 1 MiB, past MPI's eager limit (MPICH and Open MPI hand it over in rendezvous)


def case_a_posted_receive_is_advanced_while_its_rank_waits_in_the_nodes_engine(world):
    # Rank 0 posts a receive of a large message, then enters the world's all-reduce (the node's engine); rank 1
    # sends the message, blocking, then enters the all-reduce. MPI hands a large message over only while the
    # receiver's MPI makes progress: rank 0 waited inside the engine, which made none, and rank 1 in its send.
    r = world.rank
    x = np.ones(3)
    if r == 0:
        msg = np.zeros(_BIG)
        work = ax.irecv(msg, src=1, tag=4)
        ax.all_reduce(x)
        work.wait()
        assert (msg == np.arange(_BIG)).all()
    else:
        if r == 1:
            ax.send(np.arange(_BIG, dtype=np.float64), dst=0, tag=4)
        ax.all_reduce(x)
    assert (x == world.world_size).all(), x


def case_a_nonblocking_scatter_is_advanced_while_its_rank_waits_in_the_nodes_engine(world):
    # Rank 0 starts a scatter of group `other` (its part: 1 MiB from rank 1), then enters the world's all-reduce;
    # rank 1 scatters, blocking, then enters the all-reduce. Rank 0's part is received only once its header is
    # in and the part issued and moved, all of which needed rank 0's MPI progress, which the engine's wait did
    # not make: rank 1 waited in the scatter, rank 0 in the engine.
    r = world.rank
    other = world.new_group([0, 1])
    x = np.ones(3)
    if r == 0:
        work = ax.scatter(None, src=1, group=other, async_op=True)
        ax.all_reduce(x)
        part = work.wait()
        assert (part == np.arange(_BIG)).all()
    else:
        if r == 1:
            part = ax.scatter(np.stack([np.arange(_BIG, dtype=np.float64)] * 2), src=1, group=other)
            assert (part == np.arange(_BIG)).all()
        ax.all_reduce(x)
    assert (x == world.world_size).all(), x


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}
