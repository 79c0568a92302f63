"""What a reduction gives at the edges of its dtype, the same on every rank, path and backend.

- float MIN and MAX propagate NaN as ``np.minimum`` / ``np.maximum`` do, whichever rank holds it
  (the node engine kept a NaN only from rank 0; MPI's built-in ops differed by rank);
- float MIN and MAX are IEEE 754-2019 minimum and maximum: -0.0 is below +0.0, so the sign of a zero
  result is the same on every rank and path, and the IEEE one (``np.minimum`` returned the second of
  two zeros, so MPI's rank-dependent order gave ranks different signs, and the engine kept rank 0's);
- uint8 SUM wraps mod 256 (Open MPI's AVX op saturates at 255 from 16 elements on), PRODUCT too;
- integer AVG is the floor of the exact mean: it sums in int64, so 200 + 200 as uint8 averages to 200.

Run by tests/collectives/test_reduction_semantics.py on threads (world sizes 1-4) and under MPI with the
shared-memory engine on and off. Every call is checked against numpy on the inputs of every rank, which
each rank makes itself. A rank notes what is wrong and raises only after the case's last collective: the
ranks may disagree (that is the bug), and one that stopped early would leave the others waiting.
"""
import numpy as np

import axonhpc as ax
from axonhpc._dtypes import bfloat16_dtype
from axonhpc.parallel.grad_norm import clip_grad_norm

FLOATS = [np.dtype(t) for t in (np.float16, np.float32, np.float64)] + (
    [bfloat16_dtype()] if bfloat16_dtype() is not None else [])
SIZES = [1, 33, 70001]  # one element, a partial cache line, and many engine chunks (and MPI pipeline pieces)


def _float_input(rank, size, dtype, nan_rank, n):
    """Values 10 * (rank + 1) plus noise; NaN on rank ``nan_rank`` at every third element."""
    x = (10.0 * (rank + 1) + np.random.default_rng(rank).random(size)).astype(dtype)
    if rank == nan_rank % n:
        x[::3] = np.nan
    return x


