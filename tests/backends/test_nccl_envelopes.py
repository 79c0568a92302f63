"""The NCCL backend's envelopes over thread ranks and, under mpiexec, over MPI: ``support.envelope_cases``."""
from support.envelope_cases import CASES
from support.runner import case_tests

test_envelopes_on_threads, test_envelopes_over_mpi = case_tests(CASES)
