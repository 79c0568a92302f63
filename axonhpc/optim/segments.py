"""Segments: a flat Parameter that holds pieces of several parameters, each stepped as that parameter alone.

[Note: segmented parameters]
A sharded wrapper lays several parameters end to end in one flat Parameter and gives the optimizer a slice
of that row (an FSDP unit's shard, a ZeRO-1 slice). One process steps a parameter only while its ``grad`` is
not None, and Adam counts each parameter's steps on its own; one flat Parameter with one ``grad`` and one
step count cannot say that. So the wrapper sets ``p.segments``: which elements of ``p.data`` are a piece of
which parameter of the row (``spans``), and which parameters the current ``p.grad`` stands for
(``with_grad``, None for all of them). ``Optimizer.step`` then updates each piece as that parameter alone,
and leaves the pieces of the others, values and state, as they are.

While every parameter of the row has taken the same steps, the state is the flat Parameter's ordinary state
and the update is the ordinary one over the whole slice: the common path costs nothing more. Otherwise
``state["segments"]`` holds one entry per parameter of the row: None before its first step, else the
scalars of its state (Adam's ``step``; SGD has none); the arrays stay whole (a piece's state is their
slice) and the other scalars are those of the first parameter that has stepped. A piece is updated with its
own scalars and slices, through the same ``_update_together`` and ``_update`` as a whole parameter, so the
numbers are those of updating that parameter alone (the updates are elementwise). A parameter this slice
holds no piece of is updated as an empty piece, which advances its scalars only: the entries cover the
whole row on every slice of it, so the slices agree and a checkpoint can be cut anew. Once every entry is
the same again the state goes back to the ordinary form.

A CUDA graph replays the same writes every time, so a segmented step cannot be captured: capturing one
raises ``GraphCaptureError``.
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._dtypes import array_module
from ..errors import ConfigurationError

STATE_KEY = "segments"  # the per-parameter entries in a segmented Parameter's state


class Segments:
    """The layout of a flat Parameter that holds pieces of ``count`` parameters (see the module note).

    Args:
        count: how many parameters the whole flat row holds (this Parameter may hold pieces of some only).
        spans: ``(index, at, length)`` per piece held: elements ``[at, at + length)`` of the Parameter's 1-D
            ``data`` belong to parameter ``index``; at most one piece per parameter, none empty.

    Attributes:
        with_grad: which of the ``count`` parameters the current ``grad`` stands for (a sequence of bools),
            or None for all of them. Whoever sets the Parameter's ``grad`` sets this with it.

    Raises:
        ConfigurationError: an index outside ``range(count)`` or given twice, an empty or negative span.
    """

    def __init__(self, count: int, spans: Sequence[Tuple[int, int, int]]) -> None:
        self.count = int(count)
        self.spans: Tuple[Tuple[int, int, int], ...] = tuple((int(i), int(at), int(n)) for i, at, n in spans)
        seen = set()
        for i, at, n in self.spans:
            if not 0 <= i < self.count or i in seen or n <= 0 or at < 0:
                raise ConfigurationError(f"Segments: span ({i}, {at}, {n}) is not a piece of one of {self.count} "
                                         f"parameters (each at most once, not empty)")
            seen.add(i)
        self.held = frozenset(seen)
        self.with_grad: Optional[Tuple[bool, ...]] = None

    def set_with_grad(self, flags: Optional[Sequence[Any]]) -> None:
        """Record which parameters the ``grad`` stands for (None, or every flag true: all of them)."""
        if flags is None or all(flags):
            self.with_grad = None
            return
        if len(flags) != self.count:
            raise ConfigurationError(f"Segments: {len(flags)} gradient flags for {self.count} parameters")
        self.with_grad = tuple(bool(f) for f in flags)

    def needs_split(self, state: Dict[str, Any]) -> bool:
        """Whether the next step must update piece by piece (some parameter lacks a gradient, or the parameters
        have taken different steps)."""
        return self.with_grad is not None or STATE_KEY in state

    def __repr__(self) -> str:
        return f"Segments(count={self.count}, spans={list(self.spans)}, with_grad={self.with_grad})"


class _Piece:
    """A piece of a flat Parameter as the optimizer's update sees a parameter: ``data`` and ``grad`` views."""

    __slots__ = ("data", "grad")

    def __init__(self, data: Any, grad: Any) -> None:
        self.data = data
        self.grad = grad


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape")


