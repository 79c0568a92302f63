"""The all-reduce users call: the native one of ``core`` or an algorithm of ``algorithms``.

[Note: the all-reduce above its algorithms]
The algorithms are built on ``core.native_all_reduce`` and the other plain collectives, so the choice
between them (``algorithm=``, else ``ax.settings.allreduce_algorithm``) is made here, above both,
and neither imports the other's caller. A blocking call on a plain host array tries the fast path
from here first, as ``core.native_all_reduce`` does.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

from .._dtypes import array_module, check_array, dtype_groups
from ..backends.base import ReduceOp
from ..errors import AxonError, CollectiveMismatchError, CollectiveRefusedError, everywhere
from ..groups import ProcessGroup
from ..groups.agreement import Failed, all_or_none, ranks_text
from ..settings import settings
from . import algorithms
from . import fast_path
from .core import member, checked_all_reduce, refuse_call


def all_reduce(x, op=ReduceOp.SUM, group: Optional[ProcessGroup] = None, async_op: bool = False,
               algorithm: Optional[str] = None):
    """Reduce ``x`` over the group, in place: every rank ends with the result.

    Args:
        x: contiguous, writable array of a supported dtype.
        op: a ``ReduceOp`` (or its name). ``AVG`` on integers floors.
        group: the group (None: the current world's default group).
        async_op: return a ``Work`` instead of waiting.
        algorithm: "native" (one MPI call), "hierarchical" (inside each
            node, then across nodes; see ``collectives.algorithms``), "ring"
            or "rhd" (point to point; see ``collectives.ring``); None
            takes ``ax.settings.allreduce_algorithm``. Every rank must pick
            the same. Non-native algorithms complete before returning.

    Returns:
        None, or a ``Work`` if ``async_op``.

    Raises:
        NotAMemberError, UnsupportedDtypeError, NonContiguousBufferError,
        ReadOnlyBufferError, CollectiveTimeoutError, ConfigurationError
        (an unknown algorithm).
    """
    if (not async_op and algorithm is None
            and fast_path.attempt(fast_path.ALL_REDUCE, x, group, op) is not fast_path.NOT_TAKEN):
        return None
    pg = member(group, "all_reduce")
    try:
        op = ReduceOp.parse(op)
        check_array(x, "all_reduce buffer", writable=True)
        chosen = algorithms.resolve_algorithm(algorithm)
    except AxonError as exc:  # the others hear it (a non-native algorithm's check is a blocking step)
        refuse_call(pg, "all_reduce", exc, x, async_op and (algorithm or settings.allreduce_algorithm) == "native")
    if chosen == "native" or pg.size == 1:
        return checked_all_reduce(x, op, pg, async_op)
    return algorithms.run(chosen, x, op, pg, async_op)


def all_reduce_sum(x, group=None, async_op=False):
    """``all_reduce`` with ``ReduceOp.SUM``."""
    return all_reduce(x, ReduceOp.SUM, group, async_op)


def all_reduce_mean(x, group=None, async_op=False):
    """``all_reduce`` with ``ReduceOp.AVG`` (sum divided by the group size)."""
    return all_reduce(x, ReduceOp.AVG, group, async_op)


def all_reduce_min(x, group=None, async_op=False):
    """``all_reduce`` with ``ReduceOp.MIN``."""
    return all_reduce(x, ReduceOp.MIN, group, async_op)


def all_reduce_max(x, group=None, async_op=False):
    """``all_reduce`` with ``ReduceOp.MAX``."""
    return all_reduce(x, ReduceOp.MAX, group, async_op)


def all_reduce_product(x, group=None, async_op=False):
    """``all_reduce`` with ``ReduceOp.PRODUCT``."""
    return all_reduce(x, ReduceOp.PRODUCT, group, async_op)


def sync_gradient(grad, group: Optional[ProcessGroup] = None) -> None:
    """Average one gradient array over the group, in place."""
    all_reduce(grad, ReduceOp.AVG, group)


def sync_gradients(grads: Sequence, group: Optional[ProcessGroup] = None) -> None:
    """Average several gradient arrays over the group, in place, one all-reduce per dtype.

    Arrays of one dtype are concatenated so that many small gradients cost one message. The ranks first
    compare the gradients' number, shapes and dtypes (``groups.agreement.all_or_none``: one small all-gather):
    the concatenated arrays alone could agree in size while holding other parameters.

    Raises:
        CollectiveMismatchError: on every rank, if the ranks' gradients differ (naming the ranks).
        CollectiveRefusedError: on the other ranks, if a gradient is unusable on one rank (which raises its
            own error: ``ReadOnlyBufferError``, ``UnsupportedDtypeError``...).
    """
    grads = list(grads)
    pg = member(group, "sync_gradients")
    with all_or_none(pg, functools.partial(_refused, pg), functools.partial(_differ, pg)) as vote:
        for i, g in enumerate(grads):
            check_array(g, f"gradient {i}", writable=True)
        vote.text = ", ".join(f"{g.dtype.name}{list(g.shape)}" for g in grads)
    for same in dtype_groups(grads):
        xp = array_module(same[0])
        flat = xp.concatenate([g.reshape(-1) for g in same])
        all_reduce(flat, ReduceOp.AVG, pg)
        offset = 0
        for g in same:
            g[...] = flat[offset:offset + g.size].reshape(g.shape)
            offset += g.size


def _refused(pg: ProcessGroup, failed: Failed) -> CollectiveRefusedError:
    """What the ranks whose gradients passed raise when another's did not."""
    ranks = [pg.ranks[r] for r, _ in failed]
    return CollectiveRefusedError(f"sync_gradients on group {pg.name}: {ranks_text(ranks)} refused (world "
                                  f"numbering): {failed[0][1]}", rank=ranks[0], reason=failed[0][1])


def _differ(pg: ProcessGroup, seen: List[Tuple[bool, str]]) -> CollectiveMismatchError:
    """What every rank raises when the ranks' gradients differ in number, shape or dtype."""
    holders: Dict[str, List[int]] = {}
    for r, (_, text) in enumerate(seen):
        holders.setdefault(text, []).append(pg.ranks[r])
    return everywhere(CollectiveMismatchError(
        f"sync_gradients on group {pg.name}: the ranks' gradients differ in number, shape or dtype (ranks with the "
        f"same gradients: {' / '.join(str(ranks) for ranks in holders.values())}); "
        + "; ".join(f"{ranks_text(ranks)}: {text}" for text, ranks in holders.items())), pg.ranks)


__all__ = ["all_reduce", "all_reduce_sum", "all_reduce_mean", "all_reduce_min", "all_reduce_max",
           "all_reduce_product", "sync_gradient", "sync_gradients"]
