"""Parallel wrappers check, when they are built, that every rank of their group holds the same model.

[Note: why and how the wrappers compare their models]
The wrappers assume every rank built the same model. A rank that built another (another config, a forgotten
``.astype``) would otherwise move buffers of other sizes: a hang, a ``ShapeError`` on some ranks only, or
silently wrong numbers. So each wrapper, before any other message, describes its model as one
``name:dtype:shape`` line per parameter and runs one all-gather of (ok, length, 64-bit digest) per rank.
Only when digests differ does more travel, so that every rank raises the same ``ModelMismatchError`` naming
the first differing parameter. A rank whose local checks failed still takes part, marked failed, so the
others raise naming it instead of waiting for it.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import check_array, is_cupy_array
from ..collectives import all_gather
from ..errors import AxonError, ModelMismatchError, NonContiguousBufferError, everywhere
from ..groups.agreement import Failed, all_or_none, compare, ranks_text

_state = threading.local()  # threads are ranks under run_local: one depth per rank


def parameter_lines(named: Iterable[Tuple[str, Any]]) -> List[str]:
    """``name:dtype:shape`` of each ``(name, Parameter or array)`` (``:device`` appended for device memory)."""
    lines = []
    for name, p in named:
        data = getattr(p, "data", p)
        line = f"{name}:{np.dtype(data.dtype)}:{tuple(int(d) for d in data.shape)}"
        lines.append(line + (":device" if is_cupy_array(data) else ""))
    return lines


def check_model_arrays(module: Any, what: str) -> None:
    """Raise, naming it, on a parameter or buffer of ``module`` that a wrapper cannot send in place (an
    unsupported dtype, not C-contiguous, read-only): meant inside ``compared_model``, so every rank hears of it.

    Raises:
        UnsupportedDtypeError, NonContiguousBufferError, ReadOnlyBufferError: from ``check_array``, with a hint
            for a model's arrays.
    """
    arrays = [(f"parameter {name!r}", p.data) for name, p in module.named_parameters()]
    arrays += [(f"buffer {name!r}", b) for name, b in module.named_buffers()]
    for label, array in arrays:
        try:
            check_array(array, f"{what}: {label}", writable=True)
        except NonContiguousBufferError as exc:
            raise NonContiguousBufferError(
                f"{str(exc).split('; pass')[0]}; make it C-contiguous before wrapping the model (assign "
                f"numpy.ascontiguousarray of it to the parameter's .data, or the buffer)") from None


@contextlib.contextmanager
def agreed() -> Iterator[None]:
    """Inside, ``compared_model`` compares nothing: an enclosing layer compared its whole geometry once."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def _by_value(values: Sequence[str], ranks: Sequence[int]) -> str:
    """``ranks [0, 2] have X; rank 1 has Y``, in order of each value's first rank."""
    groups: dict = {}
    for r, value in enumerate(values):
        groups.setdefault(value, []).append(int(ranks[r]))
    return "; ".join(f"{ranks_text(rs)} {'have' if len(rs) > 1 else 'has'} {value}"
                     for value, rs in sorted(groups.items(), key=lambda item: item[1][0]))


def _first_difference(group: Any, lines: Sequence[str], noun: str) -> Tuple[int, List[str], List[bool]]:
    """Collective: the first line that differs across the group, and every rank's line there."""
    counts = all_gather(np.array([len(lines)], dtype=np.int64), group).reshape(-1)
    width = max(1, int(counts.max()))
    mine = np.zeros(width, dtype=np.int64)
    mine[:len(lines)] = [_digest(line) for line in lines]
    table = all_gather(mine, group).reshape(group.size, width)
    index = width - 1
    for i in range(width):
        column = {(i < int(counts[r]), int(table[r, i]) if i < int(counts[r]) else 0) for r in range(group.size)}
        if len(column) > 1:
            index = i
            break
    here = lines[index] if index < len(lines) else f"no {noun} there (only {len(lines)})"
    seen = compare(group, True, here, same=True)
    values = [text for _, text in seen] if seen is not None else [here] * group.size
    return index, values, [index < int(c) for c in counts]


class Description:
    """What a ``compared_model`` block describes: ``lines`` (the parameters) and ``settings`` (``label: value``)."""

    __slots__ = ("lines", "settings")

    def __init__(self) -> None:
        self.lines: Sequence[str] = []
        self.settings: Sequence[str] = []


_HINT = ("every rank of the group must build the same model (the same layers, sizes and dtypes, in the same order) "
         "before wrapping it")


@contextlib.contextmanager
def compared_model(group: Any, what: str, hint: str = _HINT) -> Iterator[Description]:
    """Collective over ``group``: run the block (local checks, setting the description), then compare it.

    Raises:
        ModelMismatchError: the descriptions differ (every rank), or another rank's block raised.
        AxonError: what the block raised, on the rank that raised it.
    """
    described = Description()
    if group.size == 1 or getattr(_state, "depth", 0):
        yield described
        return

    def refused(failed: Failed) -> ModelMismatchError:
        first, why = failed[0]
        return everywhere(ModelMismatchError(
            f"{what}: {ranks_text([group.ranks[r] for r, _ in failed])} could not build it (rank "
            f"{group.ranks[first]}: {why}); nothing else was sent"), group.ranks)

    def differ(seen: Any) -> ModelMismatchError:
        return _mismatch(group, what, list(described.settings), list(described.lines), hint)

    with all_or_none(group, refused, differ) as vote:
        yield described
        vote.text = "\n".join(list(described.settings) + list(described.lines))


def _mismatch(group: Any, what: str, settings: List[str], lines: List[str], hint: str) -> ModelMismatchError:
    """Collective: the error naming the first line that differs across the group, and which ranks have which."""
    index, values, present = _first_difference(group, settings + lines, "parameter")
    if index < len(settings):
        where = f"{settings[index].split(':', 1)[0]!r}"
    else:
        names = {v.split(":", 1)[0] for v, here in zip(values, present) if here}
        position = index - len(settings)
        where = (f"parameter {names.pop()!r} (position {position}" if len(names) == 1
                 else f"the parameter at position {position}") + ", shown as name:dtype:shape)"
    return everywhere(ModelMismatchError(
        f"{what}: the {group.size} ranks hold different models; the first difference is "
        f"{where}: {_by_value(values, group.ranks)}. {hint[0].upper()}{hint[1:]}; nothing else was sent"), group.ranks)


def check_same_model(group: Any, what: str, lines: Sequence[str], problem: Optional[AxonError] = None,
                     settings: Sequence[str] = (), hint: str = _HINT) -> None:
    """``compared_model`` for a model described (or a ``problem`` found) before: lines, settings as it describes."""
    with compared_model(group, what, hint) as described:
        if problem is not None:
            raise problem
        described.lines, described.settings = lines, settings


__all__ = ["parameter_lines", "check_model_arrays", "compared_model", "check_same_model", "agreed", "Description"]
