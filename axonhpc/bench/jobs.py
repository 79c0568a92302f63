"""Benchmark drivers that start their own MPI jobs: environment, launch, result files.

A driver (run without mpiexec) launches ``mpiexec -n N python -m MODULE
--worker ... --out FILE`` once per configuration; rank 0 of the worker job
writes its result as JSON, and the driver reads it back.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import BenchError, InvalidArgumentError
from ..mpiexec import NOT_FOUND, find_mpiexec, mpiexec_flavour

from ..settings import THREAD_VARIABLES as THREAD_ENV


def worker_env() -> Dict[str, str]:
    """This environment with one BLAS/OpenMP thread per rank, and a failing rank ending the job."""
    env = dict(os.environ)
    for var in THREAD_ENV:
        env[var] = "1"
    env["AXONHPC_ABORT_ON_EXCEPTION"] = "1"
    return env


def check_counts(parser: Any, args: Any, positive: Sequence[str], non_negative: Sequence[str] = ("warmup",)) -> None:
    """Refuse a count below 1 (``positive``) or below 0 (``non_negative``).

    Calls ``parser.error`` (exit 2) naming the option and its value.
    """
    for names, least in ((positive, 1), (non_negative, 0)):
        for name in names:
            value = getattr(args, name)
            if value < least:
                parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")


def parse_counts(text: str, option: str, what: str, least: int = 1, min_items: int = 1) -> List[int]:
    """A comma-separated list of integers ("4096,65536" -> [4096, 65536]), each at least ``least``.

    The one parser of the benchmarks' list options (``--sizes``, ``--ranks``); ``what`` names the items in
    messages ("sizes in bytes"), and there must be ``min_items`` of them or more.

    Raises:
        InvalidArgumentError: (a ValueError) a word that is not an integer, too few items, or an item below
            ``least``; the message names ``option`` and the offending values.
    """
    words = [w.strip() for w in text.split(",") if w.strip()]
    try:
        values = [int(w) for w in words]
    except ValueError:
        bad = [w for w in words if not w.lstrip("+-").isdigit()]
        raise InvalidArgumentError(f"{option} must be comma-separated integers ({what}), got {text!r}: "
                                   f"{', '.join(map(repr, bad))} is not an integer") from None
    if len(values) < min_items:
        raise InvalidArgumentError(f"{option} needs at least {min_items} {what}, got {text!r}")
    small = [v for v in values if v < least]
    if small:
        raise InvalidArgumentError(f"{option} must be at least {least} each ({what}), got {text!r}: "
                                   f"{', '.join(map(str, small))} {'is' if len(small) == 1 else 'are'} below {least}")
    return values


def write_result(result: Any, path: str) -> None:
    """Write a worker's JSON result atomically (the driver must never read half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def run_worker_job(mpiexec: str, n: int, module: str, worker_args: List[str], label: str,
                   timeout: float, env: Optional[Dict[str, str]] = None, mpiexec_args: Sequence[str] = ()) -> dict:
    """Run ``python -m module --out FILE *worker_args`` on ``n`` ranks; return rank 0's JSON result.

    ``env``: default ``worker_env()`` (one BLAS thread per rank); ``mpiexec_args``: e.g. ``--with-ft ulfm``.
    Open MPI gets its root and oversubscription flags (more ranks than cores is normal here).

    Raises:
        BenchError: the job failed, timed out or wrote no result; the message
            has the command and the end of its output.
    """
    with tempfile.TemporaryDirectory(prefix="axonhpc-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [mpiexec]
        if mpiexec_flavour(mpiexec) == "openmpi":
            cmd += (["--allow-run-as-root"] if os.geteuid() == 0 else []) + ["--oversubscribe"]
        cmd += [*mpiexec_args, "-n", str(n), sys.executable, "-m", module, "--out", out, *worker_args]
        # A session of its own, so a timeout can end mpiexec and every rank it started.
        if env is None:
            env = worker_env()
        else:
            env = dict(env, AXONHPC_ABORT_ON_EXCEPTION="1")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise BenchError(f"{label} on {n} rank(s) did not finish within {timeout:g} s "
                             f"(raise --timeout?): {' '.join(cmd)}") from None
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((stdout + stderr).strip().splitlines()[-20:])
            raise BenchError(f"{label} on {n} rank(s) failed (exit status {proc.returncode}): "
                             f"{' '.join(cmd)}\n{tail}")
        with open(out) as f:
            return json.load(f)


def drive(name: str, run_jobs: Callable[[str], Any], table: Callable[[Any], str], json_path: Optional[str] = None,
          mpiexec_problem: Callable[[str], Optional[str]] = lambda mpiexec: None) -> int:
    """A driver's life: refuse to run under mpiexec, find mpiexec, run the jobs, print the table.

    Args:
        run_jobs: ``run_jobs(mpiexec)`` runs every job and returns their results.
        table: the text printed from those results.
        mpiexec_problem: why this mpiexec cannot run these jobs, or None.

    Returns:
        The exit status: 0, 1 (a job failed: ``BenchError``'s message on stderr) or 2 (no usable mpiexec).
    """
    if os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        print(f"axonhpc bench {name}: run it without mpiexec; it launches its own jobs", file=sys.stderr)
        return 2
    mpiexec = find_mpiexec()
    problem = NOT_FOUND if mpiexec is None else mpiexec_problem(mpiexec)
    if problem is not None:
        print(f"axonhpc bench {name}: {problem}", file=sys.stderr)
        return 2
    try:
        jobs = run_jobs(mpiexec)
    except BenchError as exc:
        print(f"axonhpc bench {name}: {exc}", file=sys.stderr)
        return 1
    if json_path:
        with open(json_path, "w") as f:
            json.dump(jobs, f, indent=1)
    print(table(jobs))
    sys.stdout.flush()
    return 0
