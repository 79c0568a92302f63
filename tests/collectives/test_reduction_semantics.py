"""NaN in float MIN/MAX, uint8 wrapping and integer AVG: the same answer on threads and under MPI, engine on and off."""
from support.reduction_cases import CASES
from support.runner import case_tests

test_reduction_case_local, test_reduction_case_mpi = case_tests(CASES, shm=["auto", "off"])
