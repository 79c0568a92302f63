"""The one settings object, and the only place that reads the environment.

[Note: settings]
Modelled on mpi4py's ``rc``: typed fields with defaults, filled once from
``AXONHPC_*`` variables, changed by assignment or by ``ax.init``'s
arguments. Functions take explicit arguments; this object only supplies
their defaults. Scheduler and launcher variables are read here too, so no
other module touches ``os.environ``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Dict, Mapping, Optional

from .errors import ConfigurationError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigurationError(f"{name}={text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _parse_timeout(name: str, text: str) -> Optional[float]:
    low = text.strip().lower()
    if low in ("", "none", "off", "0"):
        return None
    value = _number(name, text, float, "a positive number of seconds, or 0/off/none for no timeout")
    if value == 0:
        return None
    if not value > 0 or value == float("inf"):
        raise ConfigurationError(f"{name}={text!r} must be a positive number of seconds, or 0/off/none for no timeout")
    return value


def _number(name: str, text: str, kind: type, what: str):
    """``kind(text)``, or a ConfigurationError naming the variable, its value and what it takes."""
    try:
        return kind(text.strip())
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not a number: it must be {what}") from None


def _parse_positive_int(name: str, text: str) -> int:
    value = _number(name, text, int, "a positive integer")
    if value < 1:
        raise ConfigurationError(f"{name}={text!r} must be a positive integer")
    return value


def _parse_count(name: str, text: str) -> int:
    value = _number(name, text, int, "a non-negative integer")
    if value < 0:
        raise ConfigurationError(f"{name}={text!r} must be a non-negative integer")
    return value


def _parse_signal(name: str, text: str) -> str:
    value = text.strip().upper()
    if value in ("", "NONE", "OFF", "0"):
        return ""
    value = value if value.startswith("SIG") else "SIG" + value
    import signal

    if not hasattr(signal, value):
        raise ConfigurationError(f"{name}={text!r} is not a signal name (e.g. SIGUSR1)")
    return value


def _parse_seconds(name: str, text: str) -> float:
    value = _number(name, text, float, "a positive number of seconds")
    if not value > 0:
        raise ConfigurationError(f"{name}={text!r} must be a positive number of seconds")
    return value


def _parse_choice(name: str, text: str, choices: tuple) -> str:
    value = text.strip().lower()
    if value not in choices:
        raise ConfigurationError(f"{name}={text!r} must be one of {', '.join(choices)}")
    return value


LOG_LEVELS = ("debug", "info", "warning", "error")


def _parse_bucket_mb(name: str, text: str) -> str:
    value = text.strip().lower()
    if value == "auto":
        return value
    try:
        if float(value) > 0:
            return value
    except ValueError:
        pass
    raise ConfigurationError(f"{name}={text!r} must be 'auto' or a positive number of MiB")


def _parse_slot_bytes(name: str, text: str) -> int:
    value = _number(name, text, int, "a positive multiple of 4096")
    if value < 4096 or value % 4096:
        raise ConfigurationError(f"{name}={text!r} must be a positive multiple of 4096")
    return value


SHM_MAX_SLOTS = 63  # the engine keeps one call descriptor per slot in its 4 KiB control block (_shm.MAX_SLOTS)


def _parse_slots(name: str, text: str) -> int:
    value = _number(name, text, int, f"an integer from 1 to {SHM_MAX_SLOTS}")
    if not 1 <= value <= SHM_MAX_SLOTS:
        raise ConfigurationError(f"{name}={text!r} must be an integer from 1 to {SHM_MAX_SLOTS}")
    return value


def _parse_log_ranks(name: str, text: str) -> str:
    value = text.strip().lower().replace(" ", "")
    if value != "all" and not all(part.isdigit() for part in value.split(",")):
        raise ConfigurationError(f"{name}={text!r} must be 'all' or a comma list of ranks such as '0,3'")
    return value


# What ``init()`` may build (see axonhpc.groups.runtime.init).
BACKENDS = ("auto", "mpi", "nccl", "local")

# The all-reduce algorithms (see axonhpc.collectives.algorithms).
ALGORITHMS = ("native", "hierarchical", "ring", "rhd")

# How ``cuda_aware_mpi`` may be set: decide from the MPI library ("auto"), run a probe
# transfer in a subprocess as well ("probe"), or say so ("yes", "no").
CUDA_AWARE_CHOICES = ("auto", "probe", "yes", "no")


def _parse_cuda_aware(name: str, text: str) -> str:
    low = text.strip().lower()
    if low == "":
        return "auto"
    if low in _TRUE:
        return "yes"
    if low in _FALSE:
        return "no"
    return _parse_choice(name, text, CUDA_AWARE_CHOICES)


# The largest element count one MPI call takes with a C int count.
MPI_INT_MAX = 2**31 - 1


@dataclass
class Settings:
    """Library-wide defaults; each field is filled from the ``AXONHPC_<FIELD>`` variable named beside it.

    Attributes:
        debug: check that all ranks call the same collective with the same dtype, shape, op and root before
            running it (``AXONHPC_DEBUG``).
        timeout: seconds a blocking call may wait before raising ``CollectiveTimeoutError``; None waits forever
            (``AXONHPC_TIMEOUT``).
        abort_on_exception: an uncaught exception on one rank of a multi-rank MPI world prints its traceback and
            aborts the job instead of leaving the others waiting; on by default (``AXONHPC_ABORT_ON_EXCEPTION``;
            read when ``init`` builds the world).
        fault_tolerant: a dying rank must not end the job: ``init`` refuses unless MPI can survive it (Open MPI 5
            with ULFM, ``axonhpc launch --fault-tolerant``), and survivors' calls that need the dead rank raise
            ``PeerFailedError`` (``AXONHPC_FAULT_TOLERANT``; see docs/fault-tolerance.md).
        backend: backend ``init()`` picks by default (``AXONHPC_BACKEND``).
        max_message_elements: the most elements one MPI call moves; larger buffers go in chunks
            (``AXONHPC_MAX_MESSAGE_ELEMENTS``).
        stall_report: seconds a rank may wait in one collective before the watchdog reports, on every rank, who
            waits where (``AXONHPC_STALL_REPORT``).
        stall_timeout: seconds before the watchdog ends such a wait with ``CollectiveStallError`` (a proven
            deadlock ends it at once with ``DeadlockError``); None: never (``AXONHPC_STALL_TIMEOUT``, 0/off/none).
            ``timeout``, when set, still bounds every call.
        watchdog: run the watchdog thread (stall reports and timeout, deadlocks, SIGUSR1 dumps while blocked)
            (``AXONHPC_WATCHDOG``).
        flight_recorder: collectives each rank remembers for the flight recorder; 0 turns it off
            (``AXONHPC_FLIGHT_RECORDER``).
        straggler_every: every this many collectives of a group the ranks compare their arrival times at the
            last 100, and a rank last in 80% of them by more than ``straggler_margin`` is named in a warning;
            0 turns it off; must be the same on every rank (``AXONHPC_STRAGGLER_EVERY``).
        straggler_margin: seconds a last rank must trail the next by to count as late
            (``AXONHPC_STRAGGLER_MARGIN``).
        flight_dir: where the recorder writes ``flight-<run>-rank<r>.json`` (``AXONHPC_FLIGHT_DIR``).
        flight_signal: the signal that makes every rank dump its recorder, or "" (``AXONHPC_FLIGHT_SIGNAL``).
        skip_nonfinite_steps: the trainer skips an optimizer step on every rank if any rank's gradients hold an
            inf or NaN (``AXONHPC_SKIP_NONFINITE_STEPS``).
        allreduce_algorithm: ``all_reduce``'s default: "native" (one MPI call), "hierarchical" (inside each
            node, then across), "ring" or "rhd" (recursive halving-doubling) (``AXONHPC_ALLREDUCE_ALGORITHM``).
        cuda_aware_mpi: whether cupy arrays go to MPI directly: "auto" decides from the MPI library, "probe"
            also tries one device transfer in a subprocess, "yes"/"no" (or 1/0) say so; otherwise they are
            staged through pinned host memory (``AXONHPC_CUDA_AWARE_MPI``).
        staging_chunk_bytes: a blocking all-reduce of a larger staged cupy array runs as a pipeline of chunks
            this size, each chunk's copies overlapping its neighbours' reductions; 0 stages all at once
            (``AXONHPC_STAGING_CHUNK_BYTES``).
        timeline_dir: when set, ``init`` records this rank's timeline for the whole run and writes
            ``timeline-rank<r>.json`` there at exit (``AXONHPC_TIMELINE_DIR``; ``axonhpc timeline merge``).
        log_level: level of the "axonhpc" logger (``AXONHPC_LOG_LEVEL``).
        log_ranks: the world ranks whose INFO and DEBUG records are shown: "0", "0,3" or "all"; WARNING and above
            are shown from every rank (``AXONHPC_LOG_RANKS``).
        shm_collectives: "auto" runs all-reduce, reduce-scatter, all-gather and broadcast of at least
            ``shm_min_bytes`` through shared memory when the group is on one node; "off" always uses MPI
            (``AXONHPC_SHM_COLLECTIVES``).
        shm_min_bytes: the smallest message that takes the shared-memory path (``AXONHPC_SHM_MIN_BYTES``).
        shm_allgather_max_bytes: the largest all-gather result that takes the shared-memory path; beyond it MPI's
            single-copy transfers win (``AXONHPC_SHM_ALLGATHER_MAX_BYTES``).
        deterministic: float SUM, AVG and PRODUCT all-reduces and reduce-scatters reduce in an order fixed by
            the group size and the route, and DDP's bucket size is not measured, so the same job (same ranks,
            placement and settings) gives the same bits run after run. The route: a group on one node with
            ``shm_collectives`` on adds in rank order in the shared-memory engine; otherwise (several nodes,
            the engine off, threads as ranks) the ring's order. From 3 ranks the two differ in the last bits,
            so switching ``shm_collectives`` or the placement changes them (``AXONHPC_DETERMINISTIC``).
        bucket_size_mb: DDP's bucket cap when the call gives none: "auto" measures it at start-up
            (``parallel.ddp.autotune``), or a number of MiB (``AXONHPC_BUCKET_SIZE_MB``).
        shm_slot_bytes, shm_slots: each rank's segment: a message passes through ``shm_slots`` slots (1 to 63)
            of ``shm_slot_bytes`` (``AXONHPC_SHM_SLOT_BYTES``, ``AXONHPC_SHM_SLOTS``).
        check_collectives: compare every collective's kind, dtype, shape, op and root across the ranks and raise
            ``CollectiveMismatchError`` on all of them on a difference. On by default; off makes a mismatched
            call undefined, as in plain MPI (``AXONHPC_CHECK_COLLECTIVES``; cost in docs/performance.md).
        allow_tf32: let float32 GPU matrix products use TF32 tensor cores (10-bit mantissa inputs, float32
            accumulation), as PyTorch's ``allow_tf32``. Off by default; applied to cupy, process-wide, by the
            next ``nn`` call or ``nn.apply_matmul_precision()``; numpy ignores it (``AXONHPC_ALLOW_TF32``).
        fused_kernels: run ``nn``'s element-wise and row-wise work and the updates of optimizers built with
            ``fused=None`` as one kernel each: bit for bit on cupy; on numpy float32/float64 C-contiguous arrays
            compiled host kernels within the ulps ``tests/ext/test_host_kernels.py`` states (updates bit for bit).
            Off keeps the array code, for comparison (``AXONHPC_FUSED_KERNELS``).
        size_thread_pools: when the user set none of ``THREAD_VARIABLES``, ``init`` sizes this process's
            BLAS/OpenMP pools to its cores divided by the ranks of its node sharing them
            (``AXONHPC_SIZE_THREAD_POOLS``).
    """

    debug: bool = False
    timeout: Optional[float] = None
    abort_on_exception: bool = True
    fault_tolerant: bool = False
    backend: str = "auto"
    max_message_elements: int = MPI_INT_MAX
    allreduce_algorithm: str = "native"
    stall_report: float = 30.0
    stall_timeout: Optional[float] = 600.0
    watchdog: bool = True
    flight_recorder: int = 256
    straggler_every: int = 1000
    straggler_margin: float = 0.001
    flight_dir: str = "axonhpc-flight"
    flight_signal: str = "SIGUSR1"
    skip_nonfinite_steps: bool = False
    cuda_aware_mpi: str = "auto"
    staging_chunk_bytes: int = 4 << 20
    timeline_dir: str = ""
    log_level: str = "INFO"
    log_ranks: str = "0"
    shm_collectives: str = "auto"
    shm_min_bytes: int = 0
    shm_allgather_max_bytes: int = 256 << 10
    shm_slot_bytes: int = 256 << 10
    shm_slots: int = 4
    deterministic: bool = False
    bucket_size_mb: str = "auto"
    check_collectives: bool = True
    allow_tf32: bool = False
    fused_kernels: bool = True
    size_thread_pools: bool = True

    def load_environment(self, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        """Fill every field whose ``AXONHPC_*`` variable is set in ``environ`` (default ``os.environ``); returns self.

        Raises ConfigurationError naming every bad variable; no field is then changed.
        """
        env = os.environ if environ is None else environ
        values, problems = {}, []
        for name, (var, parse) in _ENVIRONMENT.items():
            if var in env:
                try:
                    values[name] = parse(var, env[var])
                except ConfigurationError as exc:
                    problems.append(str(exc))
        if problems:
            raise ConfigurationError("bad axonhpc environment variable" + ("s" if len(problems) > 1 else "")
                                     + ": " + "; ".join(problems))
        for name, value in values.items():
            setattr(self, name, value)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        """Assign a field, checked and converted by the parser of its ``AXONHPC_*`` variable (one rule for both:
        ``settings.timeout = "off"`` is None, ``= -1`` or ``= float("nan")`` raises ``ConfigurationError``)."""
        spec = _ENVIRONMENT.get(name)
        if spec is not None:
            value = _assigned(name, spec, value)
        object.__setattr__(self, name, value)
        # ``revision`` counts assignments: the hot paths cache what they derive
        # from the settings and check this one number instead of every field.
        object.__setattr__(self, "revision", self.__dict__.get("revision", 0) + 1)

    def as_dict(self) -> dict:
        """The public fields and their current values."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# field name -> (environment variable, parser(variable name, text))
