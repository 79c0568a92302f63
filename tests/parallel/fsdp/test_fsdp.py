"""FSDP parity, memory and state dicts: threads as ranks (1-4) and MPI ranks; ZeRO memory formulas."""
import numpy as np
import pytest

import axonhpc as ax
from support.fsdp_cases import CASES
from support.runner import case_tests


test_fsdp_case_local, test_fsdp_case_mpi = case_tests(CASES)


def test_zero_paper_worked_example():
    """7.5B parameters, K = 12, 64 ranks: 120, 31.4, 16.6 and 1.9 GB per rank (ZeRO, figure 1)."""
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        stats = ax.FSDPMemoryStats.estimate(7.5e9, 64, stage)
        assert round(stats.total_bytes / 1e9, 1) == gb, (stage, stats)
    assert ax.FSDPMemoryStats.estimate(7.5e9, 64, 0).memory_savings() == 0.0
    assert ax.FSDPMemoryStats.estimate(7.5e9, 64, 3).memory_savings() == pytest.approx(1 - 1 / 64)
    stage3 = ax.FSDPMemoryStats.estimate(1000, 4, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert (stage3.param_bytes, stage3.grad_bytes, stage3.optimizer_bytes) == (1000.0, 1000.0, 2000.0)
    assert stage3.total_memory_mb() == pytest.approx(4000 / 2**20)


@pytest.mark.parametrize("bad, message", [
    (dict(world_size=0), "world_size must be a positive int, got 0"),
    (dict(stage=4), "stage must be 0, 1, 2 or 3, got 4"),
    (dict(num_params=-1), "num_params must be a non-negative number, got -1"),
])
def test_estimate_rejects_bad_values(bad, message):
    args = dict(num_params=10, world_size=2, stage=1) | bad
    with pytest.raises(ax.errors.ConfigurationError, match=message):
        ax.FSDPMemoryStats.estimate(**args)


def test_memory_estimate_of_a_wrapped_model():
    model = ax.nn.Sequential(ax.nn.Linear(10, 10, dtype=np.float32))
    fsdp = ax.FSDP(model, group=ax.ProcessGroup.mock())
    est = fsdp.memory_estimate()
    assert (est.stage, est.world_size, est.num_params) == (3, 1, 110)
    assert est.total_bytes == 110 * (4 + 4 + 8)
