"""``axonhpc doctor DIR``: merge the flight recorders of every rank and say who diverged first, and where.

A group's collectives must match across its ranks call by call, so the diagnosis walks each group's
sequence numbers and reports the first where the ranks called different things or some never
reached it; it lists ranks still waiting when they dumped, and how often each arrived last
(``lateness``, on rank 0's clock), which names a straggler after the fact.

A folder may hold the dumps of several runs (``flight-<run>-rank<r>.json``, [Note: dumps name their
run] in ``collectives/flight.py``; ``flight-rank<r>.json`` of earlier versions, whose run is the id
inside). ``find_runs`` sorts them into runs, newest first (by the time their ranks wrote them);
the doctor reads the newest, or the one ``--run ID`` names, and says which it read and what else is there.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..errors import ConfigurationError, NotFoundError

_COMPARED = ("op", "dtype", "shape", "reduce", "root")


def _read_dump(path: str) -> dict:
    """One rank's dump, checked to have the fields the diagnosis reads, each of the type it reads.

    Raises:
        ConfigurationError: the file cannot be read, is not JSON (a truncated file: the rank died while
            writing it, or the disk was full), is not a flight-recorder dump, or is one of another rank or run
            than its name says; the message names the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigurationError(f"flight dump {path!r} cannot be read: {exc}") from exc
    except ValueError as exc:
        size = os.path.getsize(path)
        raise ConfigurationError(f"flight dump {path!r} ({size} bytes) is not valid JSON ({exc}); it may be truncated "
                                 f"(the rank was killed while writing it, or the disk was full)") from exc
    if (not isinstance(data, dict) or not isinstance(data.get("rank"), int)
            or not isinstance(data.get("records"), list)):
        raise ConfigurationError(f"flight dump {path!r} is not an axonhpc flight-recorder dump (no 'rank' and "
                                 f"'records' fields)")
    rank = data["rank"]
    if not _is_index(rank):
        raise ConfigurationError(f"flight dump {path!r} records rank={rank!r}, not {_is_index.__doc__}")
    named = _NAME.fullmatch(os.path.basename(path))
    if named is not None and int(named.group("rank")) != rank:
        raise ConfigurationError(f"flight dump {path!r} says it is rank {rank!r}'s; its name says rank "
                                 f"{int(named.group('rank'))} (a renamed or copied file?)")
    for key, check in (("time", _is_number), ("clock_offset", _is_number), ("world_size", _is_index),
                       ("run", _is_text)):
        if data.get(key) is not None and not check(data[key]):
            raise ConfigurationError(f"flight dump {path!r} records {key}={data[key]!r}, not {check.__doc__}")
    if named is not None and named.group("run") is not None and data.get("run") != named.group("run"):
        raise ConfigurationError(f"flight dump {path!r} says it is run {data.get('run')!r}'s; its name says run "
                                 f"{named.group('run')!r} (a renamed or copied file?)")
    for k, entry in enumerate(data["records"]):
        problem = _record_problem(entry, rank)
        if problem is not None:
            raise ConfigurationError(f"flight dump {path!r}: record {k} {problem} (a dump of another axonhpc "
                                     f"version, or an edited file)")
    return data


# flight-<run>-rank<r>.json, or flight-rank<r>.json (earlier versions, and a world without a run id)
_NAME = re.compile(r"flight-(?:(?P<run>.+)-)?rank(?P<rank>\d+)\.json")


def _is_index(value: Any) -> bool:
    """an integer >= 0"""
    return type(value) is int and value >= 0


def _is_number(value: Any) -> bool:
    """a number"""
    return type(value) in (int, float)


def _is_text(value: Any) -> bool:
    """a string"""
    return isinstance(value, str)


def _is_shape(value: Any) -> bool:
    """a list of integers >= 0"""
    return isinstance(value, list) and all(_is_index(d) for d in value)


def _is_ranks(value: Any) -> bool:
    """a non-empty list of integers >= 0"""
    return _is_shape(value) and len(value) > 0


def _is_flag(value: Any) -> bool:
    """true or false"""
    return isinstance(value, bool)


def _is_root(value: Any) -> bool:
    """an integer"""
    return type(value) is int


