"""BLAS and OpenMP thread pools sized per rank, so that ranks sharing a node do not oversubscribe it.

[Note: thread pools per rank]
OpenBLAS, MKL and OpenMP start one thread per core in every process: two ranks on a 2-core node run four
busy threads, and a 1 ms matrix product takes ten. So, unless the user set ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS``, ``ax.init()`` limits the pools to max(1, the cores in this
rank's affinity mask / the node's ranks whose masks overlap it). The affinity mask makes SLURM's binding and
cgroups count, not the machine's core count. ``axonhpc launch`` sets the variables before Python starts (so
pools are small from the first import) and names itself in ``AXONHPC_THREADS_SET_BY``, so ``init`` still
sizes by affinity.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, FrozenSet, Mapping, Optional, Sequence

import numpy as np

from .observe.log import get_logger
from .settings import THREAD_VARIABLES, THREADS_SET_BY, settings, thread_environment

AFFINITY_WORDS = 16  # affinity masks travel as 16 64-bit words: CPUs 0-1023 (higher ids fold onto them)
LAUNCH = "axonhpc launch"


def usable_cores() -> FrozenSet[int]:
    """The CPUs this process may run on: its affinity mask, or every CPU where the OS has no such call."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def affinity_words(cores: Sequence[int]) -> np.ndarray:
    """``cores`` as a bit mask of ``AFFINITY_WORDS`` uint64 words (a CPU id past 1023 folds onto id mod 1024)."""
    words = np.zeros(AFFINITY_WORDS, dtype=np.uint64)
    for cpu in cores:
        bit = int(cpu) % (64 * AFFINITY_WORDS)
        words[bit // 64] |= np.uint64(1) << np.uint64(bit % 64)
    return words


def sharing_ranks(mine: np.ndarray, node_masks: Sequence[np.ndarray]) -> int:
    """How many of ``node_masks`` (the masks of this node's ranks, this rank's among them) overlap ``mine``."""
    return max(1, sum(1 for other in node_masks if np.any(np.bitwise_and(mine, other))))


@dataclass(frozen=True)
class ThreadPlan:
    """What sizes this rank's thread pools, and why.

    Attributes:
        threads: the pool size in force (None: the libraries' defaults).
        cores: the CPUs this rank may use.
        sharing: the ranks of this node whose CPUs overlap this rank's.
        chosen: axonhpc sets the pools (False: the user's variables, or the sizing is off).
        user: the thread variables the user set, by name.
    """

    threads: Optional[int]
    cores: int
    sharing: int
    chosen: bool
    user: Mapping[str, str]

    def describe(self) -> str:
        """One line: what was chosen, from what, and how to change it."""
        if self.chosen:
            return (f"BLAS/OpenMP threads per rank: {self.threads} ({self.cores} usable core(s) shared by "
                    f"{self.sharing} rank(s) of this node); set OMP_NUM_THREADS to choose, or "
                    f"AXONHPC_SIZE_THREAD_POOLS=0 to leave the libraries' defaults")
        if self.user:
            given = ", ".join(f"{k}={v}" for k, v in self.user.items())
            return f"BLAS/OpenMP threads per rank: as set by the user ({given})"
        return ("BLAS/OpenMP threads per rank: the libraries' defaults (AXONHPC_SIZE_THREAD_POOLS=0); "
                f"{self.cores} usable core(s) shared by {self.sharing} rank(s) of this node")


def plan_threads(cores: int, sharing: int, environ: Optional[Mapping[str, str]] = None,
                 enabled: Optional[bool] = None) -> ThreadPlan:
    """The plan for ``cores`` CPUs shared by ``sharing`` ranks: ``max(1, cores // sharing)`` unless the user chose."""
    env = thread_environment(environ)
    from_launch = env.pop(THREADS_SET_BY, None) == LAUNCH
    user = {} if from_launch else env
    cores, sharing = max(1, int(cores)), max(1, int(sharing))
    if user:
        return ThreadPlan(_as_count(user.get("OMP_NUM_THREADS")), cores, sharing, False, user)
    if not (settings.size_thread_pools if enabled is None else enabled):
        return ThreadPlan(None, cores, sharing, False, {})
    return ThreadPlan(max(1, cores // sharing), cores, sharing, True, {})


def _as_count(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None and int(text) > 0 else None
    except ValueError:
        return None


class _Applied:
    plan: Optional[ThreadPlan] = None
    limiter: Any = None  # threadpoolctl's limiter, kept for the life of the process


def apply_plan(plan: ThreadPlan, log: bool = True) -> ThreadPlan:
    """Limit this process's pools as ``plan`` says, and log it once (a warning without threadpoolctl)."""
    if plan.chosen:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            get_logger("threads").warning(f"threadpoolctl is not installed, so the BLAS/OpenMP pools keep the "
                                          f"libraries' defaults; set OMP_NUM_THREADS={plan.threads} before "
                                          f"starting Python (pip install threadpoolctl)")
        else:
            _Applied.limiter = threadpool_limits(limits=plan.threads)
    if log and _Applied.plan is None:
        get_logger("threads").info(plan.describe())
    _Applied.plan = plan
    return plan


def current_plan() -> Optional[ThreadPlan]:
    """The plan ``init`` applied in this process (None before ``init``, and under ``run_local``)."""
    return _Applied.plan


def launch_environment(ranks_here: int, environ: Optional[Mapping[str, str]] = None,
                       cores: Optional[int] = None) -> dict:
    """The variables ``axonhpc launch`` adds for ``ranks_here`` ranks on this machine (empty when the user set any)."""
    env = os.environ if environ is None else environ
    if thread_environment(env) or not settings.size_thread_pools:
        return {}
    usable = len(usable_cores()) if cores is None else int(cores)
    threads = str(max(1, usable // max(1, int(ranks_here))))
    return {**{name: threads for name in THREAD_VARIABLES}, THREADS_SET_BY: LAUNCH}


__all__ = ["ThreadPlan", "plan_threads", "apply_plan", "current_plan", "usable_cores", "affinity_words",
           "sharing_ranks", "launch_environment", "AFFINITY_WORDS"]
