"""Ranks that disagree about a collective get ``CollectiveMismatchError`` on every rank, with no flag set (issue 18).

Each case makes the ranks of a world call one collective in different ways
(lengths, dtypes, ops, roots, kinds, shapes), with default settings (no
debug mode, no timeout). Every rank must raise ``CollectiveMismatchError``
naming every rank's call, and the group must be usable afterwards: nothing
was moved and nobody is left waiting. Run on threads (``run_local``) and on
MPI ranks with the shared-memory path on and off
(``tests/collectives/test_agreement.py``).
"""
import re

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.errors import CollectiveMismatchError


def _in_step(world):
    """Every rank is still in step: all-reduces through every route give the group size."""
    n = world.world_size
    for x in (np.ones(3), np.ones(200_000, dtype=np.float32), np.ones(5, dtype=np.float16)):
        ax.all_reduce(x)
        assert (x == n).all()
    assert (ax.all_gather(np.full(2, world.rank)) == np.arange(n)[:, None]).all()


def _refused(world, call, *expected):
    """``call()`` raises CollectiveMismatchError on this rank, naming each rank and the ``expected`` texts."""
    with pytest.raises(CollectiveMismatchError) as info:
        call()
    text = str(info.value)
    for r in range(world.world_size):
        assert re.search(rf"rank {r}\b", text), text
    for piece in expected:
        assert piece in text, f"{piece!r} not in {text!r}"
    _in_step(world)
    return text


def _odd(world):
    """True on the last rank: the one that differs."""
    return world.rank == world.world_size - 1


def case_all_reduce_lengths(world):
    x = np.ones(5 if _odd(world) else 4)
    _refused(world, lambda: ax.all_reduce(x), "(4,)", "(5,)")


def case_all_reduce_lengths_far_apart(world):
    # Many chunks on one rank, one on the others: it used to hang (or return garbage under a timeout).
    x = np.ones(300_000 if _odd(world) else 1000, dtype=np.float32)
    _refused(world, lambda: ax.all_reduce(x), "(1000,)", "(300000,)")


@pytest.mark.parametrize("pair", [("float32", "float64"), ("int32", "float32"), ("float16", "float32"),
                                  ("int64", "float64"), ("uint8", "int32")])
def case_all_reduce_dtypes(world, pair):
    # float32 vs float64 and int32 vs float32 have the same bytes per rank; float16 is reduced widened
    # to float32, so the engine sees float32 on both sides.
    a, b = pair
    n = 8 if a == "float32" and b == "float64" else 4
    x = np.ones(n if _odd(world) else n * (2 if (a, b) == ("float32", "float64") else 1), dtype=b if _odd(world) else a)
    _refused(world, lambda: ax.all_reduce(x), a, b)


@pytest.mark.parametrize("pair", [("SUM", "MAX"), ("AVG", "SUM"), ("MIN", "PRODUCT")])
def case_all_reduce_ops(world, pair):
    x = np.arange(4.0)
    op = pair[1] if _odd(world) else pair[0]
    _refused(world, lambda: ax.all_reduce(x, op), f"op={pair[0]}", f"op={pair[1]}")


def case_all_reduce_shapes_of_one_size(world):
    x = np.ones((3, 2) if _odd(world) else (2, 3))
    _refused(world, lambda: ax.all_reduce(x), "(2, 3)", "(3, 2)")


def case_all_reduce_async(world):
    x = np.ones(5 if _odd(world) else 4)

    def call():
        ax.all_reduce(x, async_op=True).wait()

    _refused(world, call, "(4,)", "(5,)")


def case_all_gather_shapes_and_dtypes(world):
    x = np.ones(3, dtype=np.float32) if _odd(world) else np.ones(3)
    _refused(world, lambda: ax.all_gather(x), "float32", "float64")
    y = np.ones((2, 2)) if _odd(world) else np.ones(4)
    _refused(world, lambda: ax.all_gather(y), "(2, 2)", "(4,)")


def case_all_gather_small_and_large(world):
    # A large all-gather goes to MPI, a small one through the shared-memory slots.
    x = np.ones(100_000 if _odd(world) else 10)
    _refused(world, lambda: ax.all_gather(x), "(10,)", "(100000,)")


def case_broadcast_roots(world):
    x = np.full(4, float(world.rank))
    src = world.rank  # every rank names itself the source: each would keep its own data
    _refused(world, lambda: ax.broadcast(x, src=src), "root=0", f"root={world.world_size - 1}")


