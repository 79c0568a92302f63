"""Group-making calls compare their arguments across ranks before anything else is sent.

[Note: why group creation compares arguments]
``new_group``, ``split`` and ``mesh`` are collective. A rank whose local checks fail would raise alone and
leave the others inside ``MPI_Comm_split`` forever, and different lists would build different groups. So
each first runs ``compare``: one small all-gather, after which every rank raises the same error, or none.

[Note: all or none]
The same holds wherever a check that may fail on one rank precedes a collective. ``all_or_none`` runs the
check in a ``with`` block, then one ``compare``. Only ``AxonError`` is caught unless ``catch`` says more: the
library raises those on purpose, with a message fit for the other ranks; anything else is a bug, raised at
once (the others wait for this rank as for a crashed one).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, Type,
                    Union)

import numpy as np

from ..errors import AxonError

if TYPE_CHECKING:  # pragma: no cover
    from ..backends.base import Backend


class Members(Protocol):
    """What ``compare`` reads of a group: a ``ProcessGroup``, not imported here (process_group.py imports this)."""

    @property
    def size(self) -> int: ...

    @property
    def backend(self) -> "Backend": ...


# The most bytes of one rank's arguments shown in a disagreement (the comparison covers all of them).
_SHOWN_BYTES = 2048


def show(values: Sequence[Any]) -> str:
    """A list as every rank prints it alike: integers as plain numbers (numpy's too), anything else by repr."""
    return "[" + ", ".join(str(int(v)) if hasattr(v, "__index__") and not isinstance(v, bool) else repr(v)
                           for v in values) + "]"


Gather = Callable[[np.ndarray], np.ndarray]  # an all-gather over the group: this rank's array -> (size, ...)


class CheckLabel:
    """How a check's wait is named in messages, and the group the stall watchdog watches it on."""

    __slots__ = ("group", "text")

    def __init__(self, group: Any, text: str):
        self.group, self.text = group, text

    def __str__(self) -> str:
        return self.text


# [Note: making a group while calls are in flight]
# MPI advances a rank's nonblocking calls while it makes a communicator, so a rank may start a call on group B,
# then make a group, while another rank makes that group first and then calls B, or makes B's call blocking
# first. The node's engine carries such a call in flight (collectives.engine_calls), but the steps of making a
# group that cannot poll (``MPI_Comm_split``, the window of the new group's engine) would not advance it, and
# completing it first would wait for a rank already in those steps. So the members first meet in a wait that
# polls, advancing this thread's calls: the comparison of their arguments (``compare``, one small all-gather,
# made by every group-making call of more than one rank). Once every member has come, none waits for this
# rank's calls to get there, and the blocking steps may go on while a call is still in flight.


def issue_waiting_calls(group: Any) -> None:
    """Issue the group's asynchronous calls still waiting for their check (the collective layer's
    ``GroupState.issue_unissued``) before a group-making step goes over its communicator: MPI needs every
    rank to start the communicator's collectives in one order, and a rank that made such a call blocking
    waits in it."""
    state = getattr(group, "collective_state", None)
    if state is not None and state.unissued:
        state.issue_unissued()


def _all_gather(group: Members, gather: Optional[Gather], mine: np.ndarray) -> np.ndarray:
    """The check's all-gather over ``group``, waited for under the group's timeout and seen by the watchdog:
    a rank that never makes its call (a ``new_group`` skipped on one rank) must not leave the others waiting
    without a word."""
    if gather is not None:
        return gather(mine)
    issue_waiting_calls(group)
    table = np.empty((group.size,) + mine.shape, dtype=mine.dtype)
    work = group.backend.all_gather(mine, table, async_op=True)
    name = getattr(group, "name", None)
    if name is not None:
        work.label = CheckLabel(group, f"the check of a call's arguments across group {name} {list(group.ranks)} "
                                       f"(new_group, split, mesh, a wrapper's model check or a refusal)")
    timeout = group.effective_timeout() if hasattr(group, "effective_timeout") else None
    work.wait(math.inf if timeout is None else timeout)
    return table


def compare(group: Members, ok: bool, text: str, same: bool,
            gather: Optional[Gather] = None) -> Optional[List[Tuple[bool, str]]]:
    """Compare a group-making call's ``(ok, text)`` across ``group``: None if all passed (and alike), else every rank's.

    One all-gather of (ok, length, digest); only on a difference does a second bring the texts.
    """
    data = text.encode("utf-8")
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    mine = np.array([int(ok), len(data), digest], dtype=np.int64)
    table = _all_gather(group, gather, mine)
    if table[:, 0].all() and (not same or (table[:, 1:] == table[0, 1:]).all()):
        return None
    shown = data[:_SHOWN_BYTES]
    width = max(1, min(int(table[:, 1].max()), _SHOWN_BYTES))
    padded = np.zeros(width, dtype=np.uint8)
    padded[:len(shown)] = np.frombuffer(shown, dtype=np.uint8)
    texts = _all_gather(group, gather, padded)
    seen = []
    for r in range(group.size):
        n = int(table[r, 1])
        text_r = bytes(texts[r, :min(n, width)]).decode("utf-8", "replace") + ("..." if n > width else "")
        seen.append((bool(table[r, 0]), text_r))
    return seen


def who_passed(seen: Sequence[Tuple[bool, str]], ranks: Sequence[int], template: str = "{}") -> str:
    """``ranks [0, 2] passed X; rank 1 passed Y``: the texts of ``compare``, by the (world) ranks that passed each.

    ``template``: how a text is shown (``"mesh({})"``).
    """
    by_text: Dict[str, List[int]] = {}
    for r, (_, text) in enumerate(seen):
        by_text.setdefault(text, []).append(int(ranks[r]))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} passed {template.format(text)}"
                     for text, rs in sorted(by_text.items(), key=lambda item: item[1][0]))