class SplitStep:
    """One step of a segmented Parameter: the pieces to update, then ``finish()`` writes their state back.

    ``pending`` are the pieces this Parameter holds, for ``_update_together`` with the other parameters;
    ``empty`` the empty pieces that stand for the parameters held elsewhere, for ``_update`` one by one (no
    multi-tensor launch is asked to take arrays without elements).

    Args:
        param: the flat Parameter (1-D ``data`` and ``grad``), with ``param.segments``.
        state: its optimizer state, changed in place by ``finish()``.
    """

    def __init__(self, param: Any, state: Dict[str, Any]) -> None:
        segments: Segments = param.segments
        if param.data.ndim != 1 or param.grad.shape != param.data.shape:
            raise ConfigurationError(f"a segmented Parameter needs 1-D data and a gradient of its shape, got "
                                     f"data {tuple(param.data.shape)} and grad {tuple(param.grad.shape)}")
        self.param = param
        self.state = state
        self.segments = segments
        entries = state.get(STATE_KEY)
        if entries is None:  # the ordinary form: every parameter has taken these steps (none if empty)
            scalars = {k: v for k, v in state.items() if not _is_array(v)}
            entries = [dict(scalars) if state else None for _ in range(segments.count)]
        self.entries: List[Optional[Dict[str, Any]]] = entries
        self.arrays = {k: v for k, v in state.items() if _is_array(v)}
        with_grad = segments.with_grad
        self.pending: List[Tuple[_Piece, Dict[str, Any]]] = []
        self.empty: List[Tuple[_Piece, Dict[str, Any]]] = []
        # per piece: (indices, at, length, the views handed out, its state)
        self._places: List[Tuple[List[int], int, int, Dict[str, Any], Dict[str, Any]]] = []
        for i, at, n in segments.spans:
            if with_grad is None or with_grad[i]:
                self._add([i], at, n)
        # The parameters held elsewhere advance their scalars through an empty piece, one per distinct entry.
        alike: Dict[str, List[int]] = {}
        for i in range(segments.count):
            if i not in segments.held and (with_grad is None or with_grad[i]):
                alike.setdefault(repr(entries[i]), []).append(i)
        for indices in alike.values():
            self._add(indices, 0, 0)

    def _add(self, indices: List[int], at: int, n: int) -> None:
        entry = self.entries[indices[0]]
        views = {k: v[at:at + n] for k, v in self.arrays.items()} if entry is not None else {}
        piece = _Piece(self.param.data[at:at + n], self.param.grad[at:at + n])
        sub = dict(entry or {}, **views)
        (self.pending if n else self.empty).append((piece, sub))
        self._places.append((indices, at, n, views, sub))

    def finish(self) -> None:
        """Write the pieces' new state into the flat state (after their updates ran)."""
        entries = list(self.entries)
        xp = array_module(self.param.data)
        for indices, at, n, views, sub in self._places:
            scalars = {k: v for k, v in sub.items() if not _is_array(v)}
            for i in indices:
                entries[i] = dict(scalars)
            for k, v in sub.items():
                if not _is_array(v):
                    continue
                flat = self.arrays.get(k)
                if flat is None:  # the first step of any parameter of the row: the whole array, zeros elsewhere
                    flat = self.arrays[k] = xp.zeros(self.param.data.shape, dtype=v.dtype)
                if v is not views.get(k) and n:
                    flat[at:at + n] = v
        stepped = [e for e in entries if e is not None]
        if not stepped or (not self.arrays and not any(stepped)):
            return  # nothing stepped, or an update that keeps no state (SGD without momentum): no state
        state = self.state
        state.clear()
        state.update(stepped[0])
        state.update(self.arrays)
        if len(stepped) < len(entries) or any(e != stepped[0] for e in stepped[1:]):
            state[STATE_KEY] = entries


def check_entries(entries: Any, count: Optional[int], scalar_keys: List[str], where: str) -> List[str]:
    """Why ``entries`` cannot be a segmented Parameter's ``state["segments"]`` (an empty list if it can).

    Args:
        entries: the saved value.
        count: the parameters of the row (the optimizer's Parameter's ``segments.count``), or None when the
            Parameter is not segmented (then any entries are refused).
        scalar_keys: the scalar keys of the state each stepped entry must hold.
        where: "parameter i", for the messages.
    """
    if count is None:
        return [f"{where} has per-parameter state {STATE_KEY!r} but is not a segmented Parameter (a flat shard)"]
    if not isinstance(entries, (list, tuple)) or len(entries) != count:
        got = len(entries) if isinstance(entries, (list, tuple)) else type(entries).__name__
        return [f"{where}: state {STATE_KEY!r} has {got} entries, the Parameter holds pieces of {count} parameters"]
    problems = []
    for j, entry in enumerate(entries):
        if entry is None:
            continue
        if not isinstance(entry, dict) or sorted(entry) != sorted(scalar_keys):
            problems.append(f"{where}: entry {j} of {STATE_KEY!r} is {entry!r}, not None or a dict of "
                            f"{sorted(scalar_keys)}")
            continue
        for k, v in entry.items():
            if k == "step":
                if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                    problems.append(f"{where}: 'step' of entry {j} of {STATE_KEY!r} is {v!r}, not an int >= 0")
            elif isinstance(v, bool) or not isinstance(v, numbers.Real):
                problems.append(f"{where}: {k!r} of entry {j} of {STATE_KEY!r} is {v!r}, not a number")
    return problems


def copy_entries(entries: Sequence[Any]) -> List[Optional[Dict[str, Any]]]:
    """A copy of saved entries with plain Python numbers (``step`` an int)."""
    out: List[Optional[Dict[str, Any]]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
        else:
            out.append({k: int(v) if k == "step" else (v.item() if hasattr(v, "item") else v)
                        for k, v in entry.items()})
    return out


__all__ = ["Segments", "SplitStep", "STATE_KEY", "check_entries", "copy_entries"]
