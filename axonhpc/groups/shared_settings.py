"""The settings every rank of a job must share, compared when the world is built.

[Note: settings the ranks must share]
Some settings decide which calls a collective makes, not just how one rank behaves: the debug
mode adds an exchange before every call, a timeout makes calls nonblocking and announces them, the
shared-memory settings choose the route, ``check_collectives`` the comparison step, and so on. Ranks
that differ there do not get different numbers: they wait forever in different calls (one rank in
the debug exchange, the others in the all-reduce). So their values travel in the all-gather that
builds the world (no extra message), and a difference raises ``ConfigurationError`` on every rank,
naming the setting and which ranks hold which value. Settings changed after ``init`` are not seen.
"""
from __future__ import annotations

import zlib
from typing import Any, Dict, List

import numpy as np

from ..errors import ConfigurationError
from ..settings import settings

# name -> how it is told apart: "bool", "on" (set or not), "int" or "str"
SHARED = {
    "debug": "bool", "timeout": "on", "check_collectives": "bool", "deterministic": "bool",
    "shm_collectives": "str", "shm_min_bytes": "int", "shm_allgather_max_bytes": "int", "shm_slot_bytes": "int",
    "shm_slots": "int", "max_message_elements": "int", "allreduce_algorithm": "str", "straggler_every": "int",
    "cuda_aware_mpi": "str", "staging_chunk_bytes": "int",
}
_WORDS = ("auto", "on", "off", "probe", "native", "hierarchical", "ring", "rhd")  # values shown by name


def _code(kind: str, value: Any) -> int:
    if kind == "on":
        return int(value is not None)
    if kind == "str":
        return zlib.crc32(str(value).encode())
    return int(value)


def codes() -> np.ndarray:
    """This rank's shared settings as int64 words, in the order of ``SHARED``."""
    return np.array([_code(kind, getattr(settings, name)) for name, kind in SHARED.items()], dtype=np.int64)


def _shown(name: str, kind: str, code: int) -> str:
    if kind == "on":
        return "set" if code else "off"
    if kind == "bool":
        return "on" if code else "off"
    if kind == "str":
        names = {zlib.crc32(w.encode()): repr(w) for w in _WORDS + (str(getattr(settings, name)),)}
        return names.get(code, "another value")
    return str(code)


def check(table: np.ndarray, ranks: List[int]) -> None:
    """``table[i]``: rank ``ranks[i]``'s ``codes()``. Raises ConfigurationError (alike on every rank) on a difference."""
    problems = []
    for k, (name, kind) in enumerate(SHARED.items()):
        column = table[:, k].tolist()
        if len(set(column)) == 1:
            continue
        holders: Dict[int, List[int]] = {}
        for rank, code in zip(ranks, column):
            holders.setdefault(code, []).append(rank)
        problems.append(", ".join(f"{name}={_shown(name, kind, code)} on ranks {who}" for code, who in holders.items()))
    if problems:
        raise ConfigurationError(
            "settings that every rank must share differ between the ranks (each decides which calls a collective "
            "makes, so the ranks would wait in different calls): " + "; ".join(problems) + ". Set them alike on "
            "every rank: the AXONHPC_* variables of the launch, ax.init(debug=..., timeout=...), ax.settings")


__all__ = ["SHARED", "codes", "check"]
