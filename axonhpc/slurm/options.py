"""The options of ``axonhpc slurm render``: ``SlurmOptions``, validated, and the shell quoting of their values.

[Note: quoting]
Scheduler values land in ``#SBATCH`` lines, which sbatch reads itself and where shell quotes would be taken
literally, so they are validated against narrow patterns and inserted as they are. The program and its
arguments are arbitrary text, shell-quoted word by word. ``render`` refuses any value with a line break, so
no value can end a comment or ``#SBATCH`` line and start a command.
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Sequence, Set, Tuple

from ..errors import ConfigurationError

DIGITS = re.compile(r"[0-9]+")

# sbatch reads these values in #SBATCH lines: refuse anything outside the set.
_WORD = re.compile(r"[A-Za-z0-9._-]+")
_WORD_LIST = re.compile(r"[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*")
_PATH = re.compile(r"[A-Za-z0-9._/+-]+")
_TIME = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")

MPI_CHOICES = ("pmi2", "pmix")
LAUNCHER_CHOICES = ("srun", "mpiexec")
DEFAULT_SIGNAL_SECONDS = 120
MAX_SIGNAL_SECONDS = 65535  # SLURM's limit for --signal=...@sig_time


def option_flag(name: str) -> str:
    """The command-line spelling of an option (``gpus_per_node`` -> ``--gpus-per-node``)."""
    return "--" + name.replace("_", "-")


# -- quoting ------------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ANSI_C_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "'": "\\'"}


def shell_quote(word: str) -> str:
    """``word`` as one bash word, on one line, that expands to exactly ``word``; ConfigurationError for a NUL byte."""
    if "\x00" in word:
        raise ConfigurationError(f"argument {word!r} contains a NUL byte, which no program argument can hold")
    if not _CONTROL.search(word):
        return shlex.quote(word)
    out = []
    for ch in word:
        if ch in _ANSI_C_ESCAPES:
            out.append(_ANSI_C_ESCAPES[ch])
        elif _CONTROL.match(ch):
            out.append("\\x%02x" % ord(ch))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def shell_join(words: Sequence[str]) -> str:
    """The words as a space-separated list of ``shell_quote``-d words."""
    return " ".join(shell_quote(w) for w in words)


# -- options ------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and DIGITS.fullmatch(value))):
        raise ConfigurationError(f"{option_flag(name)} must be a positive integer, got {value!r}")
    number = int(value)
    if number < 1 or (maximum is not None and number > maximum):
        limit = f" from 1 to {maximum}" if maximum is not None else ""
        raise ConfigurationError(f"{option_flag(name)} must be a positive integer{limit}, got {value!r}")
    return number


def _matching(name: str, value: Any, pattern: "re.Pattern[str]", what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ConfigurationError(f"{option_flag(name)} {value!r} is refused: {what}")
    return value


def parse_time(text: Any) -> int:
    """Seconds in a SLURM time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``); ConfigurationError otherwise."""
    m = _TIME.fullmatch(text) if isinstance(text, str) else None
    bad = ConfigurationError(f"--time {text!r} is not a SLURM time limit (use HH:MM:SS, MM, MM:SS or "
                             "D-HH[:MM[:SS]], e.g. 01:30:00)")
    if not m:
        raise bad
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        h, mi, s = (nums + [0, 0])[:3]
        if h > 23:
            raise bad
        total = int(days) * 86400 + h * 3600 + mi * 60 + s
        fixed = [mi, s]
    elif len(nums) == 3:
        h, mi, s = nums
        total, fixed = h * 3600 + mi * 60 + s, [mi, s]
    elif len(nums) == 2:
        mi, s = nums
        total, fixed = mi * 60 + s, [s]
    else:
        total, fixed = nums[0] * 60, []
    if any(x > 59 for x in fixed) or total == 0:
        raise bad
    return total


@dataclass(frozen=True)
class SlurmOptions:
    """The validated values of one ``axonhpc slurm render`` call; None means "not given" (see ``placeholders``).

    Attributes:
        gpus_per_node: GPUs per node (the gpu template: one rank each).
        cpus_per_task: cores per rank (``OMP_NUM_THREADS`` follows it).
        partition, account, job_name: ``[A-Za-z0-9._-]`` (partition may be a comma-separated list).
        requeue: make the job requeueable and requeue it on the USR1 notice.
        resume: pass ``--resume`` to the script (default: the same as requeue).
        signal_seconds: seconds before the time limit that SLURM sends USR1 (default 120, or half the limit).
        mpi: ``srun --mpi`` plugin: ``pmi2`` (MPICH) or ``pmix`` (Open MPI).
        launcher: ``srun`` or ``mpiexec`` (``axonhpc launch``), where a template offers both.
        fault_tolerant: ``axonhpc launch --fault-tolerant`` in the allocation (needs ``launcher="mpiexec"``).
        log_dir: directory of the ``%x-%j.out`` / ``.err`` logs (must exist).
        collective_timeout: seconds for ``AXONHPC_TIMEOUT`` in the job.
        command: the program (script) and its arguments, passed unchanged.
    """

    nodes: int
    tasks_per_node: int
    gpus_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    job_name: Optional[str] = None
    requeue: bool = False
    resume: Optional[bool] = None
    signal_seconds: Optional[int] = None
    mpi: Optional[str] = None
    launcher: Optional[str] = None
    fault_tolerant: bool = False
    python: Optional[str] = None
    log_dir: Optional[str] = None
    chdir: Optional[str] = None
    collective_timeout: Optional[float] = None
    command: Tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen record
        put("nodes", _positive_int("nodes", self.nodes))
        put("tasks_per_node", _positive_int("tasks_per_node", self.tasks_per_node))
        for name in ("gpus_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                put(name, _positive_int(name, getattr(self, name)))
        if self.time is not None:
            parse_time(self.time)
        if self.partition is not None:
            _matching("partition", self.partition, _WORD_LIST,
                      "use letters, digits, '.', '_', '-' (several partitions separated by ',')")
        for name in ("account", "job_name"):
            if getattr(self, name) is not None:
                _matching(name, getattr(self, name), _WORD, "use letters, digits, '.', '_' and '-' only")
        if not isinstance(self.requeue, bool):
            raise ConfigurationError(f"--requeue must be True or False, got {self.requeue!r}")
        if self.resume is not None and not isinstance(self.resume, bool):
            raise ConfigurationError(f"--resume must be True, False or None, got {self.resume!r}")
        if self.signal_seconds is not None:
            put("signal_seconds", _positive_int("signal_seconds", self.signal_seconds, MAX_SIGNAL_SECONDS))
            if self.time is not None and self.signal_seconds >= parse_time(self.time):
                raise ConfigurationError(f"--signal-seconds {self.signal_seconds} must be shorter than the time "
                                         f"limit --time {self.time} ({parse_time(self.time)} s)")
        if self.mpi is not None and self.mpi not in MPI_CHOICES:
            raise ConfigurationError(f"--mpi {self.mpi!r} is not one of {', '.join(MPI_CHOICES)} (pmi2 for MPICH, "
                                     "pmix for Open MPI; --mpi=none would start one-rank worlds)")
        if self.launcher is not None and self.launcher not in LAUNCHER_CHOICES:
            raise ConfigurationError(f"--launcher {self.launcher!r} is not one of {', '.join(LAUNCHER_CHOICES)}")
        if not isinstance(self.fault_tolerant, bool):
            raise ConfigurationError(f"--fault-tolerant must be True or False, got {self.fault_tolerant!r}")
        if self.fault_tolerant and self.launcher != "mpiexec":
            raise ConfigurationError(f"--fault-tolerant needs --launcher mpiexec (got {self.launcher or 'srun'}): "
                                     f"srun ends the whole step when a task dies, while Open MPI's mpiexec with "
                                     f"ULFM inside the allocation keeps the survivors running")
        if self.mpi is not None and self.launcher == "mpiexec":
            raise ConfigurationError(f"--mpi {self.mpi} chooses srun's MPI plugin, and --launcher mpiexec starts the "
                                     f"ranks without srun: drop --mpi, or use --launcher srun")
        if self.python is not None and (not isinstance(self.python, str) or not self.python.strip()):
            raise ConfigurationError(f"--python must name an interpreter, got {self.python!r}")
        for name in ("log_dir", "chdir"):
            if getattr(self, name) is not None:
                _matching(name, getattr(self, name), _PATH, "use letters, digits, '.', '_', '+', '-' and '/' only")
        if self.collective_timeout is not None:
            try:
                seconds = float(self.collective_timeout)
            except (TypeError, ValueError):
                seconds = float("nan")
            if not seconds > 0 or seconds == float("inf"):
                raise ConfigurationError(f"--collective-timeout must be a positive number of seconds, "
                                         f"got {self.collective_timeout!r}")
            put("collective_timeout", seconds)
        command = tuple(self.command)
        if not all(isinstance(w, str) for w in command):
            raise ConfigurationError(f"the command words must be strings, got {command!r}")
        for word in command:
            shell_quote(word)  # refuses NUL bytes
        put("command", command)

    @property
    def ntasks(self) -> int:
        """Ranks in the whole job (nodes x tasks per node)."""
        return self.nodes * self.tasks_per_node

    def given(self) -> Set[str]:
        """The options set explicitly (not left to a default), as placeholder names."""
        names = {f.name for f in fields(self) if f.name not in _ALWAYS and getattr(self, f.name) is not None}
        names.discard("command")
        for flag in ("requeue", "fault_tolerant"):
            if not getattr(self, flag):
                names.discard(flag)
        if self.command:
            names.add("command")
        return names

    def placeholders(self, template: str = "job") -> Dict[str, Any]:
        """The values ``render`` gets: validated, defaults applied, the command quoted.

        ``template``: the template's name, for the default job name.
        """
        default_name = f"axonhpc-{template}"
        signal = self.signal_seconds
        if signal is None:
            signal = DEFAULT_SIGNAL_SECONDS
            if self.time is not None:
                signal = max(1, min(signal, parse_time(self.time) // 2))
        timeout = None
        if self.collective_timeout is not None:
            timeout = f"{self.collective_timeout:g}"
        return {
            "nodes": str(self.nodes),
            "tasks_per_node": str(self.tasks_per_node),
            "ntasks": str(self.ntasks),
            "gpus_per_node": None if self.gpus_per_node is None else str(self.gpus_per_node),
            "cpus_per_task": None if self.cpus_per_task is None else str(self.cpus_per_task),
            "time": self.time,
            "partition": self.partition,
            "account": self.account,
            "job_name": self.job_name or (default_name if _WORD.fullmatch(default_name) else "axonhpc"),
            "requeue": self.requeue,
            "resume": self.requeue if self.resume is None else self.resume,
            "signal_seconds": str(signal),
            "mpi": self.mpi or "pmi2",
            "launcher": self.launcher or "srun",
            "fault_tolerant": self.fault_tolerant,
            "python": shell_quote(self.python or sys.executable),
            "log_dir": self.log_dir or ".",
            "chdir": self.chdir,
            "collective_timeout": timeout,
            "command": shell_join(self.command) if self.command else None,
            "args": shell_join(self.command),
        }


_ALWAYS = {"nodes", "tasks_per_node"}  # required by the command, used by every template
OPTION_NAMES = {f.name for f in fields(SlurmOptions)}


__all__ = ["SlurmOptions", "shell_quote", "shell_join", "parse_time", "option_flag", "MPI_CHOICES", "LAUNCHER_CHOICES"]