_ENVIRONMENT = {
    "debug": ("AXONHPC_DEBUG", _parse_bool),
    "timeout": ("AXONHPC_TIMEOUT", _parse_timeout),
    "abort_on_exception": ("AXONHPC_ABORT_ON_EXCEPTION", _parse_bool),
    "fault_tolerant": ("AXONHPC_FAULT_TOLERANT", _parse_bool),
    "backend": ("AXONHPC_BACKEND", lambda name, text: _parse_choice(name, text, BACKENDS)),
    "max_message_elements": ("AXONHPC_MAX_MESSAGE_ELEMENTS", _parse_positive_int),
    "flight_recorder": ("AXONHPC_FLIGHT_RECORDER", lambda name, text: _parse_count(name, text)),
    "straggler_every": ("AXONHPC_STRAGGLER_EVERY", lambda name, text: _parse_count(name, text)),
    "straggler_margin": ("AXONHPC_STRAGGLER_MARGIN", lambda name, text: _parse_seconds(name, text)),
    "flight_dir": ("AXONHPC_FLIGHT_DIR", lambda name, text: text),
    "flight_signal": ("AXONHPC_FLIGHT_SIGNAL", lambda name, text: _parse_signal(name, text)),
    "skip_nonfinite_steps": ("AXONHPC_SKIP_NONFINITE_STEPS", _parse_bool),
    "stall_report": ("AXONHPC_STALL_REPORT", lambda name, text: _parse_seconds(name, text)),
    "stall_timeout": ("AXONHPC_STALL_TIMEOUT", _parse_timeout),
    "watchdog": ("AXONHPC_WATCHDOG", _parse_bool),
    "allreduce_algorithm": ("AXONHPC_ALLREDUCE_ALGORITHM", lambda name, text: _parse_choice(name, text, ALGORITHMS)),
    "cuda_aware_mpi": ("AXONHPC_CUDA_AWARE_MPI", _parse_cuda_aware),
    "staging_chunk_bytes": ("AXONHPC_STAGING_CHUNK_BYTES", lambda name, text: _parse_count(name, text)),
    "timeline_dir": ("AXONHPC_TIMELINE_DIR", lambda name, text: text.strip()),
    "log_level": ("AXONHPC_LOG_LEVEL", lambda name, text: _parse_choice(name, text, LOG_LEVELS).upper()),
    "log_ranks": ("AXONHPC_LOG_RANKS", lambda name, text: _parse_log_ranks(name, text)),
    "shm_collectives": ("AXONHPC_SHM_COLLECTIVES", lambda name, text: _parse_choice(name, text, ("auto", "off"))),
    "shm_min_bytes": ("AXONHPC_SHM_MIN_BYTES", lambda name, text: _parse_count(name, text)),
    "shm_allgather_max_bytes": ("AXONHPC_SHM_ALLGATHER_MAX_BYTES", lambda name, text: _parse_count(name, text)),
    "shm_slot_bytes": ("AXONHPC_SHM_SLOT_BYTES", lambda name, text: _parse_slot_bytes(name, text)),
    "shm_slots": ("AXONHPC_SHM_SLOTS", _parse_slots),
    "deterministic": ("AXONHPC_DETERMINISTIC", _parse_bool),
    "check_collectives": ("AXONHPC_CHECK_COLLECTIVES", _parse_bool),
    "allow_tf32": ("AXONHPC_ALLOW_TF32", _parse_bool),
    "fused_kernels": ("AXONHPC_FUSED_KERNELS", _parse_bool),
    "size_thread_pools": ("AXONHPC_SIZE_THREAD_POOLS", _parse_bool),
    "bucket_size_mb": ("AXONHPC_BUCKET_SIZE_MB", lambda name, text: _parse_bucket_mb(name, text)),
}


