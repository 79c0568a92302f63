"""Option enums named by strings: one parse rule and one error for all of them.

A reduce op, a sharding strategy, a pipeline schedule, a gradient sync
strategy and a parameter-server mode can each be given as its enum member or
as a string. ``parse_choice`` is the one rule that turns such a string into a
member: case and surrounding blanks do not matter, ``-`` and ``_`` are the
same, a member is found by its name or its value, and a few spellings may be
added per enum. A string that names nothing raises ``UnknownChoiceError``
(an ``InvalidArgumentError`` and a ``ConfigurationError``) listing what is
accepted.
"""

import enum
from typing import Any, Mapping, Optional, Type, TypeVar

from .errors import UnknownChoiceError

E = TypeVar("E", bound=enum.Enum)


def _key(text: str) -> str:
    return text.strip().lower().replace("-", "_")


def parse_choice(cls: Type[E], value: Any, what: str, aliases: Optional[Mapping[str, str]] = None) -> E:
    """The member of ``cls`` that ``value`` names.

    Args:
        cls: the enum.
        value: a member of ``cls``, or a string naming one by its name or its
            value (any case; ``-`` and ``_`` alike).
        what: what a member is, for the message ("reduce op").
        aliases: further spellings, mapped to a member's name.

    Returns:
        The member.

    Raises:
        UnknownChoiceError: ``value`` is neither a member nor a string naming one.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = _key(value)
        for member in cls:
            if key == member.name.lower() or (isinstance(member.value, str) and key == _key(member.value)):
                return member
        if aliases and key in aliases:
            return cls[aliases[key]]
    names = [member.value if isinstance(member.value, str) else member.name.lower() for member in cls]
    raise UnknownChoiceError(f"unknown {what} {value!r}; use one of {names}")
