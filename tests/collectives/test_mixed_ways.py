"""One collective blocking on some ranks and nonblocking on others: threads, and MPI with shared memory on and off."""
from support.mixed_way_cases import CASES
from support.runner import case_tests


test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES, sizes=(2, 3, 4), min_size=2, shm=["auto", "off"])
