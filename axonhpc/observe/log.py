"""One logger, "axonhpc", with the rank on every line; INFO and DEBUG from rank 0 only by default.

[Note: logging]
Every message of the library, and of ``ax.get_logger("myapp")``, goes to one stderr handler::

    [axonhpc rank 3/8] 2026-11-26 18:40:01 WARNING axonhpc.collectives: rank 3 has waited 30.0 s in ...

so interleaved ranks can be told apart (``grep "rank 3/"``). N copies of every progress line would
bury the one that matters, so INFO and DEBUG come only from ``ax.settings.log_ranks`` (default "0";
"all" or "0,5"); WARNING and above from every rank, since a rank's trouble is reported only by it.
``log_level`` and ``log_ranks`` are read at each record. The rank is the caller's world's (each
``run_local`` thread its own), else the launcher's, or "?". The logger does not propagate to the
root (no line twice under ``logging.basicConfig``); add handlers to ``logging.getLogger("axonhpc")``.
"""
from __future__ import annotations

import logging
import sys
from typing import Callable, Optional, Tuple

from ..settings import launcher_env, settings

LOGGER_NAME = "axonhpc"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # local time, to the second: lines of a run that spans days stay ordered
_rank_source: Optional[Callable[[], Optional[Tuple[int, int]]]] = None


def set_rank_source(source: Callable[[], Optional[Tuple[int, int]]]) -> None:
    """Tell the logger how to find the caller's ``(rank, world size)`` (the groups layer does)."""
    global _rank_source
    _rank_source = source


def world_facts() -> Optional[Tuple[int, int]]:
    """``(rank, world size)`` of the caller's world (a ``run_local`` thread's own), or None before ``ax.init``.

    For the layers that may not import the groups; it never builds a world.
    """
    return _rank_source() if _rank_source is not None else None


def _rank() -> Tuple[Optional[int], Optional[int]]:
    facts = world_facts()
    if facts is not None:
        return facts
    env = launcher_env()
    return env.rank, env.size


def _shown_ranks(text: str) -> Optional[set]:
    """The ranks of ``log_ranks`` ("all" gives None: every rank)."""
    if text.strip().lower() == "all":
        return None
    return {int(part) for part in text.split(",") if part.strip()}


class _RankFilter(logging.Filter):
    """Adds ``rank``/``world_size`` to a record; drops INFO/DEBUG of ranks not in ``log_ranks``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.getLevelName(settings.log_level.upper()):
            return False
        rank, size = _rank()
        record.rank = "?" if rank is None else rank
        record.world_size = "?" if size is None else size
        if record.levelno >= logging.WARNING:
            return True
        shown = _shown_ranks(settings.log_ranks)
        return shown is None or (rank if rank is not None else 0) in shown


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401 - a property standing in for the attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


_handler: Optional[logging.Handler] = None


def get_logger(name: Optional[str] = None) -> logging.Logger:
    """The "axonhpc" logger, or its child ``axonhpc.<name>`` (see the module note).

    Args:
        name: a dotted name; names outside "axonhpc" are put under it
            ("myapp" becomes "axonhpc.myapp").
    """
    global _handler
    root = logging.getLogger(LOGGER_NAME)
    if _handler is None:
        _handler = _StderrHandler()
        _handler.setFormatter(logging.Formatter("[axonhpc rank %(rank)s/%(world_size)s] %(asctime)s %(levelname)s "
                                                "%(name)s: %(message)s", datefmt=TIME_FORMAT))
        _handler.addFilter(_RankFilter())
        root.addHandler(_handler)
        root.setLevel(logging.DEBUG)  # the filter applies settings.log_level at each record
        root.propagate = False
    if not name or name == LOGGER_NAME:
        return root
    return logging.getLogger(name if name.startswith(LOGGER_NAME + ".") else f"{LOGGER_NAME}.{name}")


__all__ = ["get_logger", "set_rank_source", "world_facts", "LOGGER_NAME"]