# field -> its check, and whether it may be null (flight.FIELDS, as flight.records writes them)
_FIELDS = {"t": (_is_number, False), "group": (_is_text, False), "ranks": (_is_ranks, False),
           "seq": (_is_index, False), "op": (_is_text, False), "dtype": (_is_text, True), "shape": (_is_shape, True),
           "reduce": (_is_text, True), "root": (_is_root, True), "where": (_is_text, True), "done": (_is_flag, False)}


def _record_problem(entry: Any, rank: int) -> Optional[str]:
    """What is wrong with one record of rank ``rank``'s dump, or None."""
    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}, not an object"
    for key, (check, nullable) in _FIELDS.items():
        if key not in entry:
            return f"has no {key!r} field"
        value = entry[key]
        if not (check(value) or (nullable and value is None)):
            return f"has {key}={value!r}, not {check.__doc__}"
    if rank not in entry["ranks"]:
        return f"is a call of group {entry['group']} {entry['ranks']}, which rank {rank} is not in"
    return None


class Run(NamedTuple):
    """The dumps of one run found in a flight folder."""

    id: Optional[str]  # its run_id (None: dumps of a version that recorded none)
    dumps: Dict[int, dict]  # rank -> its dump
    paths: Dict[int, str]  # rank -> its file
    written: float  # when its newest dump was written (the time the dump records, else the file's)

    @property
    def name(self) -> str:
        """``run 3f2a...``, or what stands for a run of a version that recorded no id."""
        return f"run {self.id}" if self.id is not None else "a run that records no id"

    def describe(self) -> str:
        """``run 3f2a... (ranks [0, 1] of 2, last written 2026-11-28 11:20:03)``."""
        sizes = {d["world_size"] for d in self.dumps.values() if d.get("world_size")}
        of = f" of {sizes.pop()}" if len(sizes) == 1 else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.written))
        return f"{self.name} (ranks {sorted(self.dumps)}{of}, last written {when})"


def _run_key(data: dict) -> Any:
    """What tells the dump's run apart: its id, else (a dump without one) the ranks of its last world call."""
    if data.get("run") is not None:
        return data["run"]
    return next((tuple(e["ranks"]) for e in reversed(data["records"]) if e["group"] == "world"), None)


def _written(data: dict, path: str) -> float:
    """When the dump was written: the time its rank recorded (a copy keeps it), else the file's."""
    if data.get("time"):
        return float(data["time"])
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def find_runs(directory: str, broken: Optional[List[str]] = None) -> List[Run]:
    """Every run with a usable dump in ``directory``, newest first (ties: the latest recorded call first).

    ``broken``: where to put a line for each unusable file (then skipped); None raises instead.

    Raises:
        NotFoundError: the folder does not exist or holds no usable dump.
        ConfigurationError: a dump cannot be used and ``broken`` is None.
    """
    if not os.path.isdir(directory):
        raise NotFoundError(f"flight-recorder folder {directory!r} does not exist (give the job's AXONHPC_FLIGHT_DIR)")
    runs: Dict[Any, Run] = {}
    skipped: List[str] = []
    paths = sorted(os.path.join(directory, name) for name in os.listdir(directory) if _NAME.fullmatch(name))
    for path in paths:
        try:
            data = _read_dump(path)
        except ConfigurationError as exc:
            skipped.append(str(exc))
            continue
        key, rank = _run_key(data), data["rank"]
        run = runs.get(key)
        if run is None:
            run = runs[key] = Run(data.get("run"), {}, {}, 0.0)
        if rank in run.dumps:  # two names for one rank (flight-rank1.json beside flight-rank00001.json)
            skipped.append(f"flight dump {path!r} is a second dump of rank {rank} of {run.name} "
                           f"(beside {run.paths[rank]!r})")
            continue
        run.dumps[rank], run.paths[rank] = data, path
        runs[key] = run._replace(written=max(run.written, _written(data, path)))
    if skipped and broken is None:
        raise ConfigurationError(skipped[0])
    if broken is not None:
        broken.extend(skipped)
    if not runs:
        why = f"none of its {len(paths)} flight dumps can be used" if paths else "no flight dump"
        raise NotFoundError(f"{why} in {directory!r} (flight-<run>-rank<r>.json or flight-rank<r>.json; is "
                            f"AXONHPC_FLIGHT_DIR set to it?)")
    return sorted(runs.values(), key=lambda run: (run.written, max(map(_last_seen, run.dumps.values()))),
                  reverse=True)


