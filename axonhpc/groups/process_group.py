"""ProcessGroup: an ordered set of world ranks with a backend to talk over.

[Note: groups below the world]
``world.py`` imports this module, so this one never imports it: a group splits itself and reads its
world through ``WorldFacts``; ``ProcessGroup.mock()`` needs a whole world, so ``world.py`` defines it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Dict, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..backends.base import Backend
from ..backends.shm import engine_for
from ..errors import ArgumentTypeError, GroupMismatchError, InvalidArgumentError, NotAMemberError, RankError, everywhere
from ..settings import settings
from .agreement import compare, issue_waiting_calls


class WorldFacts(Protocol):
    """What groups and meshes read of the ``World`` that made them (``axonhpc.groups.World`` is one)."""

    rank: int
    world_size: int
    node_rank: int
    node_of: Tuple[int, ...]
    default_group: "ProcessGroup"


class ProcessGroup:
    """An ordered set of global ranks and, on its members, a backend; on non-members collectives raise ``NotAMemberError``.

    Attributes:
        ranks: global ranks of the members, in group-rank order (empty for the non-member side of a
            ``split`` with ``color=None``).
        name: a label used in messages ("world", "mesh.tp", "group[0, 2]").
        member_backend: the backend on a member, None on a non-member (``backend`` raises there).
        timeout: seconds a blocking call may wait (None: ``ax.settings.timeout``).
        debug: check every collective across ranks first (None: ``ax.settings.debug``).
    """

    # ``ProcessGroup.mock()``: a one-rank group with no MPI at all (defined in world.py, which makes its world).
    mock: ClassVar[Callable[[], "ProcessGroup"]]

    def __init__(self, world: WorldFacts, backend: Optional[Backend], ranks: Sequence[int], name: str):
        self.world = world
        self.member_backend = backend
        self.ranks: Tuple[int, ...] = tuple(int(r) for r in ranks)
        self.name = name
        self._timeout: Optional[float] = None
        self.debug: Optional[bool] = None
        self.seq = 0  # collectives issued on this group by this rank
        # The collective layer's state of this group (collectives.group_state.GroupState), made on first use.
        self.collective_state: Any = None
        self.node_levels: Dict[Optional[int], Any] = {}  # collectives.algorithms.node_levels's groups, made once
        self._one_node: Optional[bool] = None
        if backend is not None:
            backend.global_ranks = self.ranks

    # -- facts --------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        """True on ranks that belong to the group."""
        return self.member_backend is not None

    @property
    def rank(self) -> int:
        """This process's rank inside the group, or -1 on a non-member."""
        return self.member_backend.rank if self.member_backend is not None else -1

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def world_size(self) -> int:
        """Same as ``size`` (the group's own world)."""
        return len(self.ranks)

    @property
    def backend(self) -> Backend:
        """The backend of this group on a member; NotAMemberError elsewhere."""
        self.require_member("using the group's backend")
        return self.member_backend

    def require_member(self, what: str) -> "ProcessGroup":
        """Self, or NotAMemberError naming ``what`` the caller tried to do."""
        if self.member_backend is None:
            raise NotAMemberError(
                f"{what}: global rank {self.world.rank} is not a member of process group {self.name} "
                f"(ranks {list(self.ranks)}); only members may call it"
            )
        return self

    @property
    def on_one_node(self) -> bool:
        """True if every member runs on one node (from the world's node table: no communication)."""
        if self._one_node is None:
            nodes = self.world.node_of
            self._one_node = len({nodes[r] for r in self.ranks}) <= 1
        return self._one_node

    def prepare_shared_memory(self) -> "ProcessGroup":
        """Make the group's shared-memory window now (the group's creation is a collective already); returns self.

        So a rank late to its first all-reduce is named by the timeout instead of holding the others in
        ``MPI_Win_allocate_shared``.
        """
        if (self.member_backend is not None and self.size > 1 and settings.shm_collectives != "off"
                and self.on_one_node):
            engine_for(self.member_backend, settings.shm_slot_bytes, settings.shm_slots, True)
        return self

    @property
    def timeout(self) -> Optional[float]:
        """Seconds a blocking call on this group may wait; None takes ``ax.settings.timeout``."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: Optional[float]) -> None:
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ArgumentTypeError(f"group {self.name}: timeout must be a number of seconds or None, got "
                                        f"{type(value).__name__} {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"group {self.name}: timeout must be a finite number of seconds > 0, or "
                                           f"None for ax.settings.timeout, got {value!r}")
            value = float(value)
        self._timeout = value

    def effective_timeout(self) -> Optional[float]:
        """Seconds a blocking call on this group waits: ``timeout``, else ``ax.settings.timeout``."""
        return self.timeout if self.timeout is not None else settings.timeout

    def debug_enabled(self) -> bool:
        """Whether collectives on this group are checked across ranks first."""
        return self.debug if self.debug is not None else settings.debug

    def contains(self, global_rank: int) -> bool:
        """True if the global rank is a member."""
        return int(global_rank) in self.ranks

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a group rank; RankError outside ``[0, size)``."""
        if not 0 <= int(group_rank) < self.size:
            raise RankError(f"group rank {group_rank} is out of range for group {self.name} of size {self.size}")
        return self.ranks[int(group_rank)]

    def group_rank(self, global_rank: int) -> int:
        """The group rank of a global rank; RankError if it is not in this group."""
        try:
            return self.ranks.index(int(global_rank))
        except ValueError:
            raise RankError(
                f"global rank {global_rank} is not in group {self.name} (ranks {list(self.ranks)})"
            ) from None

    def check_rank(self, rank: int, what: str) -> int:
        """Validate a group rank argument (``src``, ``dst``, ``root``) before anything is sent; RankError if bad."""
        if isinstance(rank, bool) or not hasattr(rank, "__index__"):
            raise RankError(f"{what} must be an integer group rank, got {rank!r}")
        if not 0 <= int(rank) < self.size:
            raise RankError(f"{what}={rank} is out of range for group {self.name} of size {self.size} "
                            f"(valid: 0..{self.size - 1})")
        return int(rank)

    # -- derived groups --------------------------------------------------------
    def split(self, color: Optional[int], key: int = 0, *, name: Optional[str] = None,
              trusted: bool = False) -> "ProcessGroup":
        """Collective over this group: like ``MPI_Comm_split``.

        Args:
            color: members with the same color form one new group; None (or negative) gets a non-member group.
            key: orders the ranks inside a new group (ties: by group rank).
            trusted: every rank computed ``color`` and ``key`` by one rule, so they are not compared.

        Raises:
            InvalidArgumentError: ``color`` or ``key`` is not an integer (every rank passed such a value).
            GroupMismatchError: some ranks passed a non-integer ``color`` or ``key`` and others did not.
            NotAMemberError: this rank is not in the group.
        """
        problem: Optional[InvalidArgumentError] = None
        if color is not None:
            if isinstance(color, bool) or not hasattr(color, "__index__"):
                problem = InvalidArgumentError(f"split color must be an integer or None, got {color!r}")
            else:
                color = None if int(color) < 0 else int(color)
        if problem is None and (isinstance(key, bool) or not hasattr(key, "__index__")):
            problem = InvalidArgumentError(f"split key must be an integer, got {key!r}")
        if not trusted and self.size > 1:
            seen = compare(self.require_member("split"), problem is None, f"color={color!r}, key={key!r}", same=False)
            if seen is not None and not all(not ok for ok, _ in seen):
                bad = "; ".join(f"rank {self.ranks[r]} passed {text}" for r, (ok, text) in enumerate(seen) if not ok)
                raise everywhere(GroupMismatchError(
                    f"split of group {self.name}: some ranks passed a color or key that is not an integer ({bad}); "
                    f"color must be an integer or None and key an integer, on every rank, and every rank of the "
                    f"group raises this"), self.ranks) from problem
        if problem is not None:
            raise problem
        issue_waiting_calls(self)  # done by ``compare`` unless trusted
        backend = self.backend.split(color, int(key))
        if backend is None:
            return ProcessGroup(self.world, None, (), name or f"split(color=None) of {self.name}")
        mine = np.array([self.world.rank], dtype=np.int64)
        members = np.empty((backend.size, 1), dtype=np.int64)
        backend.all_gather(mine, members, async_op=False)
        group = ProcessGroup(self.world, backend, members[:, 0].tolist(),
                             name or f"split(color={color}) of {self.name}")
        return group.prepare_shared_memory()

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name}, ranks={list(self.ranks)}, rank={self.rank})"
