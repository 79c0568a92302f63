"""Every strategy on device arrays, on CI: threads as ranks (1-4), the strict cupy stand-in and fake NCCL.

The stand-in (``strict_cupy``) is not a numpy subclass and refuses what cupy
refuses, so a numpy-only assumption in a strategy fails here, not on a GPU
node. Nothing here runs on a GPU: ``test_gpu_strategies.py`` runs the same
cases with real cupy where a CUDA device exists.
"""
import sys

import numpy as np
import pytest

from support.device_cases import CASES, MIN_RANKS
from support.fake_cuda import FakeNccl, install, run_device_world
from support.strict_cupy import DeviceArray, device


@pytest.fixture
def strict_cupy(monkeypatch):
    cupy, _ = install(_Modules(monkeypatch))
    return cupy


class _Modules:
    """``sys.modules`` through monkeypatch, so the fakes leave with the test."""

    def __init__(self, monkeypatch):
        self._mp = monkeypatch

    def __setitem__(self, name, module):
        self._mp.setitem(sys.modules, name, module)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_case(case, world_size, strict_cupy):
    if world_size < MIN_RANKS.get(case, 1):
        pytest.skip(f"{case} needs {MIN_RANKS[case]} ranks")
    run_device_world(lambda world: CASES[case](world, strict_cupy), world_size, FakeNccl(), strict_cupy)


# -- the stand-in refuses what cupy refuses ------------------------------------------------------------
def test_the_stand_in_is_not_numpy_and_refuses_implicit_conversion(strict_cupy):
    from axonhpc.bucketing import pack

    x = device(np.arange(4.0))
    assert not isinstance(x, np.ndarray) and isinstance(x, strict_cupy.ndarray)
    for convert in (np.asarray, np.array, memoryview, lambda a: np.add(a, np.ones(4)), lambda a: a + np.ones(4)):
        with pytest.raises(TypeError):
            convert(x)
    with pytest.raises(TypeError):
        x[...] = np.ones(4)
    with pytest.raises(TypeError):
        strict_cupy.concatenate([x, np.ones(2)])
    with pytest.raises(TypeError):
        strict_cupy.sin([1.0, 2.0])
    with pytest.raises(AttributeError):
        x.flags.writeable
    with pytest.raises(AttributeError):
        x.ctypes
    with pytest.raises(Exception, match="cupy array"):
        pack([x])  # the compiled buffers take host memory only
    assert type(x.sum()) is DeviceArray and float(x.sum()) == 6.0
    assert x.get().tolist() == [0.0, 1.0, 2.0, 3.0] and type(x.get()) is np.ndarray
    assert strict_cupy.get_array_module(x) is strict_cupy and strict_cupy.get_array_module(np.ones(1)) is np
    assert x.__cuda_array_interface__["data"][0] == x.data.ptr
