"""Disagreeing collectives raise on every rank with default settings: threads, and MPI with shared memory on and off."""
import numpy as np

from axonhpc._dtypes import supported_dtypes
from axonhpc._ext import _shm
from support.agreement_cases import CASES
from support.runner import case_tests


test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES, sizes=(2, 3, 4), min_size=2, shm=["auto", "off"])


def test_every_supported_dtype_has_its_own_code():
    codes = [_shm.dtype_code(d) for d in supported_dtypes()]
    assert len(set(codes)) == len(codes)


def test_descriptors_tell_calls_apart():
    base = _shm.describe("all_reduce", np.float32, (4,), "SUM")
    assert base == _shm.describe("all_reduce", np.dtype(np.float32), [4], "SUM")
    others = [
        _shm.describe("all_reduce", np.float32, (5,), "SUM"),
        _shm.describe("all_reduce", np.float64, (4,), "SUM"),
        _shm.describe("all_reduce", np.float32, (4,), "MAX"),
        _shm.describe("all_reduce", np.float32, (2, 2), "SUM"),
        _shm.describe("broadcast", np.float32, (4,), None, 0),
        _shm.describe("all_reduce", np.float32, (4,), "SUM", device=True),
        _shm.describe("all_reduce", np.float32, (4,), "SUM", elsewhere=True),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert _shm.describe("broadcast", np.float32, (4,), None, 0) != _shm.describe("broadcast", np.float32, (4,), None, 1)
    # Every word stays below 2**62, so the MPI check's MAX of [d, -d] cannot overflow.
    for desc in [base, *others, _shm.describe("all_gather", np.float64, (2**40, 2**21))]:
        assert all(0 <= w < 2**62 for w in desc)
