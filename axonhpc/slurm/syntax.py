"""The template language of ``slurm/``: placeholders, line guards and ``#@`` lines (``render``, ``template_names``).

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
"""
from __future__ import annotations

import re
from typing import Any, List, Mapping, Optional, Set, Tuple

from ..errors import MissingValueError, TemplateError
from .options import DIGITS, OPTION_NAMES, option_flag

_NAME = r"[a-z_][a-z0-9_]*"
_PLACEHOLDER = re.compile(r"\{\{(" + _NAME + r")\}\}")
_GUARD = re.compile(r"\{\{([?!])(" + _NAME + r")(?:=([A-Za-z0-9._-]*))?\}\}")
_REQUIRE = re.compile(r"require\s+([a-z_][a-z0-9_]*|[0-9]+)\s*(==|!=|<=|>=|<|>)\s*([a-z_][a-z0-9_]*|[0-9]+)"
                      r"\s*(?::\s*(.*))?$")
_COMPARE = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
}


def _spell(name: str) -> str:
    if name == "command":
        return "a program and its arguments after --"
    return option_flag(name) if name in OPTION_NAMES else "{{" + name + "}}"


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
    if DIGITS.fullmatch(token):
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
                names.update(t for t in (m.group(1), m.group(3)) if not DIGITS.fullmatch(t))
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

    A pure function. Values are inserted as given (callers quote; ``SlurmOptions.placeholders`` does):
    ``str`` and ``int``, ``None`` meaning "not given"; ``bool`` values only work in guards.

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
                    spelled = [t if DIGITS.fullmatch(t) else _spell(t) for t in (left, right)]
                    got = ", ".join(text for token, text in ((left, ltext), (right, rtext))
                                    if not DIGITS.fullmatch(token))
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


__all__ = ["render", "template_names"]
