"""Is MPI CUDA-aware? Decided once per process, without risking a crash.

[Note: deciding CUDA-awareness]
A device pointer handed to an MPI that is not CUDA-aware crashes the rank, so the answer comes from
what the library says about itself, never from a transfer in this process. First answer wins:

1. ``AXONHPC_CUDA_AWARE_MPI=yes|no`` (``ax.settings.cuda_aware_mpi``).
2. A switch turning GPU support off: ``MPIR_CVAR_ENABLE_GPU=0``, ``OMPI_MCA_opal_cuda_support=false``.
3. ``AXONHPC_CUDA_AWARE_MPI=probe``: one device transfer in a separate Python process without the
   launcher's rank variables; a crash there is a "no". It checks the library, not the network.
4. The library's query through ctypes (mpi4py wraps neither): ``MPIX_Query_cuda_support()`` (Open
   MPI, MPICH >= 4.1), else MPICH's ``MPIX_GPU_query_support``.
5. The vendor's switch: ``MPICH_GPU_SUPPORT_ENABLED=1``, ``MV2_USE_CUDA=1``, ``I_MPI_OFFLOAD>=1``.
6. The build: "MPICH configure:" naming ``--with-cuda``; ``ompi_info`` reporting
   ``mpi_built_with_cuda_support:value:true``.
7. Otherwise not: staging is always correct, only slower, so "unknown" means "stage".

``decide`` takes the ctypes query, ``ompi_info`` and the probe as callables, called only if reached.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple

Verdict = Optional[Tuple[bool, str]]  # (aware, how it was decided), or None: this step does not know


@dataclass(frozen=True)
class CudaAwareness:
    """Whether cupy arrays may go to MPI directly, and how that was decided."""

    aware: bool
    how: str

    def __str__(self) -> str:
        return f"{'yes' if self.aware else 'no'} ({self.how})"


_OFF = {"0", "false", "no", "off", "disable", "disabled"}
_ON = {"1", "true", "yes", "on", "enable", "enabled"}


def mpi_flavour(version_text: str) -> str:
    """"openmpi", "cray-mpich", "mvapich", "intel", "mpich" or "unknown", from ``MPI.Get_library_version()``."""
    text = version_text or ""
    if "Open MPI" in text:
        return "openmpi"
    if "CRAY MPICH" in text.upper():
        return "cray-mpich"
    if "MVAPICH" in text.upper():
        return "mvapich"
    if "Intel(R) MPI" in text or "Intel MPI" in text:
        return "intel"
    if "MPICH" in text:
        return "mpich"
    return "unknown"


def mpich_configured_with_cuda(version_text: str) -> Optional[bool]:
    """What the "MPICH configure:" line says about CUDA: True, False, or None when it does not say.

    MPICH may also find CUDA by itself at build time, so a line without ``--with-cuda`` proves nothing.
    """
    for line in (version_text or "").splitlines():
        if not line.strip().lower().startswith("mpich configure:"):
            continue
        for option in line.split()[2:]:
            if option == "--without-cuda" or option in ("--with-cuda=no", "--with-cuda=0"):
                return False
            if option == "--with-cuda" or option.startswith("--with-cuda="):
                return True
    return None


_OMPI_CUDA = re.compile(r"(?:^|:)(?:mpi|opal)_built_with_cuda_support:value:(true|false|1|0)\s*$", re.M)


def parse_ompi_info(text: str) -> Optional[bool]:
    """``ompi_info --parsable --all``'s ``..._built_with_cuda_support:value:`` line, or None."""
    m = _OMPI_CUDA.search(text or "")
    if m is None:
        return None
    return m.group(1) in ("true", "1")


def disabled_by_environment(flavour: str, env: Mapping[str, str]) -> Verdict:
    """A switch in the environment that turns the library's GPU support off."""
    if flavour in ("mpich", "cray-mpich", "intel", "mvapich", "unknown"):
        value = env.get("MPIR_CVAR_ENABLE_GPU")
        if value is not None and value.strip().lower() in _OFF:
            return False, f"MPIR_CVAR_ENABLE_GPU={value} turns MPICH's GPU support off"
    if flavour in ("openmpi", "unknown"):
        value = env.get("OMPI_MCA_opal_cuda_support")
        if value is not None and value.strip().lower() in _OFF:
            return False, f"OMPI_MCA_opal_cuda_support={value} turns Open MPI's CUDA support off"
    return None


def vendor_switch(flavour: str, env: Mapping[str, str]) -> Verdict:
    """The vendor's own switch for device buffers (Cray MPICH, MVAPICH2, Intel MPI)."""
    if flavour == "cray-mpich":
        value = env.get("MPICH_GPU_SUPPORT_ENABLED", "")
        on = value.strip().lower() in _ON
        return on, (f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED={value}" if value else
                    "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1")
    if flavour == "mvapich":
        value = env.get("MV2_USE_CUDA", "")
        on = value.strip().lower() in _ON
        return on, f"MVAPICH with MV2_USE_CUDA={value}" if value else "MVAPICH without MV2_USE_CUDA=1"
    if flavour == "intel":
        value = env.get("I_MPI_OFFLOAD", "").strip()
        on = value.isdigit() and int(value) >= 1
        return on, f"Intel MPI with I_MPI_OFFLOAD={value}" if value else "Intel MPI without I_MPI_OFFLOAD=1"
    return None


