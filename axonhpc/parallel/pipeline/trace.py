"""Pipeline timelines: gather them to one rank, measure the bubble, export Chrome traces and Gantt charts.

[Note: clocks]
Each rank's times are relative to its own step start; ranks are not synchronised first. On ranks that start
together (after a barrier, as the benchmark does) the offsets are small next to a step.

[Note: the gather encoding]
A timeline travels as a float64 array of rows ``(stage, kind, microbatch, start, end)``. Every rank knows
every rank's action count from the schedule table, so arrays are NaN-padded to the longest and trimmed by
the receiver; a timeline not of its schedule's length raises before the gather, on every rank that notices.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ...collectives import gather
from ...errors import MissingDependencyError, UsageError
from .schedules import BACKWARD, FORWARD, Action

Timeline = List[Tuple[Action, float, float]]
Timelines = Union[Sequence[Any], Mapping[int, Any]]
_KINDS = (FORWARD, BACKWARD)


def timeline_to_array(timeline: Sequence[Tuple[Action, float, float]]) -> np.ndarray:
    """Encode a timeline as a float64 array of rows ``(stage, kind 0/1, microbatch, start, end)``."""
    out = np.empty((len(timeline), 5), dtype=np.float64)
    for k, (action, start, end) in enumerate(timeline):
        out[k] = (action.stage, _KINDS.index(action.kind), action.microbatch, start, end)
    return out


def timeline_from_array(rows: np.ndarray) -> Timeline:
    """Decode ``timeline_to_array``'s rows (rows of NaN, padding, are dropped)."""
    timeline = []
    for stage, kind, mb, start, end in np.asarray(rows, dtype=np.float64).reshape(-1, 5):
        if np.isnan(stage):
            continue
        timeline.append((Action(int(stage), _KINDS[int(kind)], int(mb)), float(start), float(end)))
    return timeline


def gather_timelines(pipe: Any, dst: int = 0) -> Optional[List[Timeline]]:
    """Collective: every pipeline rank's last ``train_step`` timeline, as a list on group rank ``dst``; None elsewhere.

    Raises RuntimeError before any message if this rank has no timeline of its schedule's length (no step run).
    """
    table = pipe.schedule_table()
    timeline = pipe.last_step_stats.get("timeline")
    expected = len(table[pipe.rank])
    if timeline is None or len(timeline) != expected:
        got = "none" if timeline is None else f"{len(timeline)} actions"
        raise UsageError(f"gather_timelines: rank {pipe.rank} has {got}, expected {expected} "
                           f"(run train_step on every rank first)")
    longest = max(len(actions) for actions in table)
    rows = np.full((longest, 5), np.nan, dtype=np.float64)
    rows[:expected] = timeline_to_array(timeline)
    stacked = gather(rows, dst=dst, group=pipe.group)
    if stacked is None:
        return None
    return [timeline_from_array(stacked[r][:len(table[r])]) for r in range(len(table))]


def _by_rank(timelines: Timelines) -> List[Tuple[int, Timeline]]:
    """(rank, timeline) pairs from a list or {rank: ...}; entries may be stats dicts with "timeline"."""
    items = timelines.items() if isinstance(timelines, Mapping) else enumerate(timelines)
    out = []
    for rank, entry in items:
        if isinstance(entry, Mapping):
            entry = entry["timeline"]
        out.append((int(rank), list(entry)))
    return out


def timeline_bubble(timelines: Timelines) -> float:
    """Measured bubble: ``1 - sum(busy) / (ranks * span)`` over the step's span, in [0, 1] (0.0 for no actions).

    ``timelines``: one per rank, a list or {rank: timeline}; a ``last_step_stats`` dict stands for its timeline.
    """
    pairs = _by_rank(timelines)
    events = [(start, end) for _, tl in pairs for _, start, end in tl]
    if not events:
        return 0.0
    span = max(e for _, e in events) - min(s for s, _ in events)
    if span <= 0:
        return 0.0
    busy = sum(e - s for s, e in events)
    return max(0.0, 1.0 - busy / (len(pairs) * span))


def chrome_trace(timelines: Timelines) -> Dict[str, Any]:
    """The Chrome-trace document for per-rank timelines (see ``write_chrome_trace``)."""
    events: List[Dict[str, Any]] = []
    for rank, timeline in _by_rank(timelines):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for action, start, end in timeline:
            events.append({
                "name": str(action), "cat": "forward" if action.kind == FORWARD else "backward", "ph": "X",
                "pid": rank, "tid": 0, "ts": start * 1e6, "dur": (end - start) * 1e6,
                "args": {"stage": action.stage, "microbatch": action.microbatch},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timelines: Timelines, path: str) -> Dict[str, Any]:
    """Write per-rank pipeline timelines as Chrome-trace JSON (open in ``chrome://tracing`` or Perfetto).

    One complete event per action, ``pid`` = rank, ``name`` = ``str(action)``, times in microseconds.
    ``timelines`` as ``timeline_bubble`` takes them (e.g. from ``gather_timelines``). Returns the document.
    """
    doc = chrome_trace(timelines)
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc


def write_gantt_png(timelines: Timelines, path: str) -> None:
    """Draw per-rank timelines as a Gantt chart PNG (forwards light, backwards dark); needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependencyError("write_gantt_png needs matplotlib, which is not installed: "
                          "pip install matplotlib") from exc
    pairs = _by_rank(timelines)
    fig, ax = plt.subplots(figsize=(10, 0.6 * max(1, len(pairs)) + 1))
    for rank, timeline in pairs:
        for action, start, end in timeline:
            color = "#9ecae1" if action.kind == FORWARD else "#3182bd"
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (rank - 0.4, 0.8), facecolors=color,
                           edgecolors="black", linewidth=0.3)
            ax.text((start + end) / 2 * 1e3, rank, str(action), ha="center", va="center", fontsize=6)
    ax.set_yticks([rank for rank, _ in pairs])
    ax.set_yticklabels([f"rank {rank}" for rank, _ in pairs])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["gather_timelines", "timeline_bubble", "timeline_to_array", "timeline_from_array", "chrome_trace",
           "write_chrome_trace", "write_gantt_png"]
