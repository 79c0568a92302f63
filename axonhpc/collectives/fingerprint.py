"""Debug mode: all ranks agree on each collective before running it.

[Note: fingerprints]
With ``ax.settings.debug`` on, every collective first all-gathers a small fingerprint (sequence
number, operation, dtype, shape, op, root, caller's file:line) on a private channel of the group,
so every rank raises the same ``CollectiveMismatchError`` naming each rank's call instead of
hanging. The channel is split off on first need, which all ranks reach together (their first
collective on the group). With debug off the cost is one attribute test per call.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional

import numpy as np

from .._dtypes import is_cupy_array
from ..errors import CollectiveMismatchError, CollectiveRefusedError, everywhere
from .group_state import private_channel

_SLOT = 512  # bytes per rank in the exchanged table
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPARED = ("seq", "op", "dtype", "shape", "reduce", "root")


def call_name(op: str, seq: int, group: Any) -> str:
    """``all_reduce #7 on group world [0, 1]``: how messages name one call of a group."""
    return f"{op} #{seq} on group {group.name} {list(group.ranks)}"


def caller_location() -> str:
    """file:line of the first frame outside axonhpc (the user's call site)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def describe(fp: dict) -> str:
    """'all_reduce float32 (17, 17) op=SUM at train.py:42' (or what a refusing rank refused)."""
    if fp.get("refused"):
        return f"{fp['op']} at {fp['where']} (call #{fp['seq']}) and refused it: {fp['refused']}"
    parts = [fp["op"]]
    if fp.get("dtype"):
        parts.append(fp["dtype"])
    if fp.get("shape") is not None:
        parts.append(str(tuple(fp["shape"])))
    if fp.get("reduce"):
        parts.append(f"op={fp['reduce']}")
    if fp.get("root") is not None:
        parts.append(f"root={fp['root']}")
    return " ".join(parts) + f" at {fp['where']} (call #{fp['seq']})"


def describe_call(op: str, x: Any = None, reduce: Optional[str] = None, root: Optional[int] = None) -> str:
    """'all_reduce float32 (17, 17) op=SUM': a call without its site and number."""
    return describe(_fingerprint(op, x, reduce, root, 0, "")).rsplit(" at ", 1)[0]


def _fingerprint(op: str, x: Any, reduce: Optional[str], root: Optional[int], seq: int, where: str,
                 refused: Optional[str] = None) -> dict:
    if refused is not None:  # the array may be anything (it was refused): the call and the reason only
        return {"seq": seq, "op": op, "dtype": None, "shape": None, "reduce": None, "root": None, "where": where,
                "refused": refused}
    return {
        "seq": seq,
        "op": op,
        # A device array names its kind: in a world with NCCL, a cupy array on one rank and a
        # numpy array on another go to different backends and would never meet.
        "dtype": None if x is None else str(x.dtype) + (" on device" if is_cupy_array(x) else ""),
        "shape": None if x is None else list(x.shape),
        "reduce": reduce,
        "root": root,
        "where": where,
    }


def _encoded(fp: dict) -> bytes:
    """``fp`` as JSON in at most ``_SLOT`` bytes: a refusal's reason is shortened until it fits."""
    raw = json.dumps(fp).encode()
    while len(raw) > _SLOT and fp.get("refused"):
        fp["refused"] = fp["refused"][:max(0, len(fp["refused"]) - (len(raw) - _SLOT) - 4)] + "..."
        raw = json.dumps(fp).encode()
    return raw[:_SLOT]


def check(group, op: str, x: Any = None, reduce: Optional[str] = None, root: Optional[int] = None,
          seq: Optional[int] = None, refused: Optional[str] = None) -> None:
    """Compare this collective's fingerprint across the group; raise on any difference.

    ``seq``: the call's number (default: the group's next). ``refused``: this rank refused the call for
    this reason (``agreement.refuse_locally``).

    Raises:
        CollectiveRefusedError: on every rank, if some ranks refused the call and others did not.
        CollectiveMismatchError: on every rank, if any rank's call differs.
    """
    side = private_channel(group, "debug")
    seq = group.seq if seq is None else seq
    fp = _fingerprint(op, x, reduce, root, seq, caller_location(), refused)
    raw = _encoded(fp)
    mine = np.zeros(_SLOT, dtype=np.uint8)
    mine[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    table = np.empty((group.size, _SLOT), dtype=np.uint8)
    timeout = group.effective_timeout()
    # Nonblocking on every rank, whatever its timeout: MPI never matches MPI_Allgather with MPI_Iallgather.
    if timeout is None:
        side.all_gather(mine, table, async_op=True).wait(math.inf)
    else:  # a rank that never comes must not hang the exchange: watch it like the collective
        from . import watch

        arrivals = group.backend.announce(seq, op)
        # In debug mode every call is exchanged; otherwise this one explains a difference the check found.
        why = "debug fingerprint exchange" if group.debug_enabled() else "exchange of the calls after a mismatch"
        label = f"{call_name(op, seq, group)} ({why})"
        watch.wait(side.all_gather(mine, table, async_op=True), timeout, label, arrivals, group)
    prints = [json.loads(bytes(row).rstrip(b"\0").decode()) for row in table]
    keys = {tuple(json.dumps(p.get(k)) for k in _COMPARED) + (bool(p.get("refused")),) for p in prints}
    if len(keys) > 1:
        lines = ", ".join(f"rank {group.ranks[i]} called {describe(p)}" for i, p in enumerate(prints))
        refusing = [(group.ranks[i], p["refused"]) for i, p in enumerate(prints) if p.get("refused")]
        if refusing:  # a bad argument on some ranks, seen there before anything was sent: no dump
            rank, reason = refusing[0]
            raise everywhere(CollectiveRefusedError(f"{call_name(op, seq, group)}: rank "
                                                    f"{rank} refused its part before anything was sent: {lines}", rank,
                                                    reason), group.ranks)
        from . import flight

        flight.dump(f"collective mismatch on group {group.name}", group.world.rank)
        raise everywhere(CollectiveMismatchError(f"collective mismatch on group {group.name}: {lines}"), group.ranks)
