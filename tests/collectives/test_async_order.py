"""Asynchronous calls made blocking on other ranks, or later there, across groups: threads, MPI with shared memory on
and off (``support.async_order_cases``)."""
from support.async_order_cases import CASES
from support.runner import case_tests

test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES, sizes=(2, 3, 4), min_size=2, shm=["auto", "off"])
