"""ProcessGroup: an ordered set of world ranks with a backend to talk over.

[Note: groups below the world]
``world.py`` imports this module, so this one never imports it: a group splits itself and reads its
world through ``WorldFacts``; ``ProcessGroup.mock()`` needs a whole world, so ``world.py`` defines it.

[Note: destroying a group]
A group holds MPI communicators (its backend's own and side channel, the collective layer's private
channels, its node's shared-memory window), and MPI has a few thousand. ``destroy`` frees them, layer by
layer, without this layer importing the collectives: the collective layer's state of the group
(``collective_state``, read as ``agreement.issue_waiting_calls`` reads it) is asked to ``complete`` (its
waiting calls issued, its outstanding asynchronous calls waited for) before the members meet, and to
``free`` its private channels after. The group is then left with no backend, so a later call takes the
general path (the fast paths test ``member_backend is None`` already) and ``require_member`` raises
``GroupDestroyedError`` there: nothing is added to the hot path.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Dict, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..backends.base import Backend
from ..backends.shm import engine_for, release
from ..errors import (ArgumentTypeError, GroupDestroyedError, GroupMismatchError, InvalidArgumentError, NotAMemberError,
                      RankError, UsageError, everywhere)
from ..settings import settings
from .agreement import CheckLabel, compare, issue_waiting_calls, who_passed


class WorldFacts(Protocol):
    """What groups and meshes read of the ``World`` that made them (``axonhpc.groups.World`` is one)."""

    rank: int
    world_size: int
    node_rank: int
    node_of: Tuple[int, ...]
    default_group: "ProcessGroup"


def _distinct(world: Any, name: str, ranks: Tuple[int, ...]) -> str:
    """``name``, or "name #k" for the k-th group of the world made with that name and those ranks.

    Every member made the same earlier groups of those ranks (making one is collective over its members, in
    one order), so every member names the group alike.
    """
    made = world.__dict__.setdefault("_group_names", {})
    count = made[(name, ranks)] = made.get((name, ranks), 0) + 1
    return name if count == 1 else f"{name} #{count}"


class ProcessGroup:
    """An ordered set of global ranks and, on its members, a backend; on non-members collectives raise ``NotAMemberError``.

    Attributes:
        ranks: global ranks of the members, in group-rank order (empty for the non-member side of a
            ``split`` with ``color=None``).
        name: a label used in messages ("world", "mesh.tp", "group[0, 2]"), distinct among the world's groups of
            the same ranks: the second group made with a name and ranks already taken is "group[0, 2] #2"
            (messages, the flight recorder, ``axonhpc doctor`` and the watchdog's deadlock proof tell groups
            apart by name and ranks).
        member_backend: the backend on a member, None on a non-member and once destroyed (``backend`` raises there).
        timeout: seconds a blocking call may wait (None: ``ax.settings.timeout``).
        debug: check every collective across ranks first (None: ``ax.settings.debug``).
        destroyed: True once ``destroy()`` ran on this rank; every later use raises ``GroupDestroyedError``.
    """

    # ``ProcessGroup.mock()``: a one-rank group with no MPI at all (defined in world.py, which makes its world).
    mock: ClassVar[Callable[[], "ProcessGroup"]]

    def __init__(self, world: WorldFacts, backend: Optional[Backend], ranks: Sequence[int], name: str):
        self.world = world
        self.member_backend = backend
        self.ranks: Tuple[int, ...] = tuple(int(r) for r in ranks)
        self.name = _distinct(world, name, self.ranks) if self.ranks else name
        self._timeout: Optional[float] = None
        self.debug: Optional[bool] = None
        self.seq = 0  # collectives issued on this group by this rank
        # The collective layer's state of this group (collectives.group_state.GroupState), made on first use.
        self.collective_state: Any = None
        self.node_levels: Dict[Optional[int], Any] = {}  # collectives.algorithms.node_levels's groups, made once
        self._one_node: Optional[bool] = None
        self.destroyed = False
        if backend is not None:
            backend.global_ranks = self.ranks

    # -- facts --------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        """True on ranks that belong to the group (a destroyed group's members included)."""
        return self.member_backend is not None or (self.destroyed and self.world.rank in self.ranks)

    @property
    def rank(self) -> int:
        """This process's rank inside the group, or -1 on a non-member."""
        if self.member_backend is not None:
            return self.member_backend.rank
        return self.ranks.index(self.world.rank) if self.destroyed and self.world.rank in self.ranks else -1

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
        """Self, or NotAMemberError naming ``what`` the caller tried to do (GroupDestroyedError once destroyed)."""
        if self.member_backend is None:
            if self.destroyed:
                raise GroupDestroyedError(
                    f"{what}: process group {self.name} (ranks {list(self.ranks)}) was destroyed on global rank "
                    f"{self.world.rank} (ProcessGroup.destroy); make a new group (world.new_group, split) to "
                    f"communicate over these ranks again")
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
    def split(self, color: Optional[int], key: int = 0, *, name: Optional[str] = None) -> "ProcessGroup":
        """Collective over this group: like ``MPI_Comm_split``.

        Args:
            color: members with the same color form one new group; None (or negative) gets a non-member group.
            key: orders the ranks inside a new group (ties: by group rank).

        Raises:
            InvalidArgumentError: ``color`` or ``key`` is not an integer (every rank passed such a value).
            GroupMismatchError: some ranks passed a non-integer ``color`` or ``key`` and others did not.
            NotAMemberError: this rank is not in the group.
            GroupDestroyedError: the group was destroyed.
        """
        self.require_member("split")
        problem: Optional[InvalidArgumentError] = None
        if color is not None:
            if isinstance(color, bool) or not hasattr(color, "__index__"):
                problem = InvalidArgumentError(f"split color must be an integer or None, got {color!r}")
            else:
                color = None if int(color) < 0 else int(color)
        if problem is None and (isinstance(key, bool) or not hasattr(key, "__index__")):
            problem = InvalidArgumentError(f"split key must be an integer, got {key!r}")
        if self.size > 1:  # the members meet first, polling ([Note: making a group while calls are in flight])
            seen = compare(self.require_member("split"), problem is None, f"color={color!r}, key={key!r}", same=False)
            if seen is not None and not all(not ok for ok, _ in seen):
                bad = "; ".join(f"rank {self.ranks[r]} passed {text}" for r, (ok, text) in enumerate(seen) if not ok)
                raise everywhere(GroupMismatchError(
                    f"split of group {self.name}: some ranks passed a color or key that is not an integer ({bad}); "
                    f"color must be an integer or None and key an integer, on every rank, and every rank of the "
                    f"group raises this"), self.ranks) from problem
        if problem is not None:
            raise problem
        issue_waiting_calls(self)  # done by ``compare`` (a group of more than one)
        backend = self.backend.split(color, int(key))
        if backend is None:
            return ProcessGroup(self.world, None, (), name or f"split(color=None) of {self.name}")
        mine = np.array([self.world.rank], dtype=np.int64)
        members = np.empty((backend.size, 1), dtype=np.int64)
        backend.all_gather(mine, members, async_op=False)
        group = ProcessGroup(self.world, backend, members[:, 0].tolist(),
                             name or f"split(color={color}) of {self.name}")
        return group.prepare_shared_memory()

    # -- the end of a group -------------------------------------------------------
    def destroy(self) -> None:
        """Collective over the group's members: free every MPI resource the group holds (see the module note).

        Each member first issues its asynchronous calls still waiting for their check and waits for the
        asynchronous calls it started on the group (``async_op=True``, ``isend``, ``irecv``) that it still
        holds a ``Work`` of; then the members meet (under the group's timeout, seen by the watchdog, so a
        member that never calls ``destroy`` is named) and free, in one order on every rank: the
        hierarchical all-reduce's node and cross-node groups, the collective layer's private channels, the
        node's shared-memory window, and the backend's communicators. Afterwards every use of the group on
        this rank raises ``GroupDestroyedError`` naming it; ``ranks``, ``name``, ``rank`` and
        ``is_member`` still answer. A non-member's call marks the group destroyed on that rank and sends
        nothing; a second call is a no-op. Arrays from ``shared_memory_array`` on the group stay valid
        (their windows are freed at exit, or earlier by ``free_shared_memory_array`` before ``destroy``).

        Raises:
            UsageError: the group is its world's default group (it lives as long as the world); or a member
                was in another of the group's checked calls instead (nothing is freed).
            CollectiveTimeoutError: a member did not come, or an outstanding call did not complete, within
                the group's timeout (nothing is freed).
        """
        if self.destroyed:
            return
        if self is self.world.default_group:
            raise UsageError(f"destroy: {self.name} is the default group of its world (ranks {list(self.ranks)}); it "
                             f"lives as long as the world (MPI frees it at exit). Destroy the groups made from it "
                             f"(new_group, split, node_group, mesh) instead")
        backend = self.member_backend
        if backend is None:  # a non-member holds nothing of the group
            self.destroyed = True
            return
        state = self.collective_state
        if state is not None:
            state.complete()  # waiting calls issued and outstanding ones waited for, before the members meet
        if self.size > 1:
            # The members meet: a member that never comes is named by the timeout and the watchdog, and one in
            # another of the group's checked calls (a split, a wrapper's model check) is seen here.
            seen = compare(self, True, "destroy", same=True, gather=self._meet)
            if seen is not None:
                raise UsageError(f"destroy of group {self.name}: not every member called destroy at this point "
                                 f"({who_passed(seen, self.ranks)}); every member must call it at the same point of "
                                 f"its program, as a collective; nothing was freed")
        for levels in self.node_levels.values():  # collectives.algorithms's hierarchy, made on every member alike
            levels.node.destroy()
            if levels.cross is not None:
                levels.cross.destroy()
        self.node_levels = {}
        if state is not None:
            state.free()  # the collective layer's private channels
        self.collective_state = None
        release(backend)  # the node's shared-memory window (collective over the group's communicator)
        backend.free()
        self.member_backend = None
        self.destroyed = True

    def _meet(self, mine: np.ndarray) -> np.ndarray:
        """``destroy``'s all-gather over the members (``agreement.compare``'s, named for what it is): waited for
        under the group's timeout and seen by the watchdog."""
        issue_waiting_calls(self)
        table = np.empty((self.size,) + mine.shape, dtype=mine.dtype)
        work = self.backend.all_gather(mine, table, async_op=True)
        work.label = CheckLabel(self, f"destroy of group {self.name} {list(self.ranks)} (its members meet before "
                                      f"it is freed)")
        timeout = self.effective_timeout()
        work.wait(math.inf if timeout is None else timeout)
        return table

    def __repr__(self) -> str:
        gone = ", destroyed" if self.destroyed else ""
        return f"ProcessGroup({self.name}, ranks={list(self.ranks)}, rank={self.rank}{gone})"
