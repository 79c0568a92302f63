"""StalenessBound: the bookkeeping that keeps an asynchronous server's gradients at most k updates stale.

[Note: what is counted]
A server's ``version`` is the number of updates it has applied. A gradient computed on version ``base`` and
applied at version ``V`` has staleness ``V - base``; the bound is ``V - base <= k`` for every applied one.

[Note: outstanding gradients and the admission rule]
From an answered pull until its gradient is applied, the worker has one outstanding gradient, with deadline
``base + k``. Applying one gradient per version, outstanding gradients can all meet their deadlines iff,
sorted by ``base``, the i-th satisfies ``V + i - base_i <= k`` (earliest deadline first is optimal for unit
jobs). The server keeps that true: a pull is answered only if at most ``k`` other gradients are outstanding;
a received gradient is applied at once only if the others stay feasible at ``V + 1``, else it waits until the
older ones it would overtake arrive. So k = 0 lets one worker compute at a time, and fast workers run at most
k updates ahead of the slowest. Nothing here communicates, so tests drive it with random schedules.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...errors import InvalidArgumentError, UsageError


class StalenessBound:
    """One server's versions and outstanding gradients under a staleness bound (see the module notes).

    Args:
        max_staleness: the bound ``k`` (an int >= 0), or None for no bound.

    Attributes:
        version: updates applied so far.
        max_observed: the largest staleness of an applied gradient (0 before any).
        histogram: staleness -> number of gradients applied with it.
    """

    def __init__(self, max_staleness: Optional[int]) -> None:
        if max_staleness is not None and (isinstance(max_staleness, bool) or int(max_staleness) < 0):
            raise InvalidArgumentError(f"max_staleness must be None or an integer >= 0, got {max_staleness!r}")
        self.max_staleness = None if max_staleness is None else int(max_staleness)
        self.version = 0
        self.max_observed = 0
        self.histogram: Dict[int, int] = {}
        self._base: Dict[int, int] = {}  # worker -> version its outstanding gradient is computed on
        self._buffered: Dict[int, Any] = {}  # worker -> payload of a received, unapplied gradient

    # -- queries ---------------------------------------------------------------------------------
    def outstanding(self) -> Dict[int, int]:
        """Worker -> base version of each outstanding gradient (in flight or buffered)."""
        return dict(self._base)

    def buffered(self) -> List[int]:
        """Workers whose received gradient waits to be applied."""
        return sorted(self._buffered)

    def _feasible(self, bases: List[int], version: int) -> bool:
        if self.max_staleness is None:
            return True
        return all(version + i - base <= self.max_staleness for i, base in enumerate(sorted(bases)))

    def can_pull(self, worker: int) -> bool:
        """Whether ``worker``'s pull may be answered now (not while its gradient is buffered or k others are out)."""
        if worker in self._buffered:
            return False
        if self.max_staleness is None:
            return True
        others = sum(1 for w in self._base if w != worker)
        return others <= self.max_staleness

    # -- events ------------------------------------------------------------------------------------
    def pull(self, worker: int) -> int:
        """Answer ``worker``'s pull; returns the version handed out (UsageError unless ``can_pull``).

        A gradient still in flight from an earlier pull is forgotten (the worker pulled again instead of pushing).
        """
        if not self.can_pull(worker):
            raise UsageError(f"pull of worker {worker} answered against the staleness bound "
                               f"(outstanding {self._base}, buffered {sorted(self._buffered)}, "
                               f"version {self.version}, max_staleness {self.max_staleness})")
        self._base[worker] = self.version
        return self.version

    def push(self, worker: int, payload: Any = None) -> int:
        """A gradient of ``worker`` arrived: buffer it; returns its base version (UsageError if none was in flight)."""
        if worker not in self._base or worker in self._buffered:
            raise UsageError(f"worker {worker} pushed a gradient without pulling since its last push")
        self._buffered[worker] = payload
        return self._base[worker]

    def ready(self) -> Optional[int]:
        """The buffered gradient to apply next (oldest first, deterministic), or None if each would break the bound."""
        for worker in sorted(self._buffered, key=lambda w: (self._base[w], w)):
            rest = [b for w, b in self._base.items() if w != worker]
            if self._feasible(rest, self.version + 1):
                return worker
        return None

    def apply(self, worker: int) -> Tuple[Any, int]:
        """Apply ``worker``'s buffered gradient; returns (its ``push`` payload, its staleness). UsageError if none."""
        if worker not in self._buffered:
            raise UsageError(f"worker {worker} has no buffered gradient to apply")
        staleness = self.version - self._base.pop(worker)
        payload = self._buffered.pop(worker)
        self.version += 1
        self.max_observed = max(self.max_observed, staleness)
        self.histogram[staleness] = self.histogram.get(staleness, 0) + 1
        return payload, staleness

    def close(self, worker: int) -> None:
        """``worker`` finished: forget its gradient in flight (a buffered one is still applied)."""
        if worker not in self._buffered:
            self._base.pop(worker, None)


__all__ = ["StalenessBound"]
