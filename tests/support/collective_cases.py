"""The collective suite, written once and run on every backend.

Each ``case_*`` function takes a ``World`` and raises on failure. They are
run by test_collectives_local.py on the in-process backend (threads as ranks,
world sizes 1-4, plain pytest) and by test_collectives_mpi.py on real MPI
ranks (under mpiexec -n 2, 3, 4). Every rank passes the same arguments, so a
wrong argument fails on every rank before anything is sent.
"""
import numpy as np
import pytest

import axonhpc as ax
from support.settings_override import override
from axonhpc._dtypes import bfloat16_dtype, supported_dtypes
from axonhpc.errors import (
    CollectiveMismatchError,
    ConfigurationError,
    NonContiguousBufferError,
    NotAMemberError,
    RankError,
    ReadOnlyBufferError,
    ShapeError,
    UnsupportedDtypeError,
)

DTYPES = list(supported_dtypes())
OPS = [ax.ReduceOp.SUM, ax.ReduceOp.AVG, ax.ReduceOp.MIN, ax.ReduceOp.MAX, ax.ReduceOp.PRODUCT]


def closed_form(op, n, c, dtype):
    """Result of reducing rank + c over n ranks."""
    values = [r + c for r in range(n)]
    if op is ax.ReduceOp.SUM:
        return sum(values)
    if op is ax.ReduceOp.AVG:
        return sum(values) // n if np.dtype(dtype).kind in "iu" else sum(values) / n
    if op is ax.ReduceOp.MIN:
        return min(values)
    if op is ax.ReduceOp.MAX:
        return max(values)
    return int(np.prod(values))


def as_float(a):
    return np.asarray(a).astype(np.float64)


def rank_data(rank, shape, dtype, seed=0):
    """Deterministic per-rank data of a dtype, small enough not to overflow."""
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 5, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


# -- reductions ----------------------------------------------------------------------------
def case_all_reduce_closed_form(world):
    n, r = world.world_size, world.rank
    for dtype in DTYPES:
        for op in OPS:
            x = np.full((3, 2), r + 1, dtype=dtype)
            assert ax.all_reduce(x, op) is None
            want = closed_form(op, n, 1, dtype)
            assert np.all(as_float(x) == float(np.asarray(want, dtype=dtype).astype(np.float64))), (dtype, op, x, want)


def case_all_reduce_named_variants(world):
    n, r = world.world_size, world.rank
    for fn, op in [(ax.all_reduce_sum, ax.ReduceOp.SUM), (ax.all_reduce_mean, ax.ReduceOp.AVG),
                   (ax.all_reduce_min, ax.ReduceOp.MIN), (ax.all_reduce_max, ax.ReduceOp.MAX),
                   (ax.all_reduce_product, ax.ReduceOp.PRODUCT)]:
        x = np.full(4, r + 2.0)
        fn(x)
        assert np.all(x == closed_form(op, n, 2, np.float64)), (fn.__name__, x)
    y = np.full(2, r, dtype=np.int64)
    ax.all_reduce(y, "max")  # string names work too
    assert np.all(y == n - 1)


def case_all_reduce_matches_numpy(world):
    r = world.rank
    for dtype in DTYPES:
        x = rank_data(r, (5, 7), dtype, seed=3)
        everyone = ax.all_gather(x)
        for op, ref in [(ax.ReduceOp.SUM, np.sum), (ax.ReduceOp.MAX, np.max), (ax.ReduceOp.MIN, np.min)]:
            y = x.copy()
            ax.all_reduce(y, op)
            wide = everyone.astype(np.float64)
            want = ref(wide, axis=0)
            tol = {2: 2e-2, 4: 1e-5, 8: 1e-12}.get(np.dtype(dtype).itemsize, 0) if np.dtype(dtype).kind == "f" else 0
            if dtype == bfloat16_dtype():
                tol = 2e-2
            np.testing.assert_allclose(as_float(y), want, rtol=tol, atol=tol * 10, err_msg=f"{dtype} {op}")


