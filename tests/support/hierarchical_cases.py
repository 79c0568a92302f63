"""Hierarchical all-reduce cases, run on threads (1-4 ranks) and on MPI ranks: equal to the flat all-reduce."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc._dtypes import supported_dtypes
from axonhpc.backends import ReduceOp
from axonhpc.collectives.algorithms import hierarchical_all_reduce, node_levels

OPS = ("sum", "avg", "max", "min", "product")


def _layouts(world):
    """ranks_per_node values that divide the world: every rank its own node, pairs, one node."""
    n = world.world_size
    return sorted({1, n} | ({2} if n % 2 == 0 else set()))


def _check_equal(world, dtype, op, size, rpn):
    rng = np.random.default_rng(1000 * world.rank + size)
    if np.dtype(dtype).kind in "iu":
        x = rng.integers(1, 4, size).astype(dtype)
    else:
        x = (rng.standard_normal(size) + 2).astype(dtype)
    flat, hier = x.copy(), x.copy()
    ax.all_reduce(flat, op)
    hierarchical_all_reduce(hier, ReduceOp.parse(op), world.default_group, ranks_per_node=rpn)
    if np.dtype(dtype).kind in "iu" or op in ("max", "min"):
        np.testing.assert_array_equal(hier, flat)
    else:
        tol = 1e-12 if dtype == np.float64 else 1e-5 if dtype == np.float32 else 1e-2
        np.testing.assert_allclose(hier.astype(np.float64), flat.astype(np.float64), rtol=tol)


def case_every_dtype_and_op_equals_flat(world):
    for rpn in _layouts(world):
        for dtype in supported_dtypes():
            for op in OPS:
                if op == "product" and np.dtype(dtype).itemsize < 4:
                    continue  # overflows small types the same way, but not usefully
                _check_equal(world, dtype, op, 11, rpn)


def case_sizes_including_empty_and_unaligned(world):
    for rpn in _layouts(world):
        for size in (0, 1, 5, 1000):
            _check_equal(world, np.float64, "sum", size, rpn)
            _check_equal(world, np.int64, "avg", size, rpn)


def case_multi_dimensional_and_per_call_selection(world):
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) + world.rank
    y = x.copy()
    ax.all_reduce(x, "sum", algorithm="hierarchical")
    ax.all_reduce(y, "sum", algorithm="native")
    np.testing.assert_allclose(x, y, rtol=1e-14)
    work = ax.all_reduce(x, "avg", algorithm="hierarchical", async_op=True)
    assert work.is_completed()


def case_setting_applies_to_ddp(world):
    from support.ddp_cases import parity

    before = ax.settings.allreduce_algorithm
    ax.settings.allreduce_algorithm = "hierarchical"
    try:
        parity(world, np.float64, "adam")
    finally:
        ax.settings.allreduce_algorithm = before


def case_groups_are_cached_and_right(world):
    n = world.world_size
    levels = node_levels(world.default_group)
    assert levels.node.size == world.local_size and levels.uniform  # one machine: one node
    if n % 2 == 0:
        levels = node_levels(world.default_group, ranks_per_node=2)
        first = world.rank // 2 * 2
        assert list(levels.node.ranks) == [first, first + 1]
        assert list(levels.cross.ranks) == list(range(world.rank % 2, n, 2))
        assert node_levels(world.default_group, ranks_per_node=2) is levels


def case_setting_over_several_nodes_runs_its_steps_natively(world):
    """With the setting on and several nodes, the algorithm's own steps are native all-reduces.

    A regression: the steps inside and across the nodes read the setting too,
    and the hierarchical all-reduce called itself until the stack overflowed.
    The nodes are pretended (pairs of ranks) on a fresh group, so no other
    case sees them.
    """
    if world.world_size < 4 or world.world_size % 2:
        return  # needs at least two nodes of two ranks
    before, node_rank = ax.settings.allreduce_algorithm, world.node_rank
    group = world.new_group(list(range(world.world_size)), name="pretend_nodes")
    try:
        world.node_rank = world.rank // 2
        ax.settings.allreduce_algorithm = "hierarchical"
        x = np.full(5, float(world.rank + 1))
        ax.all_reduce(x, group=group)
        levels = node_levels(group)
        assert levels.node.size == 2 and levels.cross.size == world.world_size // 2
    finally:
        ax.settings.allreduce_algorithm, world.node_rank = before, node_rank
    n = world.world_size
    np.testing.assert_array_equal(x, np.full(5, n * (n + 1) / 2))


def case_unknown_algorithm_is_refused_before_sending(world):
    with pytest.raises(ax.errors.ConfigurationError, match="algorithm='tree' is not an all-reduce algorithm"):
        ax.all_reduce(np.zeros(3), algorithm="tree")
    ax.barrier()


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}
