"""Parameters without a gradient inside a used FSDP unit: the cases of ``fsdp_unused_param_cases`` on threads and on MPI ranks."""
import pytest

from support.fsdp_unused_param_cases import CASES
from support.runner import mpi_test, threads_test

test_case_on_threads = threads_test(CASES, sizes=(1, 2, 3, 4))
test_case_on_mpi_ranks = mpi_test(CASES, min_size=2, marks=[pytest.mark.timeout(300)])
