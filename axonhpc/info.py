"""``ax.info()``: what this installation and this job are running on."""
from __future__ import annotations

import platform
import sys
from typing import Any, Dict, Optional

import numpy as np

from ._dtypes import bfloat16_dtype
from ._version import __version__
from .backends.cuda_aware import cuda_aware_mpi
from .backends.cuda_driver import (
    CUPY_PACKAGES,
    NCCL_PACKAGES,
    DriverFacts,
    extra_for,
    gpu_stack_problems,
    installed,
    read_driver,
    version_text,
)
from .backends.devices import GPU_EXTRA_HINT, device_facts
from .groups import is_initialized, current_world
from .groups.device_path import device_report
from .threads import current_plan, plan_threads

_THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def _mpi_facts() -> Dict[str, Any]:
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as exc:
        return {"mpi4py": None, "mpi_error": str(exc)}
    # Open MPI's string ends in a NUL byte, which .strip() keeps: it would reach the terminal and the JSON.
    version_line = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    return {
        "mpi4py": mpi4py.__version__,
        "mpi_library": " ".join(version_line.split()),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "mpi_vendor": "%s %s" % (MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
        "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        # "yes (how)" / "no (how)": see axonhpc.backends.cuda_aware for the order of the checks.
        "cuda_aware_mpi": str(cuda_aware_mpi()),
    }


def _driver(cupy_imported: bool) -> DriverFacts:
    """The CUDA driver's version: cupy's answer when cupy imports, else the driver library's, asked directly."""
    if cupy_imported:
        try:
            import cupy

            return DriverFacts(int(cupy.cuda.runtime.driverGetVersion()), None,
                               "cupy.cuda.runtime.driverGetVersion")
        except Exception:  # noqa: BLE001 - cupy's runtime unusable: ask the driver library itself
            pass
    return read_driver()


def _gpu_facts() -> Dict[str, Any]:
    facts = device_facts()
    driver = _driver(facts.cupy is not None)
    cupy_packages = installed(CUPY_PACKAGES)
    nccl_packages = installed(NCCL_PACKAGES)
    devices = facts.devices if facts.cupy is not None or driver.devices is None else driver.devices
    out: Dict[str, Any] = {
        "cuda_driver": version_text(driver.version) if driver.version else None,
        "cuda_driver_source": driver.source,
        "gpu_extra": extra_for(driver.version // 1000) if driver.version else None,
        "cupy": facts.cupy,
        "cupy_package": ", ".join(f"{n} {v}" for n, v in cupy_packages) or None,
        "cuda_devices": devices,
        "nccl": ".".join(map(str, facts.nccl)) if facts.nccl else None,
        "nccl_package": ", ".join(f"{n} {v}" for n, v in nccl_packages) or None,
    }
    problems = list(facts.problems) + gpu_stack_problems(driver.version, cupy_packages)
    if problems:
        out["gpu_problems"] = _concrete("; ".join(problems), out["gpu_extra"])
    return out


def _concrete(text: str, extra: Optional[str]) -> str:
    """``text`` with the generic install hint (which sends the reader to this command) made concrete: the
    extra for this machine's CUDA driver, or that there is no GPU here."""
    hint = (f"pip install axonhpc[{extra}] for this machine's CUDA driver" if extra
            else "no CUDA driver on this machine: the device path needs a GPU node")
    return text.replace(GPU_EXTRA_HINT, hint)


def _device_path(extra: Optional[str]) -> Dict[str, Any]:
    """What init decided: the backend for device arrays and this rank's device."""
    report = device_report()
    choice, binding = report.get("choice"), report.get("binding")
    out: Dict[str, Any] = {}
    if choice is not None:
        out["device_arrays"] = _concrete(f"{choice.device or choice.host}: {choice.reason}", extra)
    if binding is not None:
        physical = f", CUDA_VISIBLE_DEVICES entry {binding.physical}" if binding.physical else ""
        out["device"] = f"cuda:{binding.index}{physical} ({binding.reason})"
    elif choice is not None:
        out["device"] = None
    return out


def info() -> Dict[str, Any]:
    """MPI vendor, version, thread level, CUDA-awareness, CUDA driver, cupy/NCCL, device binding, ranks, nodes."""
    facts: Dict[str, Any] = {
        "axonhpc": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "bfloat16": bfloat16_dtype() is not None,
        "platform": sys.platform,
    }
    facts.update(_mpi_facts())
    facts.update(_gpu_facts())
    world = current_world() if (is_initialized() or facts.get("mpi4py")) else None
    if world is not None:
        facts.update(
            backend=world.backend.name,
            rank=world.rank,
            world_size=world.world_size,
            local_rank=world.local_rank,
            local_size=world.local_size,
            node_rank=world.node_rank,
            num_nodes=world.num_nodes,
        )
        facts.update(_device_path(facts.get("gpu_extra")))
        facts["threads"] = _thread_fact(world)
    return facts


def _thread_fact(world: Any) -> str:
    """The BLAS/OpenMP pool size init applied, or (under run_local or a local world) what it would be."""
    plan = current_plan() or plan_threads(world.usable_cores, world.cpu_sharers)
    return plan.describe().split(": ", 1)[1]
