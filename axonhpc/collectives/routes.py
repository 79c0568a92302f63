"""The route of one collective call, chosen in one place: ``choose``.

[Note: choosing a route]
Once a call's arguments are checked, ``choose`` picks its route, in this order:

1. ``ONE_RANK``: an all-reduce over one rank is the identity (every op, AVG too).
2. ``STAGED``: a large blocking all-reduce of a device array that MPI cannot take directly goes through
   pinned host memory in chunks (``staged_path``).
3. ``NODE``: the node's shared-memory engine, whose kernels finish the op (``shm_path``), or
   ``NODE_WIDENED``: the engine with AVG's division or a 16-bit float's float32 copy around it.
4. ``RING``: deterministic mode with no shared memory (several nodes): the ring's fixed order.
5. ``BACKEND``: the group's backend (MPI, NCCL, threads), AVG and 16-bit floats handled as for the engine.

Every input (the settings, the group, the array's kind, dtype, size and whether it lies in a shared
window, the op) is equal on every rank of a correct program, so all ranks take the same route. A
blocking call on a plain host array never gets here: ``fast_path.attempt`` runs it on the route
``shm_path.plain_route`` keeps per group, ``NODE`` or ``BACKEND``. The choice is not cached per call
shape: it needs the window lookup of the array's address each time, and the rest is a few attribute reads.
"""
from __future__ import annotations

import enum
from typing import Any, Optional, Tuple

from ..backends.base import ReduceOp
from . import shm_path, staged_path


class Route(enum.Enum):
    """Where one collective call runs (see the module note)."""

    ONE_RANK = "one rank"
    STAGED = "staged in chunks"
    NODE = "node engine"
    NODE_WIDENED = "node engine, widened"
    RING = "ring"
    BACKEND = "backend"


# The members as module names: an Enum class's attribute read costs about 0.2 us, on every call.
ONE_RANK, STAGED, NODE, NODE_WIDENED, RING, BACKEND = Route


def choose(pg: Any, x: Any, op_name: str, op: Optional[ReduceOp] = None,
           async_op: bool = False) -> Tuple[Route, Optional[Any]]:
    """The route of ``op_name`` on ``x`` over ``pg`` and, for the engine's routes, its path (collective on a group's
    first use of the engine).

    ``op``: the reduction (None for broadcast and all-gather).
    """
    if op_name == "all_reduce":
        if pg.size == 1:
            return ONE_RANK, None
        if staged_path.takes(pg, x, op, async_op):
            return STAGED, None
    fixed = op is not None and shm_path.fixed_order(x, op)
    node = shm_path.path(pg, x, op_name, reduction=op is not None, any_size=fixed, op=op)
    if node is not None:
        return (NODE if op is None or node.fuses(op, x) else NODE_WIDENED), node
    if fixed and pg.size > 1:
        return RING, None
    return BACKEND, None


__all__ = ["Route", "choose", "ONE_RANK", "STAGED", "NODE", "NODE_WIDENED", "RING", "BACKEND"]
