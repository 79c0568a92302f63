"""World: every rank of a job, with its node layout and group factories."""
from __future__ import annotations

import os
import secrets
import time
import warnings
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..backends.base import Backend
from ..errors import GroupMismatchError, RankError, everywhere
from ..observe.log import get_logger
from ..settings import LauncherEnv
from ..threads import affinity_words, sharing_ranks, usable_cores
from . import shared_settings
from .agreement import compare, show, who_passed
from .mesh import Mesh
from .process_group import ProcessGroup


class World:
    """All ranks of a job over one backend.

    Attributes:
        rank: global rank of this process.
        world_size: number of ranks.
        local_rank, local_size: rank and count of the ranks on this node.
        node_rank, num_nodes: index of this node and number of nodes.
        node_of: every global rank's node index.
        usable_cores: the CPUs this rank may use (its affinity mask).
        cpu_sharers: the ranks of this node whose CPUs overlap this rank's (itself included).
        clock_offset: seconds to add to this rank's ``time.time()`` to read rank 0's clock.
        default_group: the ProcessGroup of all ranks.
        launcher: what SLURM / Open MPI / PMI variables said about this process.
    """

    def __init__(self, backend: Backend, launcher: Optional[LauncherEnv] = None):
        self.backend = backend
        self.rank = backend.rank
        self.world_size = backend.size
        self.default_group = ProcessGroup(self, backend, range(backend.size), "world")
        self.launcher = launcher if launcher is not None else LauncherEnv(None, None, None, None, None, None, None)
        # The launcher's local rank, when it describes this very world, orders each node's ranks.
        same_world = self.launcher.size == backend.size and self.launcher.rank == backend.rank
        local_key = self.launcher.local_rank if same_world else None
        self.local_rank, self.local_size, self.node_rank, self.num_nodes = backend.node_layout(local_key)
        # Every rank's node, so that whether a group shares one node needs no communication later
        # (a collective then could hang where a timeout should have spoken: a cut link, a dead host).
        # Each rank's CPU affinity travels with it: the thread pools are sized by the ranks that share cores.
        cores = usable_cores()
        mask = affinity_words(cores)
        # The process ids let a fault-tolerant job see a dead peer on its node (collectives.watchdog).
        # So do the settings every rank must share ([Note: settings the ranks must share]), and a random
        # word: rank 0's names this run (flight dumps carry it, so doctor tells a stale dump from this run's).
        shared = shared_settings.codes()
        head = np.array([self.node_rank, os.getpid(), secrets.randbits(63)], dtype=np.int64)
        mine = np.concatenate([head, shared, mask.view(np.int64)])
        table = np.empty((self.world_size, mine.size), dtype=np.int64)
        backend.all_gather(mine, table, async_op=False).wait()
        shared_settings.check(table[:, head.size:head.size + shared.size], list(range(self.world_size)))
        self.node_of: Tuple[int, ...] = tuple(table[:, 0].tolist())
        self.pid_of: Tuple[int, ...] = tuple(table[:, 1].tolist())  # meaningful for the ranks of this node
        self.run_id = f"{int(table[0, 2]):016x}"  # the same on every rank of this world
        node_masks = [table[r, head.size + shared.size:].view(np.uint64) for r in range(self.world_size)
                      if self.node_of[r] == self.node_rank]
        self.usable_cores = len(cores)
        self.cpu_sharers = sharing_ranks(mask, node_masks)
        self.clock_offset = self._clock_offset()
        self.default_group.prepare_shared_memory()
        self._groups_made = 0

    def _clock_offset(self, rounds: int = 5) -> float:
        """Collective: seconds to add to this rank's ``time.time()`` to read rank 0's clock.

        The ranks leave a barrier together (microseconds on one node) and read their clocks; the median
        over a few rounds is kept.
        """
        if len(set(zip(self.node_of, self.pid_of))) == 1:  # one process (thread ranks): one clock
            return 0.0
        stamps = np.empty((self.world_size, 1), dtype=np.float64)
        offsets = []
        for _ in range(rounds):
            self.backend.barrier(async_op=False).wait()
            now = np.array([time.time()], dtype=np.float64)
            self.backend.all_gather(now, stamps, async_op=False).wait()
            offsets.append(stamps[0, 0] - stamps[self.rank, 0])
        return float(np.median(offsets))

    # -- constructors -------------------------------------------------------------
    @classmethod
    def mock(cls) -> "World":
        """A one-rank world on the in-process backend: no MPI at all."""
        from ..backends.local import LocalBackend

        return cls(LocalBackend.create_world(1)[0])

    # -- launcher agreement ---------------------------------------------------------
    def launcher_problems(self) -> List[str]:
        """Disagreements between MPI's view of this job and the launcher's variables."""
        env, problems = self.launcher, []
        if env.source is None:
            return problems
        if env.size is not None and env.size > 1 and self.world_size == 1:
            hint = (" Under SLURM this is the classic 'srun --mpi=none' mistake: use srun --mpi=pmi2 "
                    "(MPICH) or --mpi=pmix (Open MPI), or mpiexec inside the allocation.")
            problems.append(
                f"the launcher ({env.source}) started {env.size} tasks but MPI reports a world of 1: every task "
                f"is running alone, each training its own copy.{hint if env.source == 'slurm' else ''}"
            )
        elif env.size is not None and env.size != self.world_size:
            problems.append(f"the launcher ({env.source}) says {env.size} tasks, MPI says {self.world_size}")
        if env.rank is not None and env.size == self.world_size and env.rank != self.rank:
            problems.append(f"the launcher ({env.source}) says rank {env.rank}, MPI says {self.rank}")
        if (env.local_rank is not None and env.size == self.world_size and env.local_rank != self.local_rank):
            problems.append(f"the launcher ({env.source}) says local rank {env.local_rank}, MPI says {self.local_rank}")
        return problems

    def warn_launcher_problems(self) -> None:
        """Warn loudly (a warning and a line on stderr) about each launcher disagreement."""
        for problem in self.launcher_problems():
            get_logger("launch").warning(problem)
            warnings.warn(f"axonhpc (rank {self.rank}): {problem}", RuntimeWarning, stacklevel=3)

    # -- groups ---------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], name: Optional[str] = None) -> ProcessGroup:
        """A ProcessGroup of these global ranks, in this order; every rank must call it with the same list.

        Raises:
            RankError: a rank is not an integer, out of range, or repeated; or the list is empty.
            GroupMismatchError: ranks passed different lists; raised on every rank, naming them.
        """
        ranks = list(ranks)
        problem: Optional[RankError] = None
        try:
            ranks = self._checked_ranks(ranks)
        except RankError as exc:
            problem = exc
        if self.world_size > 1:
            seen = compare(self.default_group, problem is None, show(ranks), same=True)
            if seen is not None and len({text for _, text in seen}) > 1:
                raise everywhere(GroupMismatchError(
                    f"new_group: the ranks passed different lists ({who_passed(seen, self.default_group.ranks)}); "
                    f"every rank must pass the same ranks in the same order, and every rank raises this"),
                    self.default_group.ranks) from problem
        if problem is not None:
            raise problem
        backend = self.backend.create_group(ranks)
        return ProcessGroup(self, backend, ranks, name or f"group{ranks}").prepare_shared_memory()

    def _checked_ranks(self, ranks: List) -> List[int]:
        """``ranks`` as ints, or RankError: not integers, empty, out of range or repeated."""
        if not ranks:
            raise RankError("new_group needs at least one rank, got an empty list")
        for r in ranks:
            if isinstance(r, bool) or not hasattr(r, "__index__"):
                raise RankError(f"new_group ranks must be integers, got {r!r} in {ranks}")
        bad = [int(r) for r in ranks if not 0 <= int(r) < self.world_size]
        if bad:
            raise RankError(f"new_group ranks {bad} are out of range for a world of size {self.world_size} "
                            f"(valid: 0..{self.world_size - 1})")
        seen, dups = set(), []
        for r in ranks:
            if int(r) in seen:
                dups.append(int(r))
            seen.add(int(r))
        if dups:
            raise RankError(f"new_group ranks {ranks} repeat {sorted(set(dups))}")
        return [int(r) for r in ranks]

    def split(self, color: Optional[int], key: int = 0) -> ProcessGroup:
        """Collective: like ``MPI_Comm_split`` of the world (``ProcessGroup.split`` of the default group).

        Args:
            color: ranks with the same color form one group; None (or negative) gets a non-member group.
            key: orders ranks inside a group; ties keep world-rank order.

        Raises:
            InvalidArgumentError, GroupMismatchError: a ``color`` or ``key`` that is not an integer.
        """
        return self.default_group.split(color, key)

    def node_group(self) -> ProcessGroup:
        """Collective: the group of the ranks on this node (in world-rank order)."""
        return self.default_group.split(self.node_rank, self.rank, name=f"node{self.node_rank}")

    def mesh(self, dp: int = 1, tp: int = 1, pp: int = 1) -> Mesh:
        """Collective: dp/tp/pp groups whose sizes multiply to the world size (tp fastest)."""
        return Mesh(self, dp=dp, tp=tp, pp=pp)

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank)."""
        self.backend.abort(code)

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, world_size={self.world_size}, backend={self.backend.name}, "
                f"local_rank={self.local_rank}/{self.local_size}, node={self.node_rank}/{self.num_nodes})")


def _mock_group(cls: type) -> ProcessGroup:
    """A one-rank group with no MPI at all: the default group of ``World.mock()``."""
    return World.mock().default_group


# Defined here, where a world can be made: process_group.py must not import this module (see its note).
ProcessGroup.mock = classmethod(_mock_group)

