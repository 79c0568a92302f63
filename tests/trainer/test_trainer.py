"""DistributedTrainer: parity for every strategy, accumulation, evaluation, resume after preemption."""
from support.runner import case_tests
from support.trainer_cases import CASES


test_trainer_case_local, test_trainer_case_mpi = case_tests(CASES)