def case_reduce_scatter(world):
    n, r = world.world_size, world.rank
    for dtype in DTYPES:
        x = np.full((2 * n, 3), r + 1, dtype=dtype)
        part = ax.reduce_scatter(x)
        assert part.shape == (2, 3) and part.dtype == x.dtype
        assert np.all(as_float(part) == closed_form(ax.ReduceOp.SUM, n, 1, dtype))
    # each rank's part is its own slice of the summed input
    x = (np.arange(3 * n, dtype=np.float64) + r).reshape(3 * n)
    mine = ax.reduce_scatter_sum(x)
    full = sum(np.arange(3 * n, dtype=np.float64) + k for k in range(n))
    np.testing.assert_array_equal(mine, full[3 * r: 3 * r + 3])
    mean = ax.reduce_scatter_mean(x.copy())
    np.testing.assert_allclose(mean, full[3 * r: 3 * r + 3] / n, rtol=1e-15)
    ints = ax.reduce_scatter(np.full(n, r, dtype=np.int32), "avg")
    assert ints.tolist() == [sum(range(n)) // n]


# -- data movement -------------------------------------------------------------------------
def case_broadcast(world):
    n, r = world.world_size, world.rank
    for src in range(n):
        for dtype in DTYPES:
            x = np.full((2, 3), r + 1, dtype=dtype) if r == src else np.zeros((2, 3), dtype=dtype)
            assert ax.broadcast(x, src=src) is None
            assert np.all(as_float(x) == src + 1), (src, dtype, x)


def case_all_gather(world):
    n, r = world.world_size, world.rank
    for dtype in DTYPES:
        x = np.full((2, 2), r, dtype=dtype)
        g = ax.all_gather(x)
        assert g.shape == (n, 2, 2) and g.dtype == x.dtype
        for k in range(n):
            assert np.all(as_float(g[k]) == k)
    scalar = ax.all_gather(np.array(r * 1.5))
    assert scalar.shape == (n,) and scalar.tolist() == [k * 1.5 for k in range(n)]
    empty = ax.all_gather(np.zeros((0, 4), dtype=np.float32))
    assert empty.shape == (n, 0, 4)
    for count in (3, 100_000):  # through the slots, and over their cap (MPI), on one node
        out = np.empty((n, count), dtype=np.float64)
        x = np.full(count, r + 0.5)
        assert ax.all_gather(x, out=out) is out
        np.testing.assert_array_equal(out, np.repeat(np.arange(n) + 0.5, count).reshape(n, count))
    with pytest.raises(ShapeError, match=r"out is float32 of shape \(2, 3\); the result is float64"):
        ax.all_gather(np.ones(3), out=np.empty((2, 3), dtype=np.float32))
    part = np.empty(2)
    assert ax.reduce_scatter(np.ones(2 * n), out=part) is part and np.all(part == n)


def case_out_overlapping_the_input(world):
    # MPI refuses aliased buffers ("Buffers must not be aliased"): the input that overlaps ``out`` is copied first,
    # through shared memory and MPI alike, and the result is what it would be with separate buffers.
    n, r = world.world_size, world.rank
    for setting in ("auto", "off"):
        with override(shm_collectives=setting):
            for count in (2, 50_000):
                rows = np.zeros((n, count))
                rows[r] = r + 1
                assert ax.all_gather(rows[r], out=rows) is rows
                np.testing.assert_array_equal(rows, np.repeat(np.arange(1.0, n + 1), count).reshape(n, count))
                rows = np.zeros((n, count))
                rows[0] = r + 1  # every rank's input is row 0, which the result overwrites
                ax.all_gather(rows[0], out=rows)
                np.testing.assert_array_equal(rows, np.repeat(np.arange(1.0, n + 1), count).reshape(n, count))
            x = np.arange(2.0 * n) + r
            part = ax.reduce_scatter(x, out=x[2 * r:2 * r + 2])
            total = sum(np.arange(2.0 * n) + k for k in range(n))
            np.testing.assert_array_equal(part, total[2 * r:2 * r + 2])
            async_rows = np.zeros((n, 3))
            async_rows[r] = r
            ax.all_gather(async_rows[r], out=async_rows, async_op=True).wait()
            assert (async_rows == np.arange(n)[:, None]).all()


def case_gather_and_scatter(world):
    n, r = world.world_size, world.rank
    for root in range(n):
        g = ax.gather(np.array([r, 10 * r], dtype=np.int64), dst=root)
        if r == root:
            assert g.tolist() == [[k, 10 * k] for k in range(n)]
        else:
            assert g is None
        src = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3) + root if r == root else None
        part = ax.scatter(src, src=root)
        assert part.shape == (2, 3) and part.dtype == np.float32
        np.testing.assert_array_equal(part, (np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3) + root)[r])