Failed = List[Tuple[int, str]]  # (group rank, "ErrorType: message") of each rank that failed
Refused = Callable[[Failed], BaseException]  # the error the ranks raise that did not fail themselves
Differ = Callable[[List[Tuple[bool, str]]], BaseException]  # the error every rank raises when the texts differ


class Vote:
    """What an ``all_or_none`` block gives: ``text``, which every rank must give alike (read when ``differ`` is set)."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text = ""


def reason(problem: BaseException) -> str:
    """How a rank's error is shown to the others: ``"ShapeError: ..."``."""
    return f"{type(problem).__name__}: {problem}"


def agree(group: Members, problem: Optional[BaseException], refused: Refused, differ: Optional[Differ] = None,
          text: str = "", alike: bool = False, gather: Optional[Gather] = None) -> None:
    """Collective over ``group``: raise on every rank if any failed (``problem`` here), else if ``text`` differs."""
    if group.size == 1:
        seen = None if problem is None else [(False, reason(problem))]
    else:
        mine = text if problem is None else reason(problem)
        seen = compare(group, problem is None, mine, same=differ is not None, gather=gather)
    if seen is None:
        return
    failed = [(r, why) for r, (ok, why) in enumerate(seen) if not ok]
    if not failed:
        raise differ(seen)  # type: ignore[misc]  # only a comparison of texts returns with none failed
    if problem is not None and not alike:
        raise problem
    raise refused(failed) from problem


@contextlib.contextmanager
def all_or_none(group: Members, refused: Refused, differ: Optional[Differ] = None,
                catch: Union[Type[BaseException], Tuple[Type[BaseException], ...]] = AxonError,
                alike: bool = False, gather: Optional[Gather] = None) -> Iterator[Vote]:
    """Run the block, then ``agree`` over ``group`` on whether it raised (``catch``) anywhere (see the note).

    With ``differ``, the block sets ``vote.text`` to what every rank must give alike (a model's
    description, a file's digest).
    """
    vote, problem = Vote(), None
    try:
        yield vote
    except catch as exc:
        problem = exc
    agree(group, problem, refused, differ, vote.text, alike, gather)


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks [1, 3]``."""
    return f"ranks {list(ranks)}" if len(ranks) > 1 else f"rank {ranks[0]}"


__all__ = ["compare", "show", "who_passed", "agree", "all_or_none", "reason", "ranks_text", "Vote", "Failed", "Refused",
           "Gather"]
