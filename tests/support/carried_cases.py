"""A small all-reduce the group expects carries its agreement check over MPI (``collectives.carried``).

Each case first makes the ranks repeat a call, so that the group expects it
and carries it in one fused call, then has some rank do something else: a
call of another length, dtype, op or shape, another collective, a refusal,
the same call through the general or the asynchronous path. Every rank must
get what it gets without the fused call: the right sums, or the same
``CollectiveMismatchError`` everywhere, with nothing moved. Run on threads
(``run_local``) and on MPI ranks with shared memory off
(``tests/collectives/test_carried.py``).
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.collectives import carried
from axonhpc.errors import CollectiveRefusedError, ReadOnlyBufferError
from support.agreement_cases import _in_step, _odd, _refused

OPS = {"SUM": sum, "MAX": max, "MIN": min, "PRODUCT": lambda values: np.prod(values)}


def _predictor(world):
    state = world.default_group.collective_state
    assert state is not None and state.check is not None, "no MPI check was made: the group has an engine"
    return state.check[3]


def _carried(world):
    """How many calls the fused call carried so far on the world's group."""
    state = world.default_group.collective_state
    if state is None or state.check is None:
        return 0
    return state.check[3].tries - state.check[3].misses


def _expect(world, shape=(4,), dtype=np.float64, op="SUM", times=6):
    """Repeat an all-reduce of ``shape`` until the group carries it; every result exact."""
    n = world.world_size
    before = _carried(world)
    for k in range(times):
        x = np.full(shape, world.rank + 1 + k, dtype=dtype)
        ax.all_reduce(x, op)
        want = OPS[op]([r + 1 + k for r in range(n)])
        assert (x == want).all(), (x, want)
    assert _carried(world) >= before + times - 4, "the repeated call was not carried"


def case_repeated_calls_are_carried_exactly(world):
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        for op in OPS:
            _expect(world, (3, 2), dtype, op)
    # 64 KiB is carried; one element more is not, and is still right.
    _expect(world, (16384,), np.float32)
    before = _carried(world)
    x = np.ones(16385, dtype=np.float32)
    for _ in range(4):
        x[:] = 1
        ax.all_reduce(x)
        assert (x == world.world_size).all()
    assert _carried(world) == before


def case_a_loop_and_its_end_are_both_right(world):
    # Three calls of one kind, then one of another, again and again: the end of each loop surprises the guess.
    n = world.world_size
    for _ in range(6):
        for _ in range(3):
            x = np.ones(5)
            ax.all_reduce(x)
            assert (x == n).all()
        y = np.full(2, world.rank, dtype=np.int32)
        ax.all_reduce(y, "MAX")
        assert (y == n - 1).all()
    p = _predictor(world)
    assert p.tries - p.misses >= 12


@pytest.mark.parametrize("what", ["longer", "shorter", "dtype", "op", "shape", "broadcast", "barrier"])
def case_expected_call_and_another(world, what):
    _expect(world, (2, 3))
    x = np.full((2, 3), float(world.rank))
    kept = x.copy()
    odd = _odd(world)
    if what == "longer":
        y = np.full(7 if odd else 6, float(world.rank))
        call, texts = (lambda: ax.all_reduce(y)), ("(6,)", "(7,)")
        x, kept = y, y.copy()
    elif what == "shorter":
        y = np.full(5, float(world.rank)) if odd else x
        call, texts = (lambda: ax.all_reduce(y)), ("(2, 3)", "(5,)")
        x, kept = y, y.copy()
    elif what == "dtype":  # the same bytes per rank
        y = np.full(12, world.rank, dtype=np.float32) if odd else x
        call, texts = (lambda: ax.all_reduce(y)), ("float64", "float32")
        x, kept = y, y.copy()
    elif what == "op":
        call, texts = (lambda: ax.all_reduce(x, "MAX" if odd else "SUM")), ("op=SUM", "op=MAX")
    elif what == "shape":
        y = np.full((3, 2), float(world.rank)) if odd else x
        call, texts = (lambda: ax.all_reduce(y)), ("(2, 3)", "(3, 2)")
        x, kept = y, y.copy()
    elif what == "broadcast":
        call = (lambda: ax.broadcast(x, src=0)) if odd else (lambda: ax.all_reduce(x))
        texts = ("all_reduce", "broadcast")
    else:
        call = (lambda: ax.barrier()) if odd else (lambda: ax.all_reduce(x))
        texts = ("all_reduce", "barrier")
    _refused(world, call, *texts)
    assert (x == kept).all(), "an array changed in a call that was refused"
    _expect(world, (2, 3))  # learnt again after the mismatch


def case_expected_call_refused_on_one_rank(world):
    _expect(world, (4,))
    x = np.ones(4)
    if _odd(world):
        x.flags.writeable = False
        with pytest.raises(ReadOnlyBufferError):
            ax.all_reduce(x)
    else:
        with pytest.raises(CollectiveRefusedError) as info:
            ax.all_reduce(x)
        assert f"rank {world.world_size - 1}" in str(info.value)
        assert (x == 1).all()
    _in_step(world)


class _Tagged(np.ndarray):
    """An ndarray subclass: the fast path leaves it to the general path."""


def case_the_general_path_carries_too(world):
    # The odd rank makes the same call through the general path (an ndarray subclass), then every rank does
    # with an op given by name: all of them go in the fused call.
    n = world.world_size
    _expect(world, (4,))
    before = _carried(world)
    for k in range(3):
        x = np.full(4, world.rank + 1.0)
        if _odd(world):
            x = x.view(_Tagged)
        ax.all_reduce(x)
        assert (np.asarray(x) == n * (n + 1) / 2).all()
    for k in range(3):
        x = np.full(4, world.rank + 1.0)
        ax.all_reduce(x, "sum")
        assert (x == n * (n + 1) / 2).all()
    assert _carried(world) == before + 6


def case_expected_call_made_asynchronously(world):
    n = world.world_size
    _expect(world, (4,))
    for _ in range(2):
        x = np.ones(4)
        ax.all_reduce(x, async_op=True).wait()
        assert (x == n).all()
    _expect(world, (5,))
    # Asynchronous calls of another length on one rank are still refused everywhere.
    y = np.ones(6 if _odd(world) else 5)
    _refused(world, lambda: ax.all_reduce(y, async_op=True).wait(), "(5,)", "(6,)")


def case_the_rule_forgets_nothing_it_needs(world):
    # Many calls of different lengths: the rule keeps at most _LIMIT of them and stays right.
    n = world.world_size
    for length in range(1, 40):
        for _ in range(2):
            x = np.ones(length)
            ax.all_reduce(x)
            assert (x == n).all()
    assert len(_predictor(world).buffered) * (carried.MAX_BYTES + 8) <= carried._BUFFER_BYTES


def _expand():
    cases = {}
    for name, fn in list(globals().items()):
        if not name.startswith("case_"):
            continue
        params = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        if not params:
            cases[name[5:]] = fn
            continue
        argname, values = params[0].args
        for value in values:
            cases[f"{name[5:]}[{value}]"] = (lambda f, a, v: (lambda world: f(world, **{a: v})))(fn, argname, value)
    return cases


CASES = _expand()
