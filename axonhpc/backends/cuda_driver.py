"""What the node offers for the device path, read without cupy: the CUDA driver, the GPU wheels installed.

[Note: why read the driver directly]
Which cupy to install depends on the CUDA version the *driver* supports (``cupy-cuda13x`` does not
load on a CUDA 12 driver), so ``axonhpc info`` must answer where cupy is missing or wrong.
``libcuda.so.1`` answers ``cuDriverGetVersion`` without ``cuInit`` or a device; counting devices
takes a ``cuInit``. Both go through ctypes, only from ``axonhpc info``, and every failure becomes a
reason instead of an exception.
"""
from __future__ import annotations

import ctypes
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import InvalidArgumentError

# The extras of pyproject.toml by the CUDA major their cupy and NCCL wheels are built for.
GPU_EXTRAS = {12: "gpu-cuda12", 13: "gpu-cuda13"}
# Distribution names cupy and NCCL ship under, newest CUDA first; "cupy" is the source build.
CUPY_PACKAGES = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
DRIVER_LIBRARIES = {"win32": ("nvcuda.dll",)}
DEFAULT_DRIVER_LIBRARIES = ("libcuda.so.1", "libcuda.so")


@dataclass(frozen=True)
class DriverFacts:
    """The CUDA driver as ``libcuda`` reports it.

    Attributes:
        version: ``cuDriverGetVersion``'s code (13000 is CUDA 13.0), or None.
        devices: ``cuDeviceGetCount`` after ``cuInit``, or None when not known.
        source: where the answer came from, or why there is none.
    """

    version: Optional[int]
    devices: Optional[int]
    source: str


def version_text(code: int) -> str:
    """``"13.0"`` for the driver code 13000 (``1000 * major + 10 * minor``, as in cuda.h)."""
    code = int(code)
    if code <= 0:
        raise InvalidArgumentError(f"a CUDA driver version code is positive, got {code}")
    return f"{code // 1000}.{(code % 1000) // 10}"


def extra_for(major: int) -> Optional[str]:
    """The pyproject extra whose cupy and NCCL run on a driver of CUDA ``major`` (None: older than 12).

    A newer major takes the newest extra: CUDA drivers run what older toolkits built.
    """
    if major < min(GPU_EXTRAS):
        return None
    return GPU_EXTRAS[min(major, max(GPU_EXTRAS))]


def package_cuda_major(name: str) -> Optional[int]:
    """13 for ``cupy-cuda13x`` or ``nvidia-nccl-cu13``; None for a name without a CUDA major (``cupy``)."""
    m = re.search(r"-cu(?:da)?(\d+)x?$", name)
    return int(m.group(1)) if m else None


def installed(names: Sequence[str], version_of: Optional[Callable[[str], str]] = None) -> List[Tuple[str, str]]:
    """``(name, version)`` of each distribution in ``names`` that is installed, in that order.

    ``version_of``: ``importlib.metadata.version`` unless given; imported here, not with axonhpc (it costs every
    rank of every job some 20 ms at start-up, for ``axonhpc info`` alone).
    """
    import importlib.metadata

    version_of = version_of or importlib.metadata.version
    found = []
    for name in names:
        try:
            found.append((name, version_of(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def read_driver(load: Optional[Callable[[str], Any]] = None, count_devices: bool = True) -> DriverFacts:
    """Ask the CUDA driver library for its version (and device count); never raises.

    ``load``: opens a shared library by name (``ctypes.CDLL``; injected by tests).
    """
    load = load or ctypes.CDLL
    names = DRIVER_LIBRARIES.get(sys.platform, DEFAULT_DRIVER_LIBRARIES)
    errors = []
    for name in names:
        try:
            lib = load(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        value = ctypes.c_int(0)
        status = lib.cuDriverGetVersion(ctypes.pointer(value))
        if status != 0 or value.value <= 0:
            return DriverFacts(None, None, f"{name} cuDriverGetVersion failed with CUresult {status}")
        devices = None
        if count_devices:
            status = lib.cuInit(0)
            count = ctypes.c_int(0)
            if status == 0 and lib.cuDeviceGetCount(ctypes.pointer(count)) == 0:
                devices = count.value
            elif status == 100:  # CUDA_ERROR_NO_DEVICE: a driver, no device (or none visible)
                devices = 0
        return DriverFacts(value.value, devices, f"{name} cuDriverGetVersion")
    return DriverFacts(None, None, "no CUDA driver found (" + "; ".join(errors) + ")")


def gpu_stack_problems(driver_version: Optional[int], cupy_packages: Sequence[Tuple[str, str]]) -> List[str]:
    """What is wrong with the installed cupy for this driver, as sentences (empty when nothing is)."""
    problems = []
    if len(cupy_packages) > 1:
        names = ", ".join(f"{n} {v}" for n, v in cupy_packages)
        problems.append(f"several cupy packages are installed ({names}); they overwrite each other: "
                        f"uninstall all but one")
    if driver_version is None:
        return problems
    driver_major = int(driver_version) // 1000
    for name, _ in cupy_packages:
        major = package_cuda_major(name)
        if major is not None and major > driver_major:
            fix = extra_for(driver_major)
            hint = f"install axonhpc[{fix}] instead" if fix else "update the driver"
            problems.append(f"{name} needs a CUDA {major} driver but this driver supports CUDA "
                            f"{version_text(driver_version)}: {hint}")
    return problems


__all__ = ["DriverFacts", "GPU_EXTRAS", "CUPY_PACKAGES", "NCCL_PACKAGES", "version_text", "extra_for",
           "package_cuda_major", "installed", "read_driver", "gpu_stack_problems"]
