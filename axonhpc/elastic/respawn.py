"""Replacements: processes started into the job (``MPI_Comm_spawn``) to take the places of lost ranks.

[Note: how a replacement joins]
With ``respawn=True`` the survivors of a recovery that has no spare left start
the missing ranks with ``Comm.Spawn``: the same interpreter and command line
as their own (``sys.orig_argv``), so a replacement runs the user's script from
its start, with the job's environment. The survivors then ``Merge`` the
intercommunicator (they come first, the replacements after, in their order)
and rank 0 sends the replacements what the survivors agreed on: their job
ranks (numbers the job never used), the ranks and width of the run, the steps
done. A replacement finds its parent with ``Comm.Get_parent`` where it builds
its ``ElasticTraining``; from there it takes part in the recovery as a spare
would: it receives the whole state in the same gathering and trains. The
survivors wait in the ``Merge`` until the replacements reach that point, so a
recovery with a replacement costs its start-up (measured in docs/fault-tolerance.md).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional

import numpy as np

_joined: Dict[str, Any] = {}  # this process's facts from the survivors that spawned it (once merged)
_spawned: List[Any] = []  # the intercommunicators to the replacements this process spawned


def _send_text(comm: Any, text: str) -> str:
    """Collective over ``comm``: rank 0's ``text`` on every rank (its length, then its bytes)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8) if comm.Get_rank() == 0 else None
    size = np.array([0 if data is None else data.size], dtype=np.int64)
    comm.Bcast(size, root=0)
    buffer = data.copy() if data is not None else np.empty(int(size[0]), dtype=np.uint8)
    comm.Bcast(buffer, root=0)
    return bytes(buffer).decode("utf-8")


def spawn(MPI: Any, comm: Any, facts: Dict[str, Any], ids: List[int]) -> Any:
    """Collective over the survivors' ``comm``: start ``len(ids)`` replacements; the merged communicator.

    ``facts`` is what every replacement is told (``joined``); ``ids`` are their job ranks, in order.
    """
    inter = comm.Spawn(sys.executable, args=list(sys.orig_argv[1:]), maxprocs=len(ids), root=0)
    merged = inter.Merge(high=False)
    _spawned.append(inter)  # kept, not freed: MPI_Finalize disconnects it with the replacements' parent communicator
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    _send_text(merged, json.dumps({**facts, "ids": ids}))
    return merged


def joined(MPI: Any) -> Optional[Dict[str, Any]]:
    """In a replacement: what the survivors that spawned it agreed on, with ``comm`` (merged) and ``id``.

    None in a process the job started. Collective with the survivors' ``spawn``
    the first time; the same facts after that.
    """
    if not _joined:
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            return None
        merged = parent.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        facts = json.loads(_send_text(merged, ""))
        facts["id"] = facts["ids"][merged.Get_rank() - (merged.Get_size() - len(facts["ids"]))]
        _joined.update(facts, comm=merged)
    return _joined


def is_replacement() -> bool:
    """Whether this process was spawned to replace a lost rank (``ElasticTraining(..., respawn=True)``)."""
    if "mpi4py.MPI" not in sys.modules:
        return False
    MPI = sys.modules["mpi4py.MPI"]
    return bool(_joined) or MPI.Comm.Get_parent() != MPI.COMM_NULL


__all__ = ["spawn", "joined", "is_replacement"]
