"""`axonhpc info`'s GPU facts: the CUDA driver, the cupy and NCCL packages, the extra to install.

The answer on this machine is checked against what the machine really has,
found here independently (is cupy installed, does the driver library load),
so the test holds on a node without a GPU and on one with a GPU. The
interpretation of the driver's answers is checked with injected values.
"""
import ctypes
import importlib.metadata
import importlib.util
import json
import subprocess
import sys

import pytest

from axonhpc.backends.cuda_driver import (
    CUPY_PACKAGES,
    DriverFacts,
    extra_for,
    gpu_stack_problems,
    installed,
    package_cuda_major,
    read_driver,
    version_text,
)
from support.paths import ROOT


def _info_json():
    out = subprocess.run([sys.executable, "-m", "axonhpc", "info", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def _driver_here():
    """The driver's version code, asked here without axonhpc, or None when there is no driver library."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int(0)
    return value.value if lib.cuDriverGetVersion(ctypes.byref(value)) == 0 else None


def test_info_reports_the_driver_and_the_gpu_packages_that_are_really_here():
    facts = _info_json()
    for key in ("cuda_driver", "cuda_driver_source", "gpu_extra", "cupy", "cupy_package", "cuda_devices", "nccl",
                "nccl_package"):
        assert key in facts, key
    code = _driver_here()
    if code is None:
        assert facts["cuda_driver"] is None and facts["gpu_extra"] is None
        assert facts["cuda_driver_source"].startswith("no CUDA driver found ("), facts["cuda_driver_source"]
    else:
        assert facts["cuda_driver"] == f"{code // 1000}.{code % 1000 // 10}"
        assert facts["gpu_extra"] == extra_for(code // 1000)
    cupies = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in CUPY_PACKAGES if _has_distribution(n))
    assert facts["cupy_package"] == (cupies or None)
    if importlib.util.find_spec("cupy") is None:
        assert facts["cupy"] is None and "cupy is not installed" in facts["gpu_problems"]
        if code is None:
            assert facts["cuda_devices"] == 0


def _has_distribution(name):
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_info_modules_import_neither_cupy_nor_the_driver():
    code = ("import sys, axonhpc.info, axonhpc.backends.cuda_driver; "
            "bad = [m for m in ('cupy', 'mpi4py.MPI') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("code,text", [(13000, "13.0"), (12040, "12.4"), (12090, "12.9"), (11080, "11.8")])
def test_driver_codes_read_as_major_dot_minor(code, text):
    assert version_text(code) == text


def test_a_driver_code_that_is_not_positive_is_refused_with_the_value():
    with pytest.raises(ValueError, match="positive, got 0"):
        version_text(0)


def test_the_extra_follows_the_drivers_cuda_major():
    assert [extra_for(m) for m in (11, 12, 13, 14)] == [None, "gpu-cuda12", "gpu-cuda13", "gpu-cuda13"]
    assert [package_cuda_major(n) for n in ("cupy-cuda13x", "cupy-cuda12x", "nvidia-nccl-cu12", "cupy")] == [
        13, 12, 12, None]


def test_installed_lists_only_the_distributions_found_in_order():
    versions = {"cupy-cuda12x": "13.6.0", "cupy": "14.0.0"}

    def version_of(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    assert installed(CUPY_PACKAGES, version_of) == [("cupy-cuda12x", "13.6.0"), ("cupy", "14.0.0")]
    assert installed(("nvidia-nccl-cu13",), version_of) == []


def test_a_cupy_newer_than_the_driver_is_named_with_the_extra_that_fits():
    (problem,) = gpu_stack_problems(12040, [("cupy-cuda13x", "14.2.0")])
    assert "cupy-cuda13x needs a CUDA 13 driver" in problem and "supports CUDA 12.4" in problem
    assert "axonhpc[gpu-cuda12]" in problem
    assert gpu_stack_problems(13000, [("cupy-cuda12x", "14.2.0")]) == []  # an older toolkit runs on it
    assert gpu_stack_problems(None, [("cupy-cuda13x", "14.2.0")]) == []  # driver unknown: nothing to compare
    (old,) = gpu_stack_problems(11080, [("cupy-cuda12x", "13.0.0")])
    assert "supports CUDA 11.8: update the driver" in old
    (several,) = gpu_stack_problems(None, [("cupy-cuda12x", "13.0.0"), ("cupy-cuda13x", "14.2.0")])
    assert "several cupy packages are installed (cupy-cuda12x 13.0.0, cupy-cuda13x 14.2.0)" in several


class _DriverAnswers:
    """Answers of the three driver calls ``read_driver`` makes, given as values (status, out-value)."""

    def __init__(self, version=(0, 13000), init=0, count=(0, 1)):
        self.version, self.init, self.count = version, init, count

    def cuDriverGetVersion(self, out):
        out.contents.value = self.version[1]
        return self.version[0]

    def cuInit(self, flags):
        assert flags == 0
        return self.init

    def cuDeviceGetCount(self, out):
        out.contents.value = self.count[1]
        return self.count[0]


def test_read_driver_interprets_the_answers_of_the_driver_calls():
    loaded = []

    def load(answers, fail=()):
        def opener(name):
            loaded.append(name)
            if name in fail:
                raise OSError(f"{name}: cannot open shared object file")
            return answers
        return opener

    assert read_driver(load(_DriverAnswers(count=(0, 2)))) == DriverFacts(13000, 2, "libcuda.so.1 cuDriverGetVersion")
    assert read_driver(load(_DriverAnswers()), count_devices=False).devices is None
    # CUDA_ERROR_NO_DEVICE from cuInit: a driver without a (visible) device
    assert read_driver(load(_DriverAnswers(init=100))).devices == 0
    # any other cuInit failure: the count is unknown, the version still stands
    assert read_driver(load(_DriverAnswers(init=3))) == DriverFacts(13000, None, "libcuda.so.1 cuDriverGetVersion")
    failed = read_driver(load(_DriverAnswers(version=(3, 0))))
    assert failed.version is None and failed.source == "libcuda.so.1 cuDriverGetVersion failed with CUresult 3"
    loaded.clear()
    second = read_driver(load(_DriverAnswers(version=(0, 12040)), fail=("libcuda.so.1",)))
    assert loaded == ["libcuda.so.1", "libcuda.so"] and second.version == 12040
    none = read_driver(load(_DriverAnswers(), fail=("libcuda.so.1", "libcuda.so")))
    assert none.version is None and none.devices is None
    assert none.source == ("no CUDA driver found (libcuda.so.1: cannot open shared object file; "
                           "libcuda.so: cannot open shared object file)")