def _last_seen(data: dict) -> float:
    """When the dump's rank was last seen: its last call, else when it dumped."""
    return max((e["t"] for e in data["records"]), default=data.get("time") or 0.0)


def pick_run(runs: List[Run], run: Optional[str], directory: str) -> Run:
    """The run ``run`` names (its id, or the start of just one run's id), or the newest of ``runs`` for None.

    Raises:
        NotFoundError: no run's id is or starts with ``run``; the message lists the folder's runs.
        ConfigurationError: the ids of several runs start with ``run``; the message lists them.
    """
    if run is None:
        return runs[0]
    exact = [r for r in runs if r.id == run]
    if exact:
        return exact[0]
    starting = [r for r in runs if r.id is not None and r.id.startswith(run)]
    if len(starting) == 1:
        return starting[0]
    if starting:
        raise ConfigurationError(f"run {run!r} is the start of {len(starting)} runs' ids in {directory!r}: "
                                 + "; ".join(r.describe() for r in starting) + " (give more of the id)")
    raise NotFoundError(f"no run {run!r} in {directory!r}; its runs: " + "; ".join(r.describe() for r in runs))


def load_dumps(directory: str, broken: Optional[List[str]] = None, run: Optional[str] = None) -> Dict[int, dict]:
    """rank -> its dump, of run ``run`` (its id, or the start of it) in ``directory``; None: the newest run.

    ``broken``: where to put a line for each unusable file (then skipped); None raises instead.

    Raises:
        NotFoundError: the folder does not exist, holds no usable dump, or no dump of run ``run``.
        ConfigurationError: a dump cannot be used and ``broken`` is None, or ``run`` starts several runs' ids.
    """
    return pick_run(find_runs(directory, broken), run, directory).dumps


def describe(entry: dict) -> str:
    """``all_reduce float32 (17, 17) op=SUM at train.py:42``."""
    text = entry["op"]
    if entry.get("dtype"):
        text += f" {entry['dtype']} {tuple(entry['shape'])}"
    if entry.get("reduce"):
        text += f" op={entry['reduce']}"
    if entry.get("root") is not None:
        text += f" root={entry['root']}"
    if entry.get("where"):
        text += f" at {entry['where']}"
    return text


def _signature(entry: dict) -> Tuple:
    return tuple(json.dumps(entry.get(k)) for k in _COMPARED)


def diagnose(dumps: Dict[int, dict]) -> List[str]:
    """The report's lines: the first divergence (or that none was seen), then who was still waiting."""
    by_group: Dict[Tuple[str, Tuple[int, ...]], Dict[int, Dict[int, dict]]] = {}
    earliest_seq: Dict[Tuple[str, Tuple[int, ...]], Dict[int, int]] = {}
    for rank, data in dumps.items():
        for entry in data["records"]:
            key = (entry["group"], tuple(entry["ranks"]))
            by_group.setdefault(key, {}).setdefault(rank, {})[entry["seq"]] = entry
            seqs = earliest_seq.setdefault(key, {})
            seqs[rank] = min(seqs.get(rank, entry["seq"]), entry["seq"])
    findings: List[Tuple[float, str]] = []
    for (name, ranks), per_rank in by_group.items():
        present = [r for r in ranks if r in dumps]
        # compare only where every present rank's buffer still covers the call
        start = max(earliest_seq[(name, ranks)].get(r, 0) for r in present)
        last = max(max(calls) for calls in per_rank.values())
        for seq in range(start, last + 1):
            calls = {r: per_rank.get(r, {}).get(seq) for r in present}
            made = {r: e for r, e in calls.items() if e is not None}
            absent = sorted(r for r, e in calls.items() if e is None)
            signatures = {}
            for r, e in made.items():
                signatures.setdefault(_signature(e), []).append(r)
            if len(signatures) > 1:
                parts = [f"ranks {rs} called {describe(made[rs[0]])}" for rs in
                         sorted(signatures.values(), key=len, reverse=True)]
                odd = min(signatures.values(), key=len)
                when = min(e["t"] for e in made.values())
                findings.append((when, f"rank{'s' if len(odd) > 1 else ''} {odd if len(odd) > 1 else odd[0]} "
                                       f"diverged first, at group {name} #{seq}: " + "; ".join(parts)))
                break
            if absent and made:
                first = made[min(made)]
                findings.append((first["t"], f"ranks {absent} never reached group {name} #{seq}, where ranks "
                                             f"{sorted(made)} called {describe(first)}"))
                break
    lines = [text for _, text in sorted(findings)] or ["no divergence in the recorded collectives"]
    for rank, data in sorted(dumps.items()):
        waiting = [e for e in data["records"] if not e.get("done")]
        if waiting:
            e = waiting[-1]
            lines.append(f"rank {rank} was waiting in group {e['group']} #{e['seq']}: {describe(e)} "
                         f"(dumped on {data.get('reason', '?')})")
    expected = set(r for (_, ranks) in by_group for r in ranks)
    for data in dumps.values():
        if data.get("world_size"):
            expected.update(range(data["world_size"]))
    missing = sorted(expected - set(dumps))
    if missing:
        lines.append(f"no dump from ranks {missing} (killed, hung outside Python, or never got there)")
    return lines