def _assigned(name: str, spec: tuple, value: object) -> object:
    """``value`` assigned to field ``name`` as its variable's parser reads it (the value's text: ``str(value)``;
    None reads as "none"); ConfigurationError naming the field, the value and the variable otherwise."""
    var, parse = spec
    label = f"ax.settings.{name}"
    text = "none" if value is None else os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    try:
        return parse(label, text)
    except ConfigurationError as exc:
        message = str(exc).replace(f"{label}={text!r}", f"{label}={value!r}", 1)
        raise ConfigurationError(f"{message} ({var} takes the same)") from None


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
    """What SLURM, Open MPI or a PMI launcher says about this process; SLURM's step variables win, then Open MPI's."""
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


# What the GPU path reads from the environment: the devices a process may see
# (CUDA_VISIBLE_DEVICES, and SLURM's record of the GPUs it bound), and the
# switches MPI libraries use for their device support (see backends.cuda_aware).
DEVICE_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "SLURM_STEP_GPUS",
    "SLURM_JOB_GPUS",
    "GPU_DEVICE_ORDINAL",
    "MPIR_CVAR_ENABLE_GPU",
    "MPICH_GPU_SUPPORT_ENABLED",
    "MV2_USE_CUDA",
    "I_MPI_OFFLOAD",
    "OMPI_MCA_opal_cuda_support",
)

