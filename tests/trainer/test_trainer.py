"""DistributedTrainer: parity for every strategy, accumulation, evaluation, resume after preemption."""
import pytest

import axonhpc as ax
from support.mpi_assert import collectively
from support.trainer_cases import CASES


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_case_local(case, world_size):
    ax.run_local(CASES[case], world_size=world_size)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_case_mpi(case, mpi_world):
    collectively(mpi_world, lambda: CASES[case](mpi_world))
