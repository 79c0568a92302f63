"""Fixtures of the layers' device-kernel tests: the strict cupy stand-in, and its C library math."""
import sys

import pytest

from axonhpc.cuda import kernels as cuda_kernels
from support.strict_cupy import DeviceArray, StrictCupy


@pytest.fixture
def strict_cupy(monkeypatch):
    cupy = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


@pytest.fixture
def c_math(strict_cupy, monkeypatch):
    """The stand-in's ``exp``, ``tanh`` and ``log`` from the C library, as the fused kernels' are."""
    for name in ("exp", "tanh", "log"):
        kernel = strict_cupy.ElementwiseKernel("T x", "T y", f"y = {name}(x);", f"c_{name}")

        def ufunc(x, out=None, _kernel=kernel, _name=name):
            assert type(x) is DeviceArray and x.dtype in cuda_kernels.KERNEL_DTYPES, (_name, type(x), x.dtype)
            return _kernel(x) if out is None else _kernel(x, out)

        monkeypatch.setattr(strict_cupy, name, ufunc, raising=False)
    return strict_cupy