def case_barrier(world):
    assert ax.barrier() is None
    work = ax.barrier(async_op=True)
    assert work.wait() is None and work.is_completed()


def case_point_to_point(world):
    n, r = world.world_size, world.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    # Non-blocking ring: everybody sends first, which must not deadlock.
    out = np.full(5, r, dtype=np.float64)
    into = np.empty(5, dtype=np.float64)
    works = [ax.irecv(into, left, tag=7), ax.isend(out, right, tag=7)]
    assert works[0].wait() is into
    works[1].wait()
    assert np.all(into == left)
    # Blocking, ordered by parity so neighbours never both wait to send.
    buf = np.empty(3, dtype=np.int32)
    if r % 2 == 0:
        ax.send(np.full(3, r, dtype=np.int32), right, tag=1)
        ax.recv(buf, left, tag=1)
    else:
        ax.recv(buf, left, tag=1)
        ax.send(np.full(3, r, dtype=np.int32), right, tag=1)
    assert np.all(buf == left)
    # Tags keep messages apart.
    a, b = np.empty(1), np.empty(1)
    if r == 0:
        ax.send(np.array([1.0]), 1, tag=11)
        ax.send(np.array([2.0]), 1, tag=22)
    elif r == 1:
        ax.recv(b, 0, tag=22)
        ax.recv(a, 0, tag=11)
        assert (a[0], b[0]) == (1.0, 2.0)


def case_async_handles(world):
    n, r = world.world_size, world.rank
    x = np.full(6, r + 1.0)
    w = ax.all_reduce(x, async_op=True)
    assert isinstance(w, ax.Work)
    assert w.wait(timeout=30) is None
    assert w.is_completed() and np.all(x == closed_form(ax.ReduceOp.SUM, n, 1, np.float64))
    w = ax.all_reduce(np.full(3, r, dtype=np.float16), ax.ReduceOp.AVG, async_op=True)
    w.wait()
    g = ax.all_gather(np.array([r]), async_op=True).wait()
    assert g.ravel().tolist() == list(range(n))
    rs = ax.reduce_scatter(np.ones(n, dtype=np.int64), async_op=True).wait()
    assert rs.tolist() == [n]
    b = np.full(2, r)
    ax.broadcast(b, src=n - 1, async_op=True).wait()
    assert b.tolist() == [n - 1, n - 1]
    ga = ax.gather(np.array([r]), dst=0, async_op=True).wait()
    assert (ga is None) == (r != 0)
    sc = ax.scatter(np.arange(n) if r == 0 else None, src=0, async_op=True).wait()
    assert sc.tolist() == r


def case_sync_gradients(world):
    n, r = world.world_size, world.rank
    grads = [np.full((3, 4), r + 1.0), np.full(5, r + 1.0, dtype=np.float32), np.full(2, float(r))]
    ax.sync_gradients(grads)
    mean = closed_form(ax.ReduceOp.AVG, n, 1, np.float64)
    assert np.all(grads[0] == mean) and np.all(grads[1] == np.float32(mean))
    assert np.all(grads[2] == (n - 1) / 2)
    one = np.full(4, r * 2.0)
    ax.sync_gradient(one)
    assert np.all(one == (n - 1))


def case_facts(world):
    n, r = world.world_size, world.rank
    assert ax.get_rank() == r and ax.get_world_size() == n
    assert ax.is_main_process() == (r == 0)
    pg = world.default_group
    assert pg.rank == r and pg.size == n == pg.world_size and pg.ranks == tuple(range(n))
    assert pg.is_member and all(pg.contains(k) for k in range(n)) and not pg.contains(n)
    facts = ax.all_gather(np.array([world.local_rank, world.local_size, world.node_rank, world.num_nodes]))
    # One machine: one node, local ranks are a permutation of 0..n-1.
    assert sorted(facts[:, 0].tolist()) == list(range(n))
    assert set(facts[:, 1].tolist()) == {n} and set(facts[:, 2].tolist()) == {0} and set(facts[:, 3].tolist()) == {1}
    node = world.node_group()
    assert node.size == n and node.ranks == tuple(range(n))


