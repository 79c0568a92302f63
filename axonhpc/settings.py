"""The one settings object, and the only place that reads the environment.

[Note: settings]
Modelled on mpi4py's ``rc``: a typed object with a default for every field,
filled once from ``AXONHPC_*`` variables when first used, and changed by
assignment (``ax.settings.timeout = 30``) or by arguments to ``ax.init``.
Functions take explicit arguments; this object only supplies their defaults.
The scheduler and launcher variables (SLURM, PMI, Open MPI) are read here too,
so that no other module touches ``os.environ``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _parse_timeout(name: str, text: str) -> Optional[float]:
    low = text.strip().lower()
    if low in ("", "none", "off", "0"):
        return None
    value = float(low)
    if value < 0:
        raise ValueError(f"{name}={text!r} must be a positive number of seconds, or 0/off")
    return value


def _parse_positive_int(name: str, text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError(f"{name}={text!r} must be a positive integer")
    return value


def _parse_count(name: str, text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"{name}={text!r} must be a non-negative integer")
    return value


def _parse_signal(name: str, text: str) -> str:
    value = text.strip().upper()
    if value in ("", "NONE", "OFF", "0"):
        return ""
    value = value if value.startswith("SIG") else "SIG" + value
    import signal

    if not hasattr(signal, value):
        raise ValueError(f"{name}={text!r} is not a signal name (e.g. SIGUSR1)")
    return value


def _parse_seconds(name: str, text: str) -> float:
    value = float(text.strip())
    if not value > 0:
        raise ValueError(f"{name}={text!r} must be a positive number of seconds")
    return value


def _parse_choice(name: str, text: str, choices: tuple) -> str:
    value = text.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={text!r} must be one of {', '.join(choices)}")
    return value


# The all-reduce algorithms (see axonhpc.collectives.algorithms).
ALGORITHMS = ("native", "hierarchical", "ring", "rhd")

# The largest element count one MPI call takes with a C int count.
MPI_INT_MAX = 2**31 - 1


@dataclass
class Settings:
    """Library-wide defaults.

    Attributes:
        debug: check that all ranks call the same collective with the same
            dtype, shape, op and root before running it (``AXONHPC_DEBUG``).
        timeout: seconds a blocking call may wait before raising
            ``CollectiveTimeoutError``; ``None`` waits forever (``AXONHPC_TIMEOUT``).
        abort_on_exception: an uncaught exception on one rank aborts the whole
            MPI job instead of leaving the other ranks waiting
            (``AXONHPC_ABORT_ON_EXCEPTION``; ``axonhpc launch`` turns it on).
        backend: backend ``init()`` picks by default (``AXONHPC_BACKEND``).
        max_message_elements: the most elements one MPI call moves; larger
            buffers are sent in chunks (``AXONHPC_MAX_MESSAGE_ELEMENTS``).
        stall_report: with ``debug``, seconds a blocking collective with a
            timeout may wait before the rank prints what it waits for, once
            (``AXONHPC_STALL_REPORT``).
        flight_recorder: collectives each rank remembers for the flight
            recorder; 0 turns it off (``AXONHPC_FLIGHT_RECORDER``).
        flight_dir: where the recorder writes ``flight-rank<r>.json``
            (``AXONHPC_FLIGHT_DIR``).
        flight_signal: the signal that makes every rank dump its recorder, or
            "" for none (``AXONHPC_FLIGHT_SIGNAL``).
        skip_nonfinite_steps: the trainer checks the gradients before each
            optimizer step and skips it on every rank if any rank has an inf or
            NaN (``AXONHPC_SKIP_NONFINITE_STEPS``).
        allreduce_algorithm: how ``all_reduce`` runs when the call does not
            say: "native" (one MPI call), "hierarchical" (inside each node,
            then across nodes), "ring" (reduce-scatter and all-gather around a
            ring) or "rhd" (recursive halving-doubling);
            ``AXONHPC_ALLREDUCE_ALGORITHM``.
    """

    debug: bool = False
    timeout: Optional[float] = None
    abort_on_exception: bool = False
    backend: str = "auto"
    max_message_elements: int = MPI_INT_MAX
    allreduce_algorithm: str = "native"
    stall_report: float = 30.0
    flight_recorder: int = 256
    flight_dir: str = "axonhpc-flight"
    flight_signal: str = "SIGUSR1"
    skip_nonfinite_steps: bool = False

    def load_environment(self, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        """Fill every field whose ``AXONHPC_*`` variable is set.

        Args:
            environ: the mapping to read (``os.environ`` if None).

        Returns:
            self.

        Raises:
            ValueError: a variable holds a value its field cannot take; the
                message names the variable and the value.
        """
        env = os.environ if environ is None else environ
        for name, (var, parse) in _ENVIRONMENT.items():
            if var in env:
                setattr(self, name, parse(var, env[var]))
        return self

    def as_dict(self) -> dict:
        """The public fields and their current values."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# field name -> (environment variable, parser(variable name, text))
