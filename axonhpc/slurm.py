"""SLURM batch scripts from the templates in ``slurm/``: ``axonhpc slurm render``.

[Note: template syntax]
A template is a bash batch script with four additions, all resolved here:

- ``{{name}}`` is replaced by the value of option ``name``. A placeholder whose
  option has no value (``{{gpus_per_node}}`` without ``--gpus-per-node``) is
  an error naming the option, so a template states what it needs by using it.
- A line that starts with ``{{?name}}`` is kept (without the guard) only when
  option ``name`` is set (given, or true); ``{{!name}}`` keeps it only when it
  is not; ``{{?name=value}}`` / ``{{!name=value}}`` compare with a value.
  Guards may be chained: ``{{?requeue}}{{?time}}...``.
- A line that starts with ``#@`` is a note for template authors and never
  reaches the output (so it may mention ``{{name}}`` freely). ``#@ require A OP
  B[: reason]`` is a check: A and B are option names or integers, OP one of
  ``== != < <= > >=``; when it fails the reason is part of the error.
- Any other ``{{`` is an error, as is a placeholder or guard naming an
  unknown option, so a typo in a template never passes through silently.

[Note: quoting]
Scheduler values (counts, the time limit, partition, account, job name,
directories) are validated against narrow patterns and inserted as they are:
they land in ``#SBATCH`` lines, which sbatch reads itself, where shell quotes
would be taken literally. The program and its arguments are arbitrary text and
are shell-quoted word by word (``shlex.quote``); a word holding a control
character (a newline, a tab, ...) is written in bash's ``$'...'`` form instead,
so every rendered value is a single line. ``render`` refuses any value with a
line break, so no value can end a comment or an ``#SBATCH`` line and start a
command of its own.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .errors import ConfigurationError, MissingValueError, TemplateError, TemplateNotFoundError

TEMPLATE_SUFFIX = ".sbatch"

_NAME = r"[a-z_][a-z0-9_]*"
_PLACEHOLDER = re.compile(r"\{\{(" + _NAME + r")\}\}")
_GUARD = re.compile(r"\{\{([?!])(" + _NAME + r")(?:=([A-Za-z0-9._-]*))?\}\}")
_REQUIRE = re.compile(r"require\s+([a-z_][a-z0-9_]*|[0-9]+)\s*(==|!=|<=|>=|<|>)\s*([a-z_][a-z0-9_]*|[0-9]+)"
                      r"\s*(?::\s*(.*))?$")
_DIGITS = re.compile(r"[0-9]+")
_COMPARE = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
}

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
    """``word`` as one bash word that expands to exactly ``word``, written on one line.

    Args:
        word: any text without a NUL byte (no program argument can hold one).

    Returns:
        ``shlex.quote(word)``, or for words with control characters the
        ``$'...'`` form with those characters escaped.

    Raises:
        ConfigurationError: ``word`` contains a NUL byte.
    """
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


# -- rendering ----------------------------------------------------------------------------------
def _spell(name: str) -> str:
    if name == "command":
        return "a program and its arguments after --"
    return option_flag(name) if name in _OPTION_NAMES else "{{" + name + "}}"


def _guards(line: str) -> Tuple[List[Tuple[str, str, Optional[str]]], str]:
    """The guards at the start of ``line`` (sign, name, value) and the rest of the line."""
    found = []
    while True:
        m = _GUARD.match(line)
        if not m:
            return found, line
        found.append((m.group(1), m.group(2), m.group(3)))
        line = line[m.end():]


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != ""


def _int_operand(token: str, values: Mapping[str, Any], lineno: int) -> Tuple[str, int]:
    if _DIGITS.fullmatch(token):
        return token, int(token)
    if token not in values:
        raise TemplateError(f"line {lineno}: '#@ require' names unknown option {token!r}")
    value = values[token]
    if value is None:
        raise MissingValueError(token, f"this template needs {_spell(token)}")
    try:
        return f"{_spell(token)} {value}", int(value)
    except (TypeError, ValueError):
        raise TemplateError(f"line {lineno}: '#@ require' compares {token!r}, which is not a number "
                            f"({value!r})") from None


def template_names(template_text: str) -> Set[str]:
    """Every option name a template uses: placeholders, guards and ``#@ require`` checks.

    Raises:
        TemplateError: a ``{{`` that is no valid placeholder or guard, or a
            malformed ``#@ require`` line; the message gives the line number.
    """
    names: Set[str] = set()
    for lineno, line in enumerate(template_text.split("\n"), 1):
        if line.startswith("#@"):
            body = line[2:].strip()
            if body.startswith("require"):
                m = _REQUIRE.match(body)
                if not m:
                    raise TemplateError(f"line {lineno}: cannot read {line.strip()!r} (use '#@ require A OP B: "
                                        "reason' with OP one of == != < <= > >=)")
                names.update(t for t in (m.group(1), m.group(3)) if not _DIGITS.fullmatch(t))
            continue
        guards, rest = _guards(line)
        names.update(name for _, name, _ in guards)
        names.update(_PLACEHOLDER.findall(rest))
        stray = _PLACEHOLDER.sub("", rest)
        if "{{" in stray:
            bad = stray[stray.index("{{"):][:40]
            raise TemplateError(f"line {lineno}: {bad!r} is not a placeholder ({{{{name}}}}, with name in "
                                "lower case) nor a guard at the start of the line ({{?name}}, {{!name}})")
    return names


def render(template_text: str, /, **values: Any) -> str:
    """Fill a template: placeholders, line guards and ``#@`` lines (see [Note: template syntax]).

    A pure function of its arguments. Values are inserted as given (callers
    quote; ``SlurmOptions.placeholders`` does): ``str`` and ``int`` values,
    with ``None`` meaning "not given"; ``bool`` values only work in guards.

    Args:
        template_text: the template.
        **values: one entry for every option the template names.

    Returns:
        The batch script.

    Raises:
        MissingValueError: a placeholder or check needs a value that is None.
        TemplateError: bad template syntax, an option the template names but
            ``values`` lacks, a flag used as a value, a value with a line
            break, or a failed ``#@ require`` check.
    """
    unknown = sorted(template_names(template_text) - set(values))
    if unknown:
        raise TemplateError(f"the template uses unknown option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(values))}")
    for name, value in values.items():
        if isinstance(value, str) and ("\n" in value or "\r" in value):
            raise TemplateError(f"the value of {_spell(name)} contains a line break: {value!r}")

    def substitute(m: "re.Match[str]") -> str:
        name = m.group(1)
        value = values[name]
        if value is None:
            raise MissingValueError(name, f"this template needs {_spell(name)}")
        if isinstance(value, bool):
            raise TemplateError(f"{{{{{name}}}}} is a flag: use it in a guard ({{{{?{name}}}}}), not as a value")
        return str(value)

    out: List[str] = []
    for lineno, line in enumerate(template_text.split("\n"), 1):
        if line.startswith("#@"):
            m = _REQUIRE.match(line[2:].strip())
            if m:
                left, op, right, reason = m.groups()
                (ltext, lval), (rtext, rval) = (_int_operand(left, values, lineno),
                                                _int_operand(right, values, lineno))
                if not _COMPARE[op](lval, rval):
                    why = f" ({reason.strip()})" if reason else ""
                    spelled = [t if _DIGITS.fullmatch(t) else _spell(t) for t in (left, right)]
                    got = ", ".join(text for token, text in ((left, ltext), (right, rtext))
                                    if not _DIGITS.fullmatch(token))
                    raise TemplateError(f"this template requires {spelled[0]} {op} {spelled[1]}{why}; got {got}")
            continue
        guards, rest = _guards(line)
        keep = True
        for sign, name, expected in guards:
            value = values[name]
            hit = _set(value) if expected is None else (value is not None and str(value) == expected)
            keep = keep and (hit if sign == "?" else not hit)
        if keep:
            out.append(_PLACEHOLDER.sub(substitute, rest))
    return "\n".join(out)


# -- options ------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and _DIGITS.fullmatch(value))):
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
    """Seconds in a SLURM time limit.

    Accepts SLURM's forms: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS``.

    Raises:
        ConfigurationError: another form, a field out of range, or zero.
    """
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
    """The validated values of one ``axonhpc slurm render`` call.

    Numbers may be given as ints or digit strings (the command line's). None
    means "not given": the template's line for it is left out, or a default
    applies (see ``placeholders``).

    Attributes:
        nodes: nodes to allocate.
        tasks_per_node: ranks per node.
        gpus_per_node: GPUs per node (the gpu template: one rank each).
        cpus_per_task: cores per rank (``OMP_NUM_THREADS`` follows it).
        time: SLURM time limit (``HH:MM:SS`` and SLURM's other forms).
        partition, account: where to run and whom to bill (``[A-Za-z0-9._-]``;
            partition may be a comma-separated list).
        job_name: ``[A-Za-z0-9._-]``; default ``axonhpc-TEMPLATE``.
        requeue: make the job requeueable and requeue it on the USR1 notice.
        resume: pass ``--resume`` to the script (default: the same as requeue).
        signal_seconds: seconds before the time limit that SLURM sends USR1
            to the batch shell (default 120, or half the time limit if shorter).
        mpi: ``srun --mpi`` plugin: ``pmi2`` (MPICH) or ``pmix`` (Open MPI).
        launcher: ``srun`` or ``mpiexec`` (``axonhpc launch``), where a template offers both.
        python: the interpreter the job runs (default: this one).
        log_dir: directory of the ``%x-%j.out`` / ``.err`` logs (must exist).
        chdir: the job's working directory (default: where sbatch ran).
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
        if not self.requeue:
            names.discard("requeue")
        if self.command:
            names.add("command")
        return names

    def placeholders(self, template: str = "job") -> Dict[str, Any]:
        """The values ``render`` gets: validated, defaults applied, the command quoted.

        Args:
            template: the template's name, for the default job name.
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
            "python": shell_quote(self.python or sys.executable),
            "log_dir": self.log_dir or ".",
            "chdir": self.chdir,
            "collective_timeout": timeout,
            "command": shell_join(self.command) if self.command else None,
            "args": shell_join(self.command),
        }


_ALWAYS = {"nodes", "tasks_per_node"}  # required by the command, used by every template
_OPTION_NAMES = {f.name for f in fields(SlurmOptions)}


# -- finding templates --------------------------------------------------------------------------
def template_dir() -> Path:
    """``slurm/`` beside the package: the repository root of a clone (``pip install -e .``)."""
    return Path(__file__).resolve().parent.parent / "slurm"


def available_templates(directory: Optional[Path] = None) -> List[str]:
    """Names of the templates in ``directory`` (default ``template_dir()``), sorted."""
    directory = template_dir() if directory is None else Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p.name[: -len(TEMPLATE_SUFFIX)] for p in directory.glob("*" + TEMPLATE_SUFFIX) if p.is_file())


def find_template(name_or_path: str, directory: Optional[Path] = None) -> Path:
    """The template file for a name (``cpu-ddp``, ``cpu-ddp.sbatch``) or a path.

    A word with a ``/`` is a path; a word ending in ``.sbatch`` is looked for
    in the current directory, then in ``slurm/``; any other word is a name.

    Raises:
        TemplateNotFoundError: no such template; the message lists the
            available ones.
    """
    directory = template_dir() if directory is None else Path(directory)
    candidates = []
    if "/" in name_or_path or os.sep in name_or_path:
        candidates.append(Path(name_or_path))
    else:
        if name_or_path.endswith(TEMPLATE_SUFFIX):
            candidates += [Path(name_or_path), directory / name_or_path]
        elif name_or_path and name_or_path not in (".", ".."):
            candidates.append(directory / (name_or_path + TEMPLATE_SUFFIX))
    for path in candidates:
        if path.is_file():
            return path
    names = available_templates(directory)
    if names:
        where = f"available: {', '.join(names)} (in {directory})"
    else:
        where = (f"no templates found in {directory} (slurm/ ships with a clone of the repository; "
                 "install with pip install -e . or give the path of a template file)")
    raise TemplateNotFoundError(f"no SLURM template {name_or_path!r}; {where}")


def template_name(path: Path) -> str:
    """The name a template file goes by (its file name without ``.sbatch``)."""
    name = path.name
    return name[: -len(TEMPLATE_SUFFIX)] if name.endswith(TEMPLATE_SUFFIX) else path.stem


def render_options(template_text: str, options: SlurmOptions, name: str = "job") -> str:
    """Render a template with validated options; what ``axonhpc slurm render`` prints.

    Unlike ``render``, an option set explicitly that the template never uses
    is an error (``--gpus-per-node`` for a CPU template is a mistake, not a
    detail to drop), and messages name the template.

    Args:
        template_text: the template.
        options: the validated options.
        name: the template's name, for messages and the default job name.

    Raises:
        TemplateError: as ``render``, or an option the template does not use.
    """
    used = template_names(template_text)
    if "args" in used:
        used.add("command")
    unused = sorted(options.given() - used)
    if unused:
        what = ["script arguments after --" if n == "command" else option_flag(n) for n in unused]
        raise TemplateError(f"template {name!r} does not use {', '.join(what)}")
    try:
        return render(template_text, **options.placeholders(name))
    except MissingValueError as exc:
        if exc.name == "command":
            raise MissingValueError(exc.name, f"template {name!r} runs a program: give it after --, e.g. "
                                    "-- examples/train_digits.py --epochs 5") from None
        raise MissingValueError(exc.name, _named(str(exc), name)) from None
    except TemplateError as exc:
        raise TemplateError(_named(str(exc), name)) from None


def _named(message: str, name: str) -> str:
    if message.startswith("this template "):
        return f"template {name!r} " + message[len("this template "):]
    return f"template {name!r}: {message}"


def render_file(template: str, options: SlurmOptions) -> str:
    """Find a template by name or path (``find_template``) and render it (``render_options``)."""
    path = find_template(template)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"cannot read template {str(path)!r}: {exc}") from None
    return render_options(text, options, template_name(path))


__all__ = [
    "SlurmOptions", "TemplateError", "MissingValueError", "TemplateNotFoundError", "render", "render_options",
    "render_file", "template_names", "template_dir", "available_templates", "find_template", "template_name",
    "shell_quote", "shell_join", "parse_time", "option_flag", "MPI_CHOICES", "LAUNCHER_CHOICES",
]