# -- groups ---------------------------------------------------------------------------------
def case_new_group(world):
    n, r = world.world_size, world.rank
    members = list(range(n - 1, -1, -2))  # reversed order, every other rank
    pg = world.new_group(members)
    assert pg.ranks == tuple(members) and pg.size == len(members)
    assert pg.is_member == (r in members)
    if pg.is_member:
        assert pg.rank == members.index(r)
        assert pg.global_rank(pg.rank) == r and pg.group_rank(r) == pg.rank
        x = np.full(2, r + 1.0)
        ax.all_reduce(x, group=pg)
        assert np.all(x == sum(m + 1.0 for m in members))
        b = np.full(1, r)
        ax.broadcast(b, src=0, group=pg)  # src is a group rank: global rank members[0]
        assert b[0] == members[0]
        assert ax.get_rank(pg) == pg.rank and ax.get_world_size(pg) == pg.size
    else:
        assert pg.rank == -1
        for call in (lambda: ax.all_reduce(np.ones(2), group=pg), lambda: ax.barrier(group=pg),
                     lambda: ax.all_gather(np.ones(1), group=pg), lambda: ax.send(np.ones(1), 0, group=pg)):
            with pytest.raises(NotAMemberError, match=f"rank {r} is not a member"):
                call()
    with pytest.raises(RankError, match="not in group"):
        pg.group_rank(n + 5)
    with pytest.raises(RankError, match="out of range"):
        pg.global_rank(len(members))


def case_new_group_errors(world):
    n = world.world_size
    with pytest.raises(RankError, match=rf"\[{n}\] are out of range"):
        world.new_group([0, n])
    with pytest.raises(RankError, match="repeat"):
        world.new_group([0, 0])
    with pytest.raises(RankError, match="empty"):
        world.new_group([])
    with pytest.raises(RankError, match=r"out of range"):
        world.new_group([-1])
    with pytest.raises(RankError, match="integers"):
        world.new_group([0.5])


def case_split(world):
    n, r = world.world_size, world.rank
    pg = world.split(r % 2, key=-r)  # key reverses the order inside each color
    same = [k for k in range(n) if k % 2 == r % 2]
    assert pg.ranks == tuple(sorted(same, reverse=True))
    x = np.array([r], dtype=np.int64)
    ax.all_reduce(x, group=pg)
    assert x[0] == sum(same)
    lonely = world.split(0 if r == 0 else None)
    assert lonely.is_member == (r == 0)
    if r == 0:
        assert lonely.ranks == (0,)
    else:
        assert lonely.ranks == () and lonely.rank == -1
    inner = pg.split(0, key=0)  # a split of a subgroup
    assert inner.ranks == pg.ranks