_ENVIRONMENT = {
    "debug": ("AXONHPC_DEBUG", _parse_bool),
    "timeout": ("AXONHPC_TIMEOUT", _parse_timeout),
    "abort_on_exception": ("AXONHPC_ABORT_ON_EXCEPTION", _parse_bool),
    "backend": ("AXONHPC_BACKEND", lambda name, text: text.strip().lower()),
    "max_message_elements": ("AXONHPC_MAX_MESSAGE_ELEMENTS", _parse_positive_int),
    "flight_recorder": ("AXONHPC_FLIGHT_RECORDER", lambda name, text: _parse_count(name, text)),
    "flight_dir": ("AXONHPC_FLIGHT_DIR", lambda name, text: text),
    "flight_signal": ("AXONHPC_FLIGHT_SIGNAL", lambda name, text: _parse_signal(name, text)),
    "skip_nonfinite_steps": ("AXONHPC_SKIP_NONFINITE_STEPS", _parse_bool),
    "stall_report": ("AXONHPC_STALL_REPORT", lambda name, text: _parse_seconds(name, text)),
    "allreduce_algorithm": ("AXONHPC_ALLREDUCE_ALGORITHM", lambda name, text: _parse_choice(name, text, ALGORITHMS)),
}


@dataclass(frozen=True)
class LauncherEnv:
    """Rank facts a launcher or scheduler put in the environment (None if absent)."""

    source: Optional[str]
    rank: Optional[int]
    size: Optional[int]
    local_rank: Optional[int]
    node_rank: Optional[int]
    num_nodes: Optional[int]
    slurm_job_id: Optional[str]


def _int_or_none(env: Mapping[str, str], key: str) -> Optional[int]:
    text = env.get(key)
    if text is None or not text.strip().lstrip("-").isdigit():
        return None
    return int(text)


def launcher_env(environ: Optional[Mapping[str, str]] = None) -> LauncherEnv:
    """What SLURM, Open MPI or a PMI launcher says about this process.

    SLURM's step variables win when present (``srun`` sets them per task), then
    Open MPI's, then the PMI variables MPICH's hydra sets.

    Args:
        environ: the mapping to read (``os.environ`` if None).
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if "SLURM_PROCID" in env or "SLURM_NTASKS" in env:
        return LauncherEnv(
            "slurm",
            _int_or_none(env, "SLURM_PROCID"),
            _int_or_none(env, "SLURM_NTASKS") or _int_or_none(env, "SLURM_NPROCS"),
            _int_or_none(env, "SLURM_LOCALID"),
            _int_or_none(env, "SLURM_NODEID"),
            _int_or_none(env, "SLURM_JOB_NUM_NODES") or _int_or_none(env, "SLURM_NNODES"),
            job,
        )
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LauncherEnv(
            "openmpi",
            _int_or_none(env, "OMPI_COMM_WORLD_RANK"),
            _int_or_none(env, "OMPI_COMM_WORLD_SIZE"),
            _int_or_none(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _int_or_none(env, "OMPI_COMM_WORLD_NODE_RANK"),
            None,
            job,
        )
    if "PMI_SIZE" in env or "PMI_RANK" in env:
        return LauncherEnv(
            "pmi",
            _int_or_none(env, "PMI_RANK"),
            _int_or_none(env, "PMI_SIZE"),
            _int_or_none(env, "MPI_LOCALRANKID"),
            None,
            None,
            job,
        )
    return LauncherEnv(None, None, None, None, None, None, job)


settings = Settings()
settings.load_environment()

__all__ = ["Settings", "settings", "LauncherEnv", "launcher_env", "MPI_INT_MAX"]
