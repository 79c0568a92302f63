"""Every strategy on real cupy arrays on a GPU: ``device_cases`` against single-process host training.

The same cases run on CI against the strict cupy stand-in
(``test_device_strategies.py``); here they run with real cupy where a CUDA
device exists, and skip everywhere else. ``bash scripts/gpu-check.sh`` runs
them on one rank and on two ranks sharing a GPU:

    python -m pytest -m gpu --with-mpi tests/parallel/test_gpu_strategies.py
    mpiexec -n 2 python scripts/mpi_pytest.py test-logs/gpu -m gpu tests/parallel/test_gpu_strategies.py

Assertions are collective (``mpi_assert.collectively``): a failure on one
rank fails every rank, and no rank is left waiting for one that raised.
"""
import importlib

import pytest

from axonhpc.backends.devices import device_facts
from support.device_cases import CASES, MIN_RANKS
from support.mpi_assert import collectively

# cupy itself when a CUDA device is usable here (the library's own probe), else None: skip.
cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy is None, reason="needs cupy and a CUDA device")]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_case_on_gpu(case, mpi_world):
    if mpi_world.world_size < MIN_RANKS.get(case, 1):
        pytest.skip(f"{case} needs {MIN_RANKS[case]} ranks")
    collectively(mpi_world, lambda: CASES[case](mpi_world, cupy))
