"""Group-making calls compare their arguments across ranks before anything else is sent.

[Note: why group creation compares arguments]
``new_group``, ``split`` and ``mesh`` are collective: every rank of the
parent must call them, with arguments that fit together. A rank whose local
checks fail would raise alone and leave the others waiting inside
``MPI_Comm_create`` or ``MPI_Comm_split`` forever, and ranks that pass
different lists to ``new_group`` would build different groups (or hang).
So each of these calls first runs ``compare``: one small all-gather over the
parent group, after which every rank knows the same facts and raises the
same error, or none does.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

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


def compare(group: Members, ok: bool, text: str, same: bool) -> Optional[List[Tuple[bool, str]]]:
    """Compare the arguments of a group-making call across ``group``, before anything else is sent.

    Each rank gives whether its arguments passed its local checks and their
    text. One all-gather of (ok, length, 64-bit digest) per rank settles the
    common case; only when some rank failed its checks, or (``same``) the
    texts differ, does a second all-gather bring every rank's text (at most
    ``_SHOWN_BYTES`` of it), so that every rank can raise the same error.

    Returns:
        None when every rank passed its checks and (``same``) every text is
        the same; else ``(ok, text)`` of every group rank.
    """
    data = text.encode("utf-8")
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    mine = np.array([int(ok), len(data), digest], dtype=np.int64)
    table = np.empty((group.size, 3), dtype=np.int64)
    group.backend.all_gather(mine, table, async_op=False).wait()
    if table[:, 0].all() and (not same or (table[:, 1:] == table[0, 1:]).all()):
        return None
    shown = data[:_SHOWN_BYTES]
    width = max(1, min(int(table[:, 1].max()), _SHOWN_BYTES))
    padded = np.zeros(width, dtype=np.uint8)
    padded[:len(shown)] = np.frombuffer(shown, dtype=np.uint8)
    texts = np.empty((group.size, width), dtype=np.uint8)
    group.backend.all_gather(padded, texts, async_op=False).wait()
    seen = []
    for r in range(group.size):
        n = int(table[r, 1])
        text_r = bytes(texts[r, :min(n, width)]).decode("utf-8", "replace") + ("..." if n > width else "")
        seen.append((bool(table[r, 0]), text_r))
    return seen


def who_passed(seen: Sequence[Tuple[bool, str]], ranks: Sequence[int], template: str = "{}") -> str:
    """``ranks [0, 2] passed X; rank 1 passed Y``: the texts of ``compare``, by the (world) ranks that passed each.

    Args:
        seen: ``compare``'s ``(ok, text)`` per group rank.
        ranks: the world rank of each group rank.
        template: how a text is shown (``"mesh({})"``).
    """
    by_text: Dict[str, List[int]] = {}
    for r, (_, text) in enumerate(seen):
        by_text.setdefault(text, []).append(int(ranks[r]))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} passed {template.format(text)}"
                     for text, rs in sorted(by_text.items(), key=lambda item: item[1][0]))


__all__ = ["compare", "show", "who_passed"]