def case_broadcast_shapes(world):
    x = np.zeros(6 if _odd(world) else 4)
    _refused(world, lambda: ax.broadcast(x, src=0), "(4,)", "(6,)")
    y = np.zeros(4, dtype=np.int64 if _odd(world) else np.float64)
    _refused(world, lambda: ax.broadcast(y, src=0), "float64", "int64")


def case_reduce_scatter_lengths(world):
    n = world.world_size
    x = np.ones(n * (3 if _odd(world) else 2))
    _refused(world, lambda: ax.reduce_scatter(x), f"({2 * n},)", f"({3 * n},)")


def case_different_collectives(world):
    x = np.ones(4)
    call = (lambda: ax.broadcast(x, src=0)) if _odd(world) else (lambda: ax.all_reduce(x))
    _refused(world, call, "all_reduce", "broadcast")
    call = (lambda: ax.barrier()) if _odd(world) else (lambda: ax.all_reduce(x))
    _refused(world, call, "all_reduce", "barrier")


def case_gather_and_scatter_roots(world):
    n = world.world_size
    dst = n - 1 if _odd(world) else 0
    _refused(world, lambda: ax.gather(np.ones(2), dst=dst), "root=0", f"root={n - 1}")
    src = n - 1 if _odd(world) else 0
    data = np.ones((n, 2)) if world.rank == src else None
    _refused(world, lambda: ax.scatter(data, src=src), "root=0", f"root={n - 1}")


def case_matching_calls_still_work(world):
    # The checks let every correct call through, of every kind and route.
    n = world.world_size
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8):
        x = np.ones(7, dtype=dtype)
        ax.all_reduce(x)
        assert (x == n).all()
    x = np.zeros(0)
    ax.all_reduce(x)
    ax.broadcast(x, src=0)
    y = np.full(3, float(world.rank))
    ax.broadcast(y, src=n - 1)
    assert (y == n - 1).all()
    assert ax.reduce_scatter(np.ones(2 * n)).tolist() == [n, n]
    assert ax.all_gather(np.zeros((0, 2))).shape == (n, 0, 2)
    ax.barrier()
    gathered = ax.gather(np.full(2, world.rank), dst=0)
    if world.rank == 0:
        assert gathered[:, 0].tolist() == list(range(n))
    part = ax.scatter(np.arange(2.0 * n).reshape(n, 2) if world.rank == 0 else None, src=0)
    assert part.tolist() == [2.0 * world.rank, 2.0 * world.rank + 1]


def case_sync_gradients_of_other_shapes_with_the_same_total(world):
    # Concatenated, [(2,), (3,)] and [(3,), (2,)] are both 5 numbers: they used to be averaged into each other.
    odd, n = _odd(world), world.world_size
    for shapes in (((2,), (3,)), ((2, 3),), ((2,), (3,), (4,))):
        other = tuple(reversed(shapes)) if len(shapes) > 1 else ((3, 2),)
        grads = [np.full(shape, 1.0 + world.rank) for shape in (other if odd else shapes)]
        kept = [g.copy() for g in grads]
        with pytest.raises(CollectiveMismatchError) as info:
            ax.sync_gradients(grads)
        text = str(info.value)
        assert "sync_gradients" in text and f"ranks with the same gradients: {list(range(n - 1))} / [{n - 1}]" in text
        assert all((g == k).all() for g, k in zip(grads, kept))  # nothing was averaged
        _in_step(world)
    grads = [np.full((2, 3), 1.0 + world.rank), np.full(4, 2.0, dtype=np.float32)]
    ax.sync_gradients(grads)
    assert np.allclose(grads[0], (n + 1) / 2) and (grads[1] == 2).all()


@pytest.mark.parametrize("pair", [("ring", "rhd"), ("native", "ring"), ("rhd", "native"),
                                  ("hierarchical", "ring")])
def case_all_reduce_algorithms(world, pair):
    # Each algorithm is its own pattern of messages: two of them used to wait on each other for good.
    x = np.ones(6)
    _refused(world, lambda: ax.all_reduce(x, algorithm=pair[_odd(world)]), *(
        "all_reduce" + ("" if a == "native" else f" {a}") + " float64" for a in pair))


def _expand():
    cases = {}
    for name, fn in list(globals().items()):
        if not name.startswith("case_"):
            continue
        marks = getattr(fn, "pytestmark", [])
        params = [m for m in marks if m.name == "parametrize"]
        if not params:
            cases[name[5:]] = fn
            continue
        argname, values = params[0].args
        for value in values:
            label = "-".join(value) if isinstance(value, tuple) else str(value)
            cases[f"{name[5:]}[{label}]"] = (lambda f, a, v: (lambda world: f(world, **{a: v})))(fn, argname, value)
    return cases


CASES = _expand()