# Variables by which a launcher tells a process that it is one rank of a job. A
# process that must start MPI on its own (the CUDA-aware probe) drops them, or it
# would try to join the job it was started from.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "HYDRA_", "MPI_LOCAL", "SLURM_")


def device_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The ``DEVICE_VARIABLES`` that are set in ``environ`` (``os.environ`` if None), by name."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in DEVICE_VARIABLES if name in env}


def standalone_environment(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of ``environ`` (``os.environ`` if None) without the launcher's rank variables, for a helper process."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES)}


# The variables that size a process's BLAS and OpenMP thread pools; any one set by the user is
# left alone (axonhpc.threads). ``axonhpc launch`` sets them for its ranks and names itself in
# THREADS_SET_BY, so that ``init`` can tell its launcher's value from the user's.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
THREADS_SET_BY = "AXONHPC_THREADS_SET_BY"


def thread_environment(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The ``THREAD_VARIABLES`` set to a non-empty value in ``environ``, and ``THREADS_SET_BY`` if it is."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in THREAD_VARIABLES + (THREADS_SET_BY,) if env.get(name, "").strip()}


settings = Settings()
settings.load_environment()

__all__ = ["Settings", "settings", "LauncherEnv", "launcher_env", "MPI_INT_MAX", "CUDA_AWARE_CHOICES",
           "DEVICE_VARIABLES", "device_env", "standalone_environment", "THREAD_VARIABLES", "THREADS_SET_BY",
           "thread_environment"]
