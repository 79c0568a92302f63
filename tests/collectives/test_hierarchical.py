"""Hierarchical all-reduce equals the flat one: threads as ranks (1-4) and MPI ranks."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends import ReduceOp
from axonhpc.collectives.algorithms import hierarchical_all_reduce, node_levels
from support.hierarchical_cases import CASES
from support.runner import case_tests


test_hierarchical_case_local, test_hierarchical_case_mpi = case_tests(CASES)


def test_uneven_nodes_use_the_leader_fallback():
    """Nodes of 2 and 1 ranks (a node layout set by hand on threads): node all-reduce, leaders, broadcast."""

    def body(world):
        world.node_rank = 0 if world.rank < 2 else 1
        levels = node_levels(world.default_group)
        assert not levels.uniform
        assert (levels.cross is not None) == (levels.node.rank == 0)
        x = np.arange(5, dtype=np.float64) * (world.rank + 1)
        hierarchical_all_reduce(x, ReduceOp.AVG, world.default_group)
        np.testing.assert_allclose(x, np.arange(5) * 2.0)

    ax.run_local(body, world_size=3)


def test_setting_is_validated():
    with pytest.raises(ValueError, match="AXONHPC_ALLREDUCE_ALGORITHM='tree' must be one of:? native, hierarchical"):
        ax.settings.load_environment({"AXONHPC_ALLREDUCE_ALGORITHM": "tree"})
