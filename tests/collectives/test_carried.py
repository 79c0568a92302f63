"""A small all-reduce the group expects carries its agreement check: the rule, the compiled helpers, and the
cases of ``carried_cases`` on threads and on MPI ranks (shared memory off, so MPI carries every call)."""
import numpy as np
import pytest

from axonhpc._ext import _shm
from axonhpc.backends.base import ReduceOp
from axonhpc.collectives import carried
from axonhpc.collectives.agreement import describe
from support.carried_cases import CASES
from support.runner import case_tests


test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES, sizes=(2, 3, 4), min_size=2, shm="off")


def _desc(n, dtype=np.float64, op="SUM"):
    return describe("all_reduce", np.zeros(n, dtype=dtype), op)


def test_the_rule_expects_what_followed_the_last_three_calls():
    p = carried.Predictor(3)
    a, b = _desc(4), _desc(5)
    for d in (a, a, b, a, a, b, a, a):
        p.record(d, None)
    assert p.expected().desc == b
    p.record(b, None)
    assert p.expected().desc == a
    p.forget()
    assert p.expected() is None


def _hits(p, calls):
    """Record ``calls``; how many the rule expected."""
    hits = 0
    for d in calls:
        plan = p.expected()
        hits += plan is not None and plan.desc == d
        p.record(d, None)
    return hits


def test_a_loop_is_learnt_and_one_surprise_does_not_unlearn_it():
    p = carried.Predictor(2)
    a, b = _desc(4), _desc(6)
    loop = [a] * 5 + [b]
    _hits(p, loop)
    _hits(p, loop)
    # From the third pass on, every call but the last (b comes after five a, more than the rule looks back)
    assert _hits(p, loop) == 5 and _hits(p, loop) == 5
    p1 = carried.Predictor(2)
    for _ in range(3):
        _hits(p1, [a, a, b])
    assert _hits(p1, [a, a, b] * 3) == 9
    p2 = carried.Predictor(2)
    _hits(p2, [a] * 8)
    _hits(p2, [b])  # (a, a, a) was followed by a five times, by b once: it still expects a
    _hits(p2, [a] * 3)
    assert p2.expected().desc == a
    for _ in range(3):  # b keeps coming after (a, a, a): the guess moves
        _hits(p2, [b, a, a, a])
    assert p2.expected().desc == b


def test_a_call_some_rank_cannot_carry_is_not_tried_again():
    p = carried.Predictor(2)
    a = _desc(4)
    for _ in range(4):
        p.record(a, None)
    tried = p.expected()
    p.record(a, tried)  # the expected call, made by every rank, not carried
    assert tried.declined and p.expected() is None


def test_guesses_that_keep_failing_are_given_up():
    p = carried.Predictor(2)
    calls = [_desc(n) for n in range(1, 5)]
    rng = np.random.default_rng(0)
    for k in range(2000):
        tried = p.expected()
        actual = calls[rng.integers(4)]
        if tried is not None and tried.desc == actual:
            p.carried(tried)
        else:
            p.record(actual, tried)
    assert all(plan.declined for plan in p.plans.values())
    assert carried._MISSES < p.misses <= carried._MISSES + len(calls)


@pytest.mark.parametrize("dtype,op,carriable", [
    (np.float32, "SUM", True), (np.float64, "PRODUCT", True), (np.int32, "MIN", True), (np.int64, "MAX", True),
    (np.float16, "SUM", False), (np.uint8, "SUM", False), (np.float64, "AVG", False)])
def test_what_can_be_carried(dtype, op, carriable):
    assert carried.Plan(_desc(8, dtype, op), 4).carriable is carriable


def test_only_small_host_all_reduces_are_carried():
    limit = carried.MAX_BYTES // 4
    assert carried.Plan(_desc(limit, np.float32), 2).carriable
    assert not carried.Plan(_desc(limit + 1, np.float32), 2).carriable
    assert not carried.Plan(_desc(0, np.float32), 2).carriable
    assert not carried.Plan(describe("broadcast", np.zeros(4), None, 0), 2).carriable
    assert not carried.Plan(_shm.describe("all_reduce", np.float32, (4,), "SUM", device=True), 2).carriable
    assert not carried.Plan(_shm.describe("all_reduce", np.float32, (4,), "SUM", elsewhere=True), 2).carriable


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_carry_puts_the_vote_first_and_takes_the_result_only_on_all_yes(dtype):
    buf = np.full(4, 9, dtype=dtype)
    x = np.arange(3, dtype=dtype)
    _shm.carry_in(buf, x, 1)
    assert buf.tolist() == [1, 0, 1, 2]
    _shm.carry_in(buf, None, 0)
    assert buf.tolist() == [0, 0, 0, 0]

    def reduce():  # what the other ranks would add: two more yes votes and their data
        buf[0] += 2
        buf[1:] += 10

    assert _shm.carry(buf, x, reduce, 1, 3) and x.tolist() == [10, 11, 12]
    assert not _shm.carry(buf, x, lambda: None, 0, 3) and x.tolist() == [10, 11, 12]
    assert _shm.carry_out(buf, None, 0)


def test_carry_refuses_a_buffer_that_does_not_fit():
    buf = np.zeros(5, dtype=np.float32)
    for bad in (np.zeros(5, dtype=np.float32), np.zeros(4), np.zeros(8, dtype=np.float32)[::2]):
        with pytest.raises(ValueError, match="carry"):
            _shm.carry_in(buf, bad, 1)
    ro = np.zeros(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _shm.carry_out(buf, ro, 1)
    with pytest.raises(ValueError, match="float32, float64"):
        _shm.carry_in(np.zeros(3, dtype=np.uint8), None, 1)
    with pytest.raises(TypeError, match="numpy array"):
        _shm.carry_in(buf, [1, 2, 3, 4], 1)


def test_votes_show_exactly_whether_all_said_yes():
    # Each op's reduction of yes and no votes equals all-yes only when every vote is yes.
    import itertools
    for code, (op, yes, no, all_yes) in carried._VOTES.items():
        for n in (2, 3, 4):
            for votes in itertools.product((yes, no), repeat=n):
                fold = {ReduceOp.SUM: sum, ReduceOp.PRODUCT: np.prod, ReduceOp.MIN: min, ReduceOp.MAX: max}[op]
                assert (fold(votes) == all_yes(n)) == all(v == yes for v in votes), (op, votes)
