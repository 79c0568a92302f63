"""Who trains after a loss, on a dp x tp x pp mesh: lost places are filled, or their dp replica is dropped.

[Note: places on the mesh]
The working ranks are kept in world-rank order, so place ``i`` is mesh
coordinates ``(pp, dp, tp) = (i // (dp tp), (i // tp) % dp, i % tp)`` (as
``groups.mesh`` numbers them). After a loss each empty place is filled by a
spare (or a replacement), which keeps its replica whole. A replica with a
place still empty cannot train: it is dropped, dp shrinks by one, and its
surviving ranks become spares. With tp = pp = 1 a replica is one rank, and
this is plain data-parallel shrinking.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Shape = Tuple[int, int, int]  # dp, tp, pp


def fill(old_working: Sequence[int], survivors: Sequence[int]) -> List[Optional[int]]:
    """The old places, a lost rank's taken by the next spare (a survivor that did not work), else None."""
    spares = [m for m in survivors if m not in old_working]
    return [m if m in survivors else (spares.pop(0) if spares else None) for m in old_working]


def plan(places: Sequence[Optional[int]], shape: Shape) -> Tuple[List[int], int]:
    """The new working ranks in world-rank order of the new mesh, and its dp (the replicas with no empty place)."""
    dp, tp, pp = shape
    broken = {(i // tp) % dp for i, m in enumerate(places) if m is None}
    kept = [d for d in range(dp) if d not in broken]
    return [places[(p * dp + d) * tp + t] for p in range(pp) for d in kept for t in range(tp)], len(kept)


def neighbour(place: int, shape: Shape, step: int) -> int:
    """The place ``step`` dp ranks on from ``place`` (same tp and pp coordinates): its FSDP keeper at +1."""
    dp, tp, _ = shape
    p, d, t = place // (dp * tp), (place // tp) % dp, place % tp
    return (p * dp + (d + step) % dp) * tp + t


def unkept_shards(old_working: Sequence[int], working: Sequence[int], lost: Sequence[int],
                  shape: Shape) -> List[str]:
    """FSDP shards that neither their holder nor its keeper brings to the new run, each said in words."""
    dp, tp, _ = shape
    out = []
    for place, holder in enumerate(old_working):
        keeper = old_working[neighbour(place, shape, 1)]
        if holder in working or keeper in working:
            continue
        d = (place // tp) % dp
        how = "both failed" if holder in lost and keeper in lost else "are both out of the run (a replica dropped)"
        said = f"dp rank {d} and its keeper {(d + 1) % dp} {how}"
        if said not in out:  # one line for the tp and pp coordinates alike
            out.append(said)
    return out


__all__ = ["fill", "plan", "neighbour", "unkept_shards", "Shape"]