def case_mesh(world):
    n, r = world.world_size, world.rank
    layouts = [dict(dp=n)] + ([dict(dp=n // 2, tp=2), dict(pp=2, tp=n // 2)] if n % 2 == 0 else [])
    if n == 4:
        layouts.append(dict(dp=1, tp=2, pp=2))
    for shape in layouts:
        mesh = world.mesh(**shape)
        dp, tp, pp = shape.get("dp", 1), shape.get("tp", 1), shape.get("pp", 1)
        c = mesh.coords
        assert r == (c.pp * dp + c.dp) * tp + c.tp
        assert mesh.tp.size == tp and mesh.dp.size == dp and mesh.pp.size == pp
        # tp is the fastest-varying: a tp group is a run of neighbouring ranks
        assert list(mesh.tp.ranks) == list(range(r - c.tp, r - c.tp + tp))
        assert mesh.tp.rank == c.tp and mesh.dp.rank == c.dp and mesh.pp.rank == c.pp
        x = np.array([r], dtype=np.int64)
        ax.all_reduce(x, group=mesh.dp)
        assert x[0] == sum(mesh.dp.ranks)
    with pytest.raises(ConfigurationError, match=f"world has {n}"):
        world.mesh(dp=n + 1)
    with pytest.raises(ConfigurationError, match="positive integer"):
        world.mesh(dp=0)


# -- errors before anything is sent ---------------------------------------------------------------
def case_buffer_errors(world):
    n = world.world_size
    strided = np.zeros((4, 4))[:, ::2]
    with pytest.raises(NonContiguousBufferError, match=r"strides \(32, 16\)"):
        ax.all_reduce(strided)
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ReadOnlyBufferError, match="read-only"):
        ax.all_reduce(frozen)
    with pytest.raises(ReadOnlyBufferError):
        ax.recv(frozen, 0)
    for bad in (np.zeros(2, dtype=np.complex64), np.zeros(2, dtype=np.int16), np.zeros(2, dtype=bool)):
        with pytest.raises(UnsupportedDtypeError, match=str(bad.dtype)):
            ax.all_reduce(bad)
    with pytest.raises(UnsupportedDtypeError, match="list"):
        ax.all_reduce([1.0, 2.0])
    with pytest.raises(RankError, match=f"src={n} is out of range"):
        ax.broadcast(np.zeros(2), src=n)
    with pytest.raises(RankError, match="dst=-1 is out of range"):
        ax.gather(np.zeros(2), dst=-1)
    with pytest.raises(RankError, match="integer"):
        ax.send(np.zeros(2), dst="1")
    with pytest.raises(ValueError, match="tag"):
        ax.send(np.zeros(2), dst=0, tag=-3)
    with pytest.raises(ValueError, match="unknown reduce op"):
        ax.all_reduce(np.zeros(2), "median")
    if n > 1:  # with one rank every length divides
        with pytest.raises(ShapeError, match=rf"\({2 * n + 1},\) must have a first dimension divisible by the group size {n}"):
            ax.reduce_scatter(np.zeros(2 * n + 1))
    with pytest.raises(ShapeError, match="divisible"):
        ax.reduce_scatter(np.array(1.0))


def case_scatter_wrong_leading_size(world):
    n, r = world.world_size, world.rank
    bad = np.zeros((n + 1, 2)) if r == 0 else None
    with pytest.raises(ShapeError, match=f"leading size must equal the group size {n}|source array on group rank 0"):
        ax.scatter(bad, src=0)
    # The group is still usable afterwards: nobody was left waiting.
    x = np.ones(1)
    ax.all_reduce(x)
    assert x[0] == n


def case_debug_mismatch(world):
    n, r = world.world_size, world.rank
    if n == 1:
        return
    pg = world.split(0)  # a fresh group, so its side channel is made here
    pg.debug = True  # per group: ax.settings is shared by the threads of run_local
    try:
        with pytest.raises(CollectiveMismatchError) as info:
            ax.all_reduce(np.zeros((17 + r, 17), dtype=np.float32), group=pg)
        text = str(info.value)
        assert "rank 0 called all_reduce float32 (17, 17)" in text
        assert "rank 1 called all_reduce float32 (18, 17)" in text
        assert "collective_cases.py:" in text
        with pytest.raises(CollectiveMismatchError, match="op=SUM.*op=MAX|op=MAX.*op=SUM"):
            ax.all_reduce(np.zeros(2), "sum" if r == 0 else "max", group=pg)
        with pytest.raises(CollectiveMismatchError, match="root=0.*root=1|root=1.*root=0"):
            ax.broadcast(np.zeros(2), src=0 if r == 0 else 1, group=pg)
        with pytest.raises(CollectiveMismatchError, match="float64.*float32|float32.*float64"):
            ax.all_reduce(np.zeros(2, dtype=np.float64 if r == 0 else np.float32), group=pg)
        with pytest.raises(CollectiveMismatchError, match="barrier.*all_gather|all_gather.*barrier"):
            ax.barrier(group=pg) if r == 0 else ax.all_gather(np.zeros(1), group=pg)
        y = np.full(3, r + 1.0)
        ax.all_reduce(y, group=pg)  # matching calls pass the check and run
        assert np.all(y == closed_form(ax.ReduceOp.SUM, n, 1, np.float64))
    finally:
        ax.barrier(group=pg)
    pg.debug = False
    z = np.zeros((2 + r,))  # with the check off, nothing is compared before the call
    assert ax.get_world_size(pg) == n and z.size == 2 + r


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
