"""A fault-tolerant job's exit status, from the records its ranks leave ([Note: the job's exit status under
--fault-tolerant] in launched.py, which writes them).

Each record is a file ``rank<r>`` in the folder ``axonhpc launch`` names in ``AXONHPC_LAUNCH_STATUS_DIR``: one
line, ``<status> <ranks survived, comma-separated> [peer]``. ``r`` is the job rank: ``0 .. n-1`` for the
processes mpiexec started, the number a replacement was given (``n`` and up) for one spawned later
(``axonhpc.elastic``'s ``respawn=True``). A rank of the job that can see the folder (it runs on the launcher's
host) first leaves ``start<r>``, empty: only those ranks are expected to leave a record. Imports nothing of
axonhpc's: the launcher reads the records without loading numpy.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Set, Tuple

# Seconds a fault-tolerant job may take to end once every rank of it is accounted for (``all_accounted``). Under
# ULFM a rank that ended (os._exit) while the others were in MPI_Finalize left them there for ever, in the
# agreement of its shrink; a replacement spawned by a recovery sometimes waits there for good too, in its
# disconnect from the job (ompi_dpm_dyn_finalize). Normally the job ends within a second.
FINISH_GRACE = 10.0

OWN = " (its own error, not a peer's failure)"

_NAME = re.compile(r"(rank|start)(\d+)\Z")

Record = Tuple[int, Set[int], bool]  # status, the job ranks whose loss it survived, whether a peer's failure


class Records(dict):
    """The records read from a folder, by job rank (a ``Dict[int, Record]``), and ``started``: the ranks of the job
    known to run on the launcher's host (they said so as they started)."""

    def __init__(self, records: Dict[int, Record], started: Set[int]):
        super().__init__(records)
        self.started = started


def read_records(folder: str) -> Records:
    """Every complete record in ``folder``, by job rank (a record being written, ``rank<r>.tmp``, is skipped),
    with the ranks that started where they could write one."""
    records: Dict[int, Record] = {}
    started: Set[int] = set()
    try:
        names = os.listdir(folder)
    except OSError:
        return Records(records, started)
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        if match.group(1) == "start":
            started.add(int(match.group(2)))
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                status, survived, peer = (f.read().rstrip("\n").split(" ") + ["", ""])[:3]
            records[int(match.group(2))] = (int(status), {int(r) for r in survived.split(",") if r}, peer == "peer")
        except (OSError, ValueError):
            continue
    return Records(records, started)


def survived(records: Dict[int, Record]) -> Set[int]:
    """The job ranks some process recovered from the loss of."""
    return set().union(*(s for _, s, _ in records.values()))


def all_accounted(records: Dict[int, Record], n: int) -> bool:
    """Whether each of the job's ``n`` ranks has left its script (a record) or was lost and recovered from.

    A replacement still running is not waited for: it belongs to the survivors' training, which they have left.
    A rank on another host leaves no record here, so a job across hosts is never found finished this way.
    """
    lost = survived(records)
    return all(r in records or r in lost for r in range(n))


def verdict(records: Records, n: int) -> Tuple[int, str]:
    """The job's exit status from its ranks' ``records``, and why: the first non-zero status a rank (a replacement
    included) exited with, its own failure before a survivor's ``PeerFailedError``; else 1 if one of the ``n``
    ranks that started on this host left no record (it was killed, or ended inside MPI) and no survivor
    recovered from its loss; else ``(0, "")``. Ranks on other hosts are not judged here."""
    for rank, (status, _, peer) in sorted(records.items(), key=lambda item: (item[1][2], item[0])):
        if status != 0:
            what = f"rank {rank} of the job" if rank < n else f"replacement rank {rank}"
            return status, f"{what} exited with status {status}" + ("" if peer else OWN)
    lost = survived(records)
    vanished = [r for r in range(n) if r in records.started and r not in records and r not in lost]
    if vanished:
        return 1, (f"rank{'s' if len(vanished) > 1 else ''} {', '.join(map(str, vanished))} of the job ended without "
                   f"exiting (killed by a signal?) and no survivor recovered from the loss (axonhpc.elastic)")
    return 0, ""


__all__ = ["FINISH_GRACE", "OWN", "Record", "Records", "read_records", "survived", "all_accounted", "verdict"]