def decide(setting: str, version_text: str, env: Mapping[str, str],
           query: Callable[[], Verdict] = lambda: None,
           ompi_info: Callable[[], Optional[str]] = lambda: None,
           probe: Callable[[], Tuple[bool, str]] = lambda: (False, "no probe")) -> CudaAwareness:
    """The answer, following the module note.

    Args:
        setting: ``ax.settings.cuda_aware_mpi``: "auto", "probe", "yes" or "no".
        query: the library's own query (ctypes); None when it has none.
        ompi_info: the text of ``ompi_info --parsable --all``, or None.
        probe: runs the probe transfer; (aware, what happened).
    """
    if setting in ("yes", "no"):
        return CudaAwareness(setting == "yes", f"AXONHPC_CUDA_AWARE_MPI={setting}")
    flavour = mpi_flavour(version_text)

    def probed() -> Verdict:
        if setting != "probe":
            return None
        aware, what = probe()
        return aware, f"probe transfer: {what}"

    steps = (
        lambda: disabled_by_environment(flavour, env),
        probed,
        query,
        lambda: vendor_switch(flavour, env),
        lambda: _built_with(flavour, version_text, ompi_info),
    )
    for step in steps:
        verdict = step()
        if verdict is not None:
            return CudaAwareness(bool(verdict[0]), verdict[1])
    return CudaAwareness(False, f"no sign of CUDA support in this {flavour} library: staging through host memory")


def _built_with(flavour: str, version_text: str, ompi_info: Callable[[], Optional[str]]) -> Verdict:
    if flavour in ("mpich", "cray-mpich"):
        built = mpich_configured_with_cuda(version_text)
        if built is not None:
            return built, ("MPICH configured --with-cuda" if built else "MPICH configured without CUDA")
    if flavour == "openmpi":
        built = parse_ompi_info(ompi_info() or "")
        if built is not None:
            return built, f"ompi_info: built with CUDA support: {'true' if built else 'false'}"
    return None


# -- the real facts (need MPI) ---------------------------------------------------------------------
def query_loaded_library(library_path: str) -> Verdict:
    """Ask the loaded MPI library through ctypes (MPI must be initialised).

    ``library_path``: a loaded shared object that links the MPI library (mpi4py's ``MPI`` extension).
    """
    try:
        lib = ctypes.CDLL(library_path, mode=getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1))
    except OSError:
        return None
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, []
        value = int(query())
        return value == 1, f"MPIX_Query_cuda_support() returned {value}"
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        gpu_query.restype = ctypes.c_int
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        if gpu_query(0, ctypes.byref(flag)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA; 0 returned: MPI_SUCCESS
            return flag.value == 1, f"MPIX_GPU_query_support(CUDA) set {flag.value}"
    return None


def run_ompi_info(timeout: float = 30.0) -> Optional[str]:
    """``ompi_info --parsable --all`` (from PATH), or None."""
    exe = shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


PROBE_CODE = """
import cupy
from mpi4py import MPI
a = cupy.arange(64, dtype=cupy.float32)
b = cupy.zeros(64, dtype=cupy.float32)
c = cupy.zeros(64, dtype=cupy.float32)
cupy.cuda.get_current_stream().synchronize()
MPI.COMM_SELF.Sendrecv(a, 0, 7, b, 0, 7)
MPI.COMM_SELF.Allreduce(a, c, op=MPI.SUM)
print("axonhpc-probe", "ok" if bool((b == a).all()) and bool((c == a).all()) else "wrong-values")
"""


def run_probe(environ: Mapping[str, str], timeout: float = 120.0, python: Optional[str] = None) -> Tuple[bool, str]:
    """The probe transfer in a separate process (see the module note); (aware, what happened)."""
    try:
        out = subprocess.run([python or sys.executable, "-c", PROBE_CODE], capture_output=True, text=True,
                             timeout=timeout, env=dict(environ))
    except subprocess.TimeoutExpired:
        return False, f"did not finish in {timeout:g} s"
    except OSError as exc:
        return False, f"could not start: {exc}"
    return probe_outcome(out.returncode, out.stdout, out.stderr)


def probe_outcome(returncode: int, stdout: str, stderr: str) -> Tuple[bool, str]:
    """(aware, what happened) from the probe process's exit status and output."""
    if returncode == 0 and "axonhpc-probe ok" in stdout:
        return True, "a device send and all-reduce gave the right values"
    if returncode < 0:
        return False, f"the probe process died of signal {-returncode} (device pointers crash this MPI)"
    if "axonhpc-probe wrong-values" in stdout:
        return False, "the probe transfer returned wrong values"
    last = (stderr.strip().splitlines() or ["no output"])[-1]
    return False, f"the probe process failed (exit {returncode}): {last}"


_lock = threading.Lock()
_cached: Optional[CudaAwareness] = None


def cuda_aware_mpi(refresh: bool = False) -> CudaAwareness:
    """This process's answer (computed once; MPI is initialised on first use).

    ``refresh``: decide again (after changing ``ax.settings.cuda_aware_mpi``).
    """
    global _cached
    with _lock:
        if _cached is None or refresh:
            from mpi4py import MPI

            from ..settings import device_env, settings, standalone_environment

            _cached = decide(
                settings.cuda_aware_mpi,
                MPI.Get_library_version(),
                device_env(),
                query=lambda: query_loaded_library(MPI.__file__),
                ompi_info=run_ompi_info,
                probe=lambda: run_probe(standalone_environment()),
            )
        return _cached


def set_cached(value: Optional[CudaAwareness]) -> None:
    """Replace the cached answer (None forgets it); for tests and for ``init`` overrides."""
    global _cached
    with _lock:
        _cached = value


__all__ = ["CudaAwareness", "mpi_flavour", "mpich_configured_with_cuda", "parse_ompi_info",
           "disabled_by_environment", "vendor_switch", "decide", "query_loaded_library", "run_ompi_info",
           "run_probe", "probe_outcome", "cuda_aware_mpi", "set_cached", "PROBE_CODE"]