def lateness(dumps: Dict[int, dict], margin: float = 0.001) -> List[str]:
    """Per-rank lateness: in how many recorded calls each rank arrived last, later than the next by ``margin`` s.

    Every call all ranks of its group recorded is compared, on rank 0's clock (each dump's ``clock_offset``).
    """
    arrivals: Dict[Tuple[str, Tuple[int, ...], int], Dict[int, float]] = {}
    for rank, data in dumps.items():
        offset = float(data.get("clock_offset") or 0.0)
        for entry in data["records"]:
            key = (entry["group"], tuple(entry["ranks"]), entry["seq"])
            arrivals.setdefault(key, {})[rank] = entry["t"] + offset
    compared, last, late = 0, {}, {}
    for (name, ranks, seq), times in arrivals.items():
        if len(ranks) < 2 or set(times) != set(ranks):
            continue
        compared += 1
        order = sorted(times, key=times.get)
        gap = times[order[-1]] - times[order[-2]]
        if gap > margin:
            last[order[-1]] = last.get(order[-1], 0) + 1
            late.setdefault(order[-1], []).append(gap)
    if not compared:
        return ["no collective recorded by every rank of its group: no lateness to compare"]
    lines = [f"lateness over {compared} collectives recorded by every rank of their group (last by more than "
             f"{margin * 1e3:g} ms):"]
    for rank in sorted(last, key=last.get, reverse=True):
        median = sorted(late[rank])[len(late[rank]) // 2]
        mark = "  <- the straggler" if last[rank] >= 0.8 * compared else ""
        lines.append(f"  rank {rank}: last in {last[rank]} ({last[rank] / compared:.0%}), by a median of "
                     f"{median * 1e3:.2f} ms{mark}")
    if not last:
        lines.append("  no rank was last by more than the margin")
    return lines


def main(directory: str, out: Optional[Any] = None, run: Optional[str] = None) -> int:
    """Print the diagnosis of run ``run`` in ``directory`` (None: the newest run there); 0 when a report was
    made, 2 without usable dumps or without that run.

    An unreadable dump is named on stderr and skipped; the diagnosis uses the others. Other runs in the
    folder are named after the first line.
    """
    import sys

    out = out or sys.stdout
    broken: List[str] = []
    try:
        runs = find_runs(directory, broken)
        chosen = pick_run(runs, run, directory)
    except (NotFoundError, ConfigurationError) as exc:
        for line in broken:
            print(f"axonhpc doctor: skipped {line}", file=sys.stderr)
        print(f"axonhpc doctor: {exc}", file=sys.stderr)
        return 2
    for line in broken:
        print(f"axonhpc doctor: skipped {line}; diagnosing from the other dumps", file=sys.stderr)
    dumps = chosen.dumps
    print(f"flight records of ranks {sorted(dumps)} of {chosen.name} in {directory}:", file=out)
    others = [r for r in runs if r is not chosen]
    if others:
        which = f"the newest of {len(runs)} runs in {directory}" if run is None else \
            f"one of {len(runs)} runs in {directory}"
        print(f"  ({which}; the other{'s' if len(others) > 1 else ''}: "
              + "; ".join(r.describe() for r in others) + "; read another with --run ID)", file=out)
    for line in diagnose(dumps) + lateness(dumps):
        print("  " + line, file=out)
    return 0


__all__ = ["Run", "find_runs", "pick_run", "load_dumps", "diagnose", "lateness", "describe", "main"]