def _same_on_every_rank(x, what, problems):
    """Note in ``problems`` if ``x``'s bits (NaN as NaN) differ from rank 0's (one all-gather, on every rank)."""
    everyone = ax.all_gather(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    for k in range(1, everyone.shape[0]):
        if not np.array_equal(everyone[k], everyone[0]):
            problems.append(f"{what}: rank {k} holds other bits than rank 0")


def _check_nan_result(got, want, what, problems):
    got64, want64 = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    nan_got, nan_want = np.isnan(got64), np.isnan(want64)
    if not np.array_equal(nan_got, nan_want):
        problems.append(f"{what}: NaN at {np.flatnonzero(nan_got)[:5]}..., numpy's at {np.flatnonzero(nan_want)[:5]}"
                        f"... (got {got64[:4]}, numpy {want64[:4]})")
    elif not np.array_equal(got64[~nan_got], want64[~nan_want]):
        problems.append(f"{what}: got {got64[:4]}, numpy {want64[:4]}")


def _check_equal(got, want, what, problems):
    if not np.array_equal(got, np.broadcast_to(want, np.shape(got))):
        problems.append(f"{what}: got {np.asarray(got).reshape(-1)[:5].tolist()}, "
                        f"want {np.asarray(want).reshape(-1)[:5].tolist()}")


def _report(problems, rank):
    assert not problems, f"rank {rank}: " + "\n".join(problems[:10]) + (
        f"\n... {len(problems) - 10} more" if len(problems) > 10 else "")


def case_min_max_propagate_nan(world):
    n, r = world.world_size, world.rank
    problems = []
    for dtype in FLOATS:
        for op, ufunc in ((ax.ReduceOp.MIN, np.minimum), (ax.ReduceOp.MAX, np.maximum)):
            for nan_rank in (0, 1, n - 1):
                for size in SIZES:
                    inputs = [_float_input(k, size, dtype, nan_rank, n) for k in range(n)]
                    want = ufunc.reduce([a.astype(np.float64) for a in inputs]).astype(dtype)
                    what = f"all_reduce {op.name} {dtype} size {size}, NaN on rank {nan_rank % n} of {n}"
                    x = inputs[r].copy()
                    ax.all_reduce(x, op)
                    _check_nan_result(x, want, what, problems)
                    _same_on_every_rank(x, what, problems)
                    y = inputs[r].copy()
                    ax.all_reduce(y, op, async_op=True).wait()  # the general path
                    _check_nan_result(y, want, what + " (async)", problems)
                rows = np.stack([_float_input(k, 6 * n, dtype, nan_rank, n) for k in range(n)])
                part = ax.reduce_scatter(rows[r].reshape(n, 6), op)
                want = ufunc.reduce(rows.astype(np.float64)).astype(dtype).reshape(n, 6)[r:r + 1]
                _check_nan_result(part, want, f"reduce_scatter {op.name} {dtype}, NaN on rank {nan_rank % n}",
                                  problems)
    _report(problems, r)


def case_min_max_nan_in_a_repeated_call(world):
    """A small call made over and over (which may ride with its agreement check) still propagates NaN."""
    n, r = world.world_size, world.rank
    problems = []
    for step in range(6):
        x = np.full(8, float(r + step), dtype=np.float32)
        if r == (step % n):
            x[step] = np.nan
        ax.all_reduce(x, ax.ReduceOp.MAX)
        want = np.full(8, float(n - 1 + step), dtype=np.float32)
        want[step] = np.nan
        _check_nan_result(x, want, f"MAX, step {step}", problems)
        _same_on_every_rank(x, f"MAX, step {step}", problems)
    _report(problems, r)


def case_inf_norm_clipping_with_a_nan(world):
    """The inf-norm over a group's gradient parts is NaN on every rank when one part holds a NaN."""
    n, r = world.world_size, world.rank
    grad = np.full(4, 10.0 * (r + 1))
    if r == 1 % n:
        grad[0] = np.nan
    norm = clip_grad_norm([grad], 1.0, float("inf"), sum_over=[world.default_group])
    norms = ax.all_gather(np.array([norm]))
    assert np.all(np.isnan(norms)), f"the ranks' inf-norms: {norms.ravel().tolist()}, not NaN on every rank"


def _signed_zero_columns(n):
    """Columns (one value per rank, shape (n, m)) of +0.0 and -0.0 in every sign pattern over the ranks,
    alone, with a NaN on one rank, and with 1.0, -1.0, inf or -inf on one rank."""
    patterns = [[-0.0 if c >> k & 1 else 0.0 for k in range(n)] for c in range(2 ** n)]
    columns = [list(p) for p in patterns]
    for other in (np.nan, 1.0, -1.0, np.inf, -np.inf):
        for p in patterns:
            for k in range(n):
                columns.append(p[:k] + [other] + p[k + 1:])
    return np.array(columns, dtype=np.float64).T


def ieee_min_max(rows, op):
    """IEEE 754-2019 minimum or maximum down ``rows`` (float64, ranks x elements), written out case by case."""
    nan = np.isnan(rows).any(axis=0)
    numbers = np.where(np.isnan(rows), 0.0, rows)
    zero = rows == 0
    if op is ax.ReduceOp.MIN:
        out = numbers.min(axis=0)
        negative_zero = (zero & np.signbit(rows)).any(axis=0)  # -0.0 on any rank: below every +0.0
        out = np.where(out == 0, np.where(negative_zero, -0.0, 0.0), out)
    else:
        out = numbers.max(axis=0)
        positive_zero = (zero & ~np.signbit(rows)).any(axis=0)  # +0.0 on any rank: above every -0.0
        out = np.where(out == 0, np.where(positive_zero, 0.0, -0.0), out)
    return np.where(nan, np.nan, out)


def _bits(x):
    x = np.ascontiguousarray(x).reshape(-1)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _check_ieee_bits(got, want, what, problems, everywhere=True):
    """``got`` is NaN where ``want`` is, and has ``want``'s bits (sign of zero included) everywhere else; with
    ``everywhere``, the non-NaN bits and the NaN places are the same on every rank (which NaN is not promised)."""
    got, want = np.ascontiguousarray(got).reshape(-1), np.ascontiguousarray(want).reshape(-1)
    nan_got, nan_want = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    if not np.array_equal(nan_got, nan_want):
        problems.append(f"{what}: NaN at {np.flatnonzero(nan_got)[:5]}..., IEEE's at {np.flatnonzero(nan_want)[:5]}")
    else:
        wrong = np.flatnonzero(_bits(got)[~nan_got] != _bits(want)[~nan_want])
        if wrong.size:
            g, w = got[~nan_got][wrong[:4]].astype(np.float64), want[~nan_want][wrong[:4]].astype(np.float64)
            problems.append(f"{what}: {wrong.size} elements differ from IEEE's, e.g. got {g.tolist()} "
                            f"(sign bits {np.signbit(g).tolist()}), IEEE {w.tolist()} (sign bits {np.signbit(w).tolist()})")
    if everywhere:
        canonical = _bits(got).copy()
        canonical[nan_got] = 1  # NaN as NaN, whatever its bits
        _same_on_every_rank(canonical, what, problems)


def case_min_max_of_signed_zeros(world):
    """-0.0 on some ranks and +0.0 on others (alone, beside a NaN or a number): IEEE's bits on every rank.

    Through the plain call, the general (asynchronous) path, reduce_scatter, the ring, rhd and
    hierarchical algorithms, and a small call repeated (carried with its check over MPI).
    """
    n, r = world.world_size, world.rank
    problems = []
    columns = _signed_zero_columns(n)
    m = columns.shape[1]
    for dtype in FLOATS:
        for op in (ax.ReduceOp.MIN, ax.ReduceOp.MAX):
            for size in (m, 70001):
                rows = np.tile(columns, -(-size * n // m))[:, :size * n]  # size * n: reduce_scatter's parts too
                want = ieee_min_max(rows.astype(dtype).astype(np.float64), op).astype(dtype)
                mine = rows[r].astype(dtype)
                head = f"{op.name} {dtype} size {size} on {n} ranks"
                x = mine[:size].copy()
                ax.all_reduce(x, op)
                _check_ieee_bits(x, want[:size], f"all_reduce {head}", problems)
                y = mine[:size].copy()
                ax.all_reduce(y, op, async_op=True).wait()
                _check_ieee_bits(y, want[:size], f"all_reduce {head} (async)", problems)
                part = ax.reduce_scatter(mine.reshape(n, size), op)
                _check_ieee_bits(part, want.reshape(n, size)[r], f"reduce_scatter {head}", problems, everywhere=False)
                for algorithm in ("ring", "rhd", "hierarchical"):
                    z = mine[:size].copy()
                    ax.all_reduce(z, op, algorithm=algorithm)
                    _check_ieee_bits(z, want[:size], f"all_reduce {algorithm} {head}", problems)
    for dtype in (np.float32, np.float64):  # small, and the same call again and again: carried over MPI
        for op in (ax.ReduceOp.MIN, ax.ReduceOp.MAX):
            rows = columns.astype(dtype)
            want = ieee_min_max(columns, op).astype(dtype)
            for step in range(5):
                x = rows[r].copy()
                ax.all_reduce(x, op)
                _check_ieee_bits(x, want, f"all_reduce {op.name} {np.dtype(dtype)} of {m}, call {step + 1}", problems)
    _report(problems, r)


def case_uint8_sum_and_product_wrap(world):
    n, r = world.world_size, world.rank
    problems = []
    for size in (1, 15, 16, 17, 1000, 70001):
        want = np.full(size, sum(200 + k for k in range(n)) % 256, dtype=np.uint8)
        want[::2] = 250 * n % 256
        for async_op in (False, True):
            x = np.full(size, 200 + r, dtype=np.uint8)
            x[::2] = 250
            work = ax.all_reduce(x, ax.ReduceOp.SUM, async_op=async_op)
            if async_op:
                work.wait()
            _check_equal(x, want, f"uint8 SUM of {size} (async_op={async_op}): should wrap mod 256", problems)
        p = np.full(size, 3 + r, dtype=np.uint8)
        ax.all_reduce(p, ax.ReduceOp.PRODUCT)
        _check_equal(p, int(np.prod([3 + k for k in range(n)])) % 256, f"uint8 PRODUCT of {size}", problems)
    part = ax.reduce_scatter(np.full((n, 40), 250, dtype=np.uint8), ax.ReduceOp.SUM)
    _check_equal(part, 250 * n % 256, "uint8 reduce_scatter SUM", problems)
    _report(problems, r)


def _avg_inputs(rank, dtype):
    info = np.iinfo(dtype)
    # near the top of the range (the sum would overflow the dtype), near the bottom, and mixed signs
    return np.array([info.max - rank, info.min + rank, -1 if info.min < 0 else 1, rank, 7 * rank % 5],
                    dtype=dtype)


def case_integer_avg_is_the_floor_of_the_exact_mean(world):
    n, r = world.world_size, world.rank
    problems = []
    for dtype in (np.uint8, np.int32, np.int64):
        everyone = [_avg_inputs(k, dtype).astype(object) for k in range(n)]
        want = np.array([sum(column) // n for column in zip(*everyone)], dtype=dtype)  # exact, floored
        # int64 is summed in int64 itself (docs/collectives.md): its first two sums do not fit, so are not compared
        keep = slice(2, None) if dtype is np.int64 else slice(None)
        for size in (1, 9000):
            x = np.tile(_avg_inputs(r, dtype), size)
            ax.all_reduce(x, ax.ReduceOp.AVG)
            _check_equal(x.reshape(size, -1)[:, keep], want[keep], f"{np.dtype(dtype)} AVG of {size} x 5", problems)
            _same_on_every_rank(x, f"{np.dtype(dtype)} AVG", problems)
    u = np.full(100, 200, dtype=np.uint8)
    ax.all_reduce(u, ax.ReduceOp.AVG, async_op=True).wait()
    _check_equal(u, 200, "uint8 AVG of 200 on every rank (async)", problems)
    part = ax.reduce_scatter(np.full((n, 3), 2**31 - 1 - r, dtype=np.int32), ax.ReduceOp.AVG)
    _check_equal(part, sum(2**31 - 1 - k for k in range(n)) // n, "int32 reduce_scatter AVG", problems)
    _report(problems, r)


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
