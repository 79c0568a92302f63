"""``ax.timeline``: every rank's spans, merged into one Chrome trace that Perfetto opens.

[Note: the timeline]
``with ax.timeline("trace.json"):`` records on every rank spans of forward and backward, DDP
buckets' all-reduces, optimizer steps and every collective and point-to-point call. Entering is a
barrier after which each rank reads its clock, so zero points differ by the barrier's skew
(microseconds on one node). Leaving gathers every rank's spans to group rank 0, which writes one
file atomically. Each rank is a process (``pid`` = world rank) with compute, comm and buckets
threads. A communication span ends when its completion was *seen*, so it bounds the transfer above.

If the body raises, no rank communicates on the way out (the others may not be there): each writes
``<path>.rank<r>.json`` and the error propagates. ``merge_files`` (``axonhpc timeline merge``) joins
such files and those of ``timeline_dir`` (``AXONHPC_TIMELINE_DIR``), aligned by wall clocks (across
nodes only as close as their clock synchronisation).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..collectives import all_gather, barrier, gather
from ..errors import ConfigurationError, NotFoundError
from ..groups import resolve_group
from . import tracing

_LANE_TIDS = {lane: k for k, lane in enumerate(tracing.LANES)}


def chrome_events(rank: int, spans: Sequence[tracing.Span], offset_s: float = 0.0) -> List[Dict[str, Any]]:
    """One rank's spans as Chrome-trace events (``ph: "X"``), shifted by ``offset_s``, with name metadata."""
    events: List[Dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for lane, tid in _LANE_TIDS.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
    for name, lane, start, end, args in spans:
        events.append({"ph": "X", "name": name, "cat": lane, "pid": rank, "tid": _LANE_TIDS[lane],
                       "ts": round((start + offset_s) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
                       "args": args})
    return events


def _trace(events: List[Dict[str, Any]], **meta: Any) -> Dict[str, Any]:
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta, producer="axonhpc")}


def _gather_text(text: str, pg: Any) -> Optional[List[str]]:
    """Every rank's ``text`` on group rank 0 (None elsewhere): lengths first, then padded bytes."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = all_gather(np.array([data.size], dtype=np.int64), pg).reshape(-1)
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[:data.size] = data
    rows = gather(padded, 0, pg)
    if rows is None:
        return None
    return [bytes(rows[k, :int(lengths[k])]).decode() for k in range(pg.size)]


class _TimelineRecorder(tracing.Recorder):
    """The recorder of an open ``ax.timeline`` (told apart from a whole-run one)."""


@contextlib.contextmanager
def timeline(path: "str | os.PathLike[str]", group: Any = None) -> Iterator[tracing.Recorder]:
    """Record every rank's spans in the body and write one merged Chrome trace to ``path`` (collective).

    Args:
        path: the JSON file group rank 0 writes (open it at ui.perfetto.dev
            or chrome://tracing).
        group: the ranks that record (None: the current world's).

    Yields:
        This rank's ``tracing.Recorder`` (its ``spans`` can be read after the body).

    Raises:
        ConfigurationError: a timeline is already open on this rank.
    """
    path = os.fspath(path)
    pg = resolve_group(group).require_member("timeline")
    previous = tracing.active()
    if isinstance(previous, _TimelineRecorder):
        raise ConfigurationError("a timeline is already recording on this rank; timelines cannot be nested")
    barrier(pg)
    recorder = _TimelineRecorder(pg.world.rank)
    recorder.parent = previous  # a whole-run recorder (setting timeline_dir) keeps getting every span
    process_wide = getattr(pg.backend, "name", "") != "local"  # thread ranks share the process
    saved = tracing.install(recorder, process_wide)
    try:
        yield recorder
    except BaseException:
        tracing.restore(saved)
        tracing.write_rank_file(f"{path}.rank{pg.world.rank:05d}.json", recorder)
        raise
    tracing.restore(saved)
    mine = json.dumps(chrome_events(pg.world.rank, recorder.snapshot()), default=str)
    parts = _gather_text(mine, pg)
    if parts is not None:
        events = [event for part in parts for event in json.loads(part)]
        tracing.write_json_atomic(path, _trace(events, group=pg.name, ranks=list(pg.ranks),
                                        aligned="barrier on entering ax.timeline"))


def merge_files(paths: Sequence[str]) -> Dict[str, Any]:
    """Merge per-rank timeline files into one Chrome trace, aligned by their wall clocks.

    Raises:
        ConfigurationError: no files, a file that is not a rank timeline, or one rank twice.
    """
    if not paths:
        raise ConfigurationError("no timeline rank files to merge")
    ranks: Dict[int, Dict[str, Any]] = {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"cannot read timeline file {path!r}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != tracing.RANK_FILE_FORMAT:
            raise ConfigurationError(f"{path!r} is not an axonhpc per-rank timeline file")
        if data["rank"] in ranks:
            raise ConfigurationError(f"rank {data['rank']} appears twice: {path!r} and {ranks[data['rank']]['path']!r}")
        ranks[int(data["rank"])] = dict(data, path=path)
    zero = min(float(d["wall_origin"]) for d in ranks.values())
    events: List[Dict[str, Any]] = []
    for rank in sorted(ranks):
        spans = [tuple(s) for s in ranks[rank]["spans"]]
        events.extend(chrome_events(rank, spans, float(ranks[rank]["wall_origin"]) - zero))
    return _trace(events, ranks=sorted(ranks), aligned="wall clock of each rank")


def merge_directory(directory: str, out: str) -> int:
    """Merge ``directory``'s ``timeline-rank*.json`` into ``out``; returns how many ranks were merged.

    Raises:
        NotFoundError: ``directory`` does not exist or holds no ``timeline-rank*.json`` (both named).
        ConfigurationError: a file there is not a rank timeline, or names a rank twice.
    """
    if not os.path.isdir(directory):
        raise NotFoundError(f"timeline folder {directory!r} does not exist (give the AXONHPC_TIMELINE_DIR of the job)")
    paths = sorted(glob.glob(os.path.join(directory, "timeline-rank*.json")))
    if not paths:
        raise NotFoundError(f"no timeline-rank*.json in {directory!r} (is it the AXONHPC_TIMELINE_DIR of the job, "
                            f"and did the job reach its end? each rank writes its file at exit)")
    trace = merge_files(paths)
    tracing.write_json_atomic(out, trace)
    return len(trace["otherData"]["ranks"])


__all__ = ["timeline", "chrome_events", "merge_files", "merge_directory"]
