"""CUDA devices: what this process can use, which one it takes, and which backend moves device arrays.

[Note: device facts and backend choice]
Each decision is a pure function of plain values, tested without a GPU. One visible device (the gpu
template sets ``CUDA_VISIBLE_DEVICES`` per task) is device 0; otherwise local rank i takes
``i % visible_count``. "auto" takes NCCL when cupy, a device and NCCL are there; NCCL also refuses two ranks
on one device, known only once the node layout is.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Tuple

from ..errors import BackendUnavailableError, InvalidArgumentError, RankError

GPU_EXTRA_HINT = ("pip install axonhpc[gpu-cuda12] or axonhpc[gpu-cuda13], for the CUDA major the driver supports: "
                  "axonhpc info says which")


@dataclass(frozen=True)
class DeviceFacts:
    """What the device path can use in this process.

    Attributes:
        cupy: cupy's version, or None.
        devices: CUDA devices visible to this process (0 when none or unknown).
        nccl: NCCL's runtime version as (major, minor, patch), or None.
        problems: why each missing part is missing.
    """

    cupy: Optional[str] = None
    devices: int = 0
    nccl: Optional[Tuple[int, int, int]] = None
    problems: Tuple[str, ...] = ()


def nccl_version_tuple(code: int) -> Tuple[int, int, int]:
    """(major, minor, patch) of an ``ncclGetVersion`` code (2.8.4 is 2804, 2.10.3 is 21003)."""
    code = int(code)
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def device_facts(import_module: Optional[Callable[[str], Any]] = None) -> DeviceFacts:
    """Look at cupy, the CUDA devices and NCCL; never raises.

    cupy is imported only when installed; a machine without it pays one ``find_spec``.
    """
    if import_module is None:
        if importlib.util.find_spec("cupy") is None:
            return DeviceFacts(problems=(f"cupy is not installed ({GPU_EXTRA_HINT})",))
        import_module = importlib.import_module
    problems: List[str] = []
    try:
        cupy = import_module("cupy")
    except Exception as exc:  # noqa: BLE001 - any import failure means "no cupy"
        return DeviceFacts(problems=(f"cupy failed to import: {type(exc).__name__}: {exc}",))
    devices = 0
    try:
        devices = int(cupy.cuda.runtime.getDeviceCount())
        if devices < 1:
            problems.append("no CUDA device is visible to this process")
    except Exception as exc:  # noqa: BLE001 - no driver, no device, wrong driver: all mean none
        problems.append(f"no usable CUDA device: {type(exc).__name__}: {exc}")
    nccl_version = None
    try:
        nccl = import_module("cupy.cuda.nccl")
        if not getattr(nccl, "available", False):
            problems.append("cupy cannot load NCCL (install nvidia-nccl-cu12 or -cu13 for cupy's CUDA major, part of "
                            "axonhpc[gpu-cuda12] and axonhpc[gpu-cuda13])")
        else:
            nccl_version = nccl_version_tuple(nccl.get_version())
    except Exception as exc:  # noqa: BLE001
        problems.append(f"NCCL is not usable: {type(exc).__name__}: {exc}")
    return DeviceFacts(str(getattr(cupy, "__version__", "?")), devices, nccl_version, tuple(problems))


def device_problem(facts: DeviceFacts) -> Optional[str]:
    """Why NCCL cannot move device arrays here, or None when cupy, a device and NCCL are all present."""
    if facts.cupy is not None and facts.devices >= 1 and facts.nccl is not None:
        return None
    if facts.problems:
        return "; ".join(facts.problems)
    missing = [what for what, ok in (("cupy", facts.cupy is not None), ("a CUDA device", facts.devices >= 1),
                                     ("NCCL", facts.nccl is not None)) if not ok]
    return "missing " + ", ".join(missing)


# -- device binding --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceChoice:
    """The device one rank binds to.

    Attributes:
        index: the CUDA device index inside this process's visible set.
        shared: more ranks than devices on the node.
        physical: the ``CUDA_VISIBLE_DEVICES`` entry it maps to, when listed.
        reason: how the choice was made, for ``ax.info()``.
    """

    index: int
    visible: int
    shared: bool
    physical: Optional[str]
    reason: str


def visible_device_list(env: Mapping[str, str]) -> Optional[List[str]]:
    """The entries of ``CUDA_VISIBLE_DEVICES``; None when it is unset.

    An empty value hides every device. CUDA stops at the first invalid entry (such as -1), so this does too.
    """
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    entries: List[str] = []
    for item in text.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        entries.append(item)
    return entries


def select_device(local_rank: int, visible_count: Optional[int], env: Mapping[str, str]) -> DeviceChoice:
    """The device a rank uses, from its node-local rank; BackendUnavailableError if none is visible.

    ``visible_count``: devices the CUDA runtime reports; None takes the length of ``CUDA_VISIBLE_DEVICES``.
    """
    listed = visible_device_list(env)
    count = visible_count if visible_count is not None else (len(listed) if listed is not None else 0)
    if count < 1:
        where = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r})" if "CUDA_VISIBLE_DEVICES" in env else ""
        raise BackendUnavailableError(f"no CUDA device is visible to local rank {local_rank}{where}")
    if local_rank < 0:
        raise RankError(f"local_rank must be non-negative, got {local_rank}")
    if count == 1:
        index, shared = 0, False
        if listed:
            reason = f"the only visible device (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})"
        else:
            reason = "the only visible device"
    else:
        index, shared = local_rank % count, local_rank >= count
        reason = f"local rank {local_rank} of {count} visible devices"
        if shared:
            reason += f" (shared: local rank {local_rank} >= {count} devices)"
    physical = listed[index] if listed and index < len(listed) else None
    return DeviceChoice(index, count, shared, physical, reason)


def bind_device(choice: DeviceChoice) -> None:
    """Make ``choice.index`` cupy's current device for this thread (and so NCCL's)."""
    import cupy

    cupy.cuda.Device(choice.index).use()


# -- backend choice -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendChoice:
    """Which backends a world uses.

    Attributes:
        host: "mpi" or "local": moves numpy arrays (and device arrays when ``device`` is None).
        device: "nccl", or None.
        reason: why, for ``ax.info()``.
    """

    host: str
    device: Optional[str]
    reason: str


def choose_backend(requested: str, facts: Optional[DeviceFacts], mpi_available: bool) -> BackendChoice:
    """The backends for ``init(backend=requested)``; BackendUnavailableError, saying what is missing, if impossible."""
    if requested == "local":
        return BackendChoice("local", None, "backend='local' asked for")
    if requested == "mpi":
        if not mpi_available:
            raise BackendUnavailableError("backend 'mpi' needs mpi4py, which failed to import")
        return BackendChoice("mpi", None, "backend='mpi' asked for: device arrays go through MPI")
    problem = device_problem(facts) if facts is not None else "the devices were not looked at"
    if requested == "nccl":
        if problem is not None:
            raise BackendUnavailableError(f"backend 'nccl' cannot work here: {problem} "
                                          f"(NCCL needs cupy, a CUDA device per rank and the NCCL library)")
        if not mpi_available:
            raise BackendUnavailableError("backend 'nccl' needs mpi4py: NCCL's unique id is broadcast over MPI")
        return BackendChoice("mpi", "nccl", "backend='nccl' asked for")
    if requested != "auto":
        raise InvalidArgumentError(f"unknown backend {requested!r}")
    if not mpi_available:
        return BackendChoice("local", None, "mpi4py is not installed: one local rank")
    if problem is None:
        return BackendChoice("mpi", "nccl", "auto: cupy, a CUDA device and NCCL are present")
    return BackendChoice("mpi", None, f"auto: device arrays go through MPI ({problem})")


def check_one_device_per_rank(choice: DeviceChoice, local_size: int) -> Optional[str]:
    """Why NCCL cannot run with this binding (ranks of a node share a device), or None."""
    if local_size > choice.visible:
        return (f"{local_size} ranks on this node share {choice.visible} visible CUDA device(s); NCCL needs one "
                f"device per rank (start one rank per GPU, e.g. the slurm/gpu.sbatch template)")
    return None


__all__ = ["DeviceFacts", "DeviceChoice", "BackendChoice", "device_facts", "device_problem", "nccl_version_tuple",
           "visible_device_list", "select_device", "bind_device", "choose_backend", "check_one_device_per_rank"]
