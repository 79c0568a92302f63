"""The collective suite on the in-process backend: threads as ranks, world sizes 1-4."""
import pytest

import axonhpc as ax
from support.collective_cases import CASES

LOCAL_ONLY_SKIPS = set()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_collective_case(case, world_size):
    ax.run_local(CASES[case], world_size=world_size)
