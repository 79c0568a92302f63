"""All-reduce algorithms built from the plain collectives: hierarchical (node, then across nodes).

"ring" and "rhd" live in ``collectives.ring``; ``run`` dispatches to every non-native algorithm.

[Note: hierarchical all-reduce]
Links inside a node are far faster than between nodes. With L ranks on each of K nodes:

1. reduce-scatter inside each node: local rank i holds the node's sum of part i (n / L elements);
2. all-reduce of part i among local rank i of every node: only n / L elements per rank cross the
   network, with all L ranks of a node using it at once;
3. all-gather inside each node.

Inter-node traffic per node falls from about ``2 n L`` (flat, bandwidth-optimal) to
``2 n (K - 1) / K``. With uneven nodes the parts cannot line up, and the fallback is all-reduce in
the node, all-reduce among node leaders, broadcast in the node.

Node groups come from the world's node layout unless ``ranks_per_node`` forces blocks of
consecutive ranks (tests on one machine); they are made on a group's first call (collective) and
kept on it. The result equals the flat one up to the order of additions.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._dtypes import array_module
from ..backends.base import CompletedWork, ReduceOp
from ..errors import ConfigurationError
from ..groups import ProcessGroup
from ..settings import ALGORITHMS, settings
from . import agreement, graphed
from .core import all_gather, broadcast, native_all_reduce, reduce_scatter, start_call
from .ring import rhd_all_reduce, ring_all_reduce
from .widen import reduce_widened


def resolve_algorithm(algorithm: Optional[str]) -> str:
    """The algorithm a call uses: its own, else ``settings.allreduce_algorithm``.

    Raises:
        ConfigurationError: an unknown name.
    """
    name = settings.allreduce_algorithm if algorithm is None else algorithm
    if name == "native":
        return name
    if not isinstance(name, str) or name.lower() not in ALGORITHMS:
        where = "settings.allreduce_algorithm" if algorithm is None else "algorithm"
        raise ConfigurationError(f"{where}={name!r} is not an all-reduce algorithm; use one of {list(ALGORITHMS)}")
    return name.lower()


class _Levels:
    """The node group and the cross-node group of one process group."""

    def __init__(self, node: ProcessGroup, cross: Optional[ProcessGroup], uniform: bool):
        self.node, self.cross, self.uniform = node, cross, uniform


def node_levels(pg: ProcessGroup, ranks_per_node: Optional[int] = None) -> _Levels:
    """Collective on the first call for ``(pg, ranks_per_node)``: the groups of the hierarchy.

    Raises:
        ConfigurationError: ``ranks_per_node`` does not divide the group size.
    """
    cache = pg.node_levels
    if ranks_per_node in cache:
        return cache[ranks_per_node]
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or pg.size % ranks_per_node:
            raise ConfigurationError(f"ranks_per_node={ranks_per_node!r} must be a positive divisor of the group "
                                     f"size {pg.size}")
        color = pg.rank // ranks_per_node
    else:
        color = pg.world.node_rank
    node = pg.split(color, pg.rank)
    sizes = all_gather(np.array([node.size], dtype=np.int64), pg).reshape(-1)
    uniform = len(set(sizes.tolist())) == 1
    # uniform: local rank i of every node; otherwise the node leaders (others join no group)
    cross = pg.split(node.rank if uniform else (0 if node.rank == 0 else None), pg.rank)
    levels = _Levels(node, cross if cross.is_member else None, uniform)
    cache[ranks_per_node] = levels
    return levels


def hierarchical_all_reduce(x: Any, op: ReduceOp, pg: ProcessGroup, ranks_per_node: Optional[int] = None) -> None:
    """All-reduce ``x`` in place inside each node, then across nodes (see the module note).

    ``ranks_per_node``: force blocks of this many consecutive group ranks as nodes.
    """
    levels = node_levels(pg, ranks_per_node)
    xp = array_module(x)

    def body(work: Any, base: ReduceOp) -> None:
        flat = work.reshape(-1)
        n = flat.size
        if levels.uniform:
            local = levels.node.size
            chunk = -(-n // local)
            padded = xp.zeros(chunk * local, dtype=flat.dtype)
            padded[:n] = flat
            part = reduce_scatter(padded, base, levels.node) if local > 1 else padded
            if levels.cross is not None and levels.cross.size > 1:
                native_all_reduce(part, base, levels.cross)
            flat[...] = (all_gather(part, levels.node).reshape(-1) if local > 1 else part)[:n]
        else:
            native_all_reduce(work, base, levels.node)
            if levels.cross is not None:
                native_all_reduce(work, base, levels.cross)
            broadcast(work, 0, levels.node)

    reduce_widened(x, op, pg.size, body)


def run(algorithm: str, x: Any, op: ReduceOp, pg: ProcessGroup, async_op: bool) -> Any:
    """Run a non-native all-reduce of checked ``x`` on member group ``pg``; a completed Work when ``async_op``.

    The call takes one sequence number and agreement check, as a native one does; its parts take their own.
    """
    graphed.admit(pg, "all_reduce", x, op.name, why_not=f"the {algorithm!r} algorithm is made of several calls "
                                                         "driven from the host; capture the native all-reduce")
    label = start_call(pg, "all_reduce", x, op)
    agreement.check(pg, label.seq, f"all_reduce {algorithm}", x, label.call[1])  # meets no other algorithm's call
    if algorithm == "hierarchical":
        hierarchical_all_reduce(x, op, pg)
    elif algorithm == "ring":
        ring_all_reduce(x, op, pg)
    elif algorithm == "rhd":
        rhd_all_reduce(x, op, pg)
    else:  # resolve_algorithm admits only known names
        raise ConfigurationError(f"all-reduce algorithm {algorithm!r} has no implementation")
    return CompletedWork() if async_op else None


__all__ = ["resolve_algorithm", "hierarchical_all_reduce", "node_levels", "run"]
