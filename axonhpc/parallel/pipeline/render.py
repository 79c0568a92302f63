"""Pipeline schedules as text: a step-by-rank grid with one row per rank.

A timed grid places each action where ``simulate_pipeline`` says it runs, so this module imports the
simulator, and neither ``schedules`` nor ``simulate`` imports it (as torch keeps its visualizer apart).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .schedules import Action, check_positive_int
from .simulate import simulate_pipeline


def format_schedule_table(
    actions_by_rank: Sequence[Sequence[Action]],
    *,
    timed: bool = True,
    forward_cost: int = 1,
    backward_cost: int = 1,
) -> str:
    """Render per-rank action lists as a step-by-rank grid (one row per rank), no trailing newline.

    With ``timed=True`` the schedule is simulated with integer costs (``forward_cost``, ``backward_cost``) and
    column t shows what each rank runs during step t: idle steps are ``.`` (so bubbles and the warm-up diagonal
    show), longer actions are followed by ``-`` cells, and a deadlock is named on a last line. With
    ``timed=False`` column i is the i-th action of each rank's list. 1F1B, 4 stages, 8 micro-batches::

        step    0   1   2   3   4   5   6   7   8   9
        rank 0  0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1
        rank 1  .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1F4

    Raises ConfigurationError for a cost that is not a positive int, or malformed lists.
    """
    if timed:
        rows, note = _timed_rows(actions_by_rank, forward_cost, backward_cost)
        return _grid("step", rows, note)
    return _grid("slot", [[str(a) for a in actions] for actions in actions_by_rank], None)


def _timed_rows(actions_by_rank: Sequence[Sequence[Action]], forward_cost: int,
                backward_cost: int) -> Tuple[List[List[str]], Optional[str]]:
    """One row of cells per rank on the simulated time axis, and the deadlock line if any."""
    check_positive_int("forward_cost", forward_cost)
    check_positive_int("backward_cost", backward_cost)
    result = simulate_pipeline(actions_by_rank, forward_cost=forward_cost, backward_cost=backward_cost)
    width_t = int(round(result.makespan))
    rows = []
    for timeline in result.timelines:
        cells = ["."] * width_t
        for action, start, end in timeline:
            s, e = int(round(start)), int(round(end))
            cells[s] = str(action)
            for t in range(s + 1, e):
                cells[t] = "-"
        rows.append(cells)
    note = "deadlock: " + result.deadlock_description if result.deadlock else None
    return rows, note


def _grid(header: str, rows: Sequence[Sequence[str]], note: Optional[str]) -> str:
    """Left-aligned columns under a ``header 0 1 2 ...`` line, one ``rank r`` line per row."""
    ncols = max((len(r) for r in rows), default=0)
    labels = [f"rank {r}" for r in range(len(rows))]
    label_w = max([len("step")] + [len(x) for x in labels])
    cell_w = max([len(str(max(ncols - 1, 0)))] + [len(c) for r in rows for c in r])
    lines = [" ".join([header.ljust(label_w)] + [str(t).ljust(cell_w) for t in range(ncols)])]
    for label, r in zip(labels, rows):
        lines.append(" ".join([label.ljust(label_w)] + [c.ljust(cell_w) for c in r]).rstrip())
    if note:
        lines.append(note)
    return "\n".join(line.rstrip() for line in lines)


__all__ = ["format_schedule_table"]
