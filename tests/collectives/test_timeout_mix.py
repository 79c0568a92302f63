"""Ranks whose timeouts differ, refusals under a timeout, and a timed-out wait's message: the cases of
``timeout_mix_cases`` on MPI ranks with shared memory off (MPI carries every call), the last one on threads too."""
import pytest

from support.runner import mpi_test, threads_test
from support.timeout_mix_cases import CASES


test_case_on_mpi_ranks = mpi_test(CASES, min_size=2, shm="off", marks=[pytest.mark.timeout(180)])
test_named_wait_on_threads = threads_test({"a_timed_out_wait_names_the_call": CASES["a_timed_out_wait_names_the_call"]},
                                          sizes=(2, 3))
