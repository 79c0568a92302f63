"""Collectives inside a CUDA graph: which can be captured, and the ranks' check before each replay.

[Note: collectives in a graph]
An NCCL collective on a device array is a kernel on a stream, so a capture records it and each
launch runs it again (NCCL >= 2.9.6). A replay carries no agreement check of its own, and NCCL
pairs one rank's captured all-reduce with whatever the others issue next, so:

- **What is captured.** In a capture (on a group of more than one rank), ``admit`` refuses with
  ``GraphCaptureError`` every call a graph could not repeat: host arrays (MPI is host-driven: the
  call would run once, at capture), device arrays over staged or CUDA-aware MPI, the deterministic
  ring, the point-to-point algorithms, gather, scatter and barriers. Otherwise it notes the call's
  descriptor; the agreement check runs once, at capture.
- **Each replay is compared.** Before every launch ``check_replay`` makes one agreement step per
  group of the graph (in the capture's order) with a descriptor of everything it sends there (the
  count of calls and a 64-bit hash of their descriptors). A rank that replays while another calls
  eagerly, or replays another graph, raises ``CollectiveMismatchError`` on every rank instead of
  NCCL mixing the calls. The step runs on the host while the previous replay may still run on the GPU.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._dtypes import is_cupy_array
from .._ext import _shm
from ..cuda import capture
from ..errors import CollectiveMismatchError, GraphCaptureError
from . import agreement, fingerprint, flight

REPLAY = "graph_replay"


def admit(pg: Any, op: str, x: Any = None, reduce: Optional[str] = None, root: Optional[int] = None,
          why_not: Optional[str] = None) -> None:
    """In a capture: refuse a call a graph cannot repeat, else note it (see the note). Before anything is sent.

    Args:
        reduce: the ReduceOp's name; root: the root's group rank.
        why_not: why this call's route cannot be captured, when it cannot (the deterministic ring, a
            point-to-point algorithm, a barrier); array-level reasons come first.

    Raises:
        GraphCaptureError: naming the call, the group and the reason.
    """
    if pg.size == 1 or not (capture.EVER_RECORDED and capture.capturing()):  # every collective passes here
        return
    if x is not None and not is_cupy_array(x):
        why_not = ("its array is in host memory: MPI carries it, driven by the host, so it would run once at "
                   "the capture and never again; keep communication of host arrays out of the graphed step")
    elif x is not None and not pg.backend.captures(x):
        why_not = (f"the group's backend ({pg.backend.name}) moves device arrays with host calls (MPI, staged "
                   "or CUDA-aware); only NCCL issues a collective on a stream, where a graph can hold it")
    if why_not is not None:
        raise GraphCaptureError(f"{op} on group {pg.name} {list(pg.ranks)} cannot be captured in a CUDA graph: "
                                f"{why_not}")
    capture.note_collective(pg, agreement.describe(op, x, reduce, root),
                             fingerprint.describe_call(op, x, reduce, root))


class ReplayCheck:
    """One group's check before each replay: its descriptors (both forms) and how messages name it."""

    __slots__ = ("pg", "descs", "texts", "call")

    def __init__(self, pg: Any, descs: List[Tuple[int, ...]], texts: List[str]) -> None:
        self.pg, self.texts = pg, texts
        self.descs = {elsewhere: replay_descriptor(descs, elsewhere) for elsewhere in (False, True)}
        self.call = f"{REPLAY} of {len(descs)} collectives #{self.descs[False][3] & 0xFFFFFFFF:08x}"

    def run(self) -> None:
        """Compare this replay across the group (collective); raise on every rank on a difference."""
        pg = self.pg
        seq = pg.seq
        entry = flight.record(pg, REPLAY, None, None, None, None)
        pg.seq += 1
        agreement.compare(pg, seq, REPLAY, self.descs.__getitem__, lambda: self._mismatch(seq))
        if entry is not None:
            entry[flight.DONE] = True  # issued on the stream, as a device collective's record is once waited

    def _mismatch(self, seq: int) -> None:
        fingerprint.check(self.pg, self.call, seq=seq)  # names every rank's call, and raises, when they differ
        raise CollectiveMismatchError(
            f"collective mismatch on group {self.pg.name}: every rank replayed a CUDA graph of {len(self.texts)} "
            f"collectives ({', '.join(self.texts)}), but not in the same way: some ranks checked it through the "
            f"node's shared memory and others through MPI (the AXONHPC_SHM_* settings differ)")


def replay_descriptor(descs: List[Tuple[int, ...]], elsewhere: bool) -> agreement.Desc:
    """The descriptor of one replay on a group: the count of its calls and a 64-bit hash of theirs."""
    words = np.asarray(descs, dtype=np.int64).tobytes()
    digest = int.from_bytes(hashlib.blake2b(words, digest_size=8).digest(), "little")
    # A leading 0 keeps the product of the "dimensions" (which describe() counts in int64) at 0.
    return _shm.describe("graph", None, (0, len(descs), digest >> 32, digest & 0xFFFFFFFF), None, -1, False,
                         elsewhere)


def replay_checks(record: capture.Recording) -> List[ReplayCheck]:
    """The checks to run before each launch of a captured graph: one per group it holds, in first-use order."""
    groups: Dict[int, Tuple[Any, List[Tuple[int, ...]], List[str]]] = {}
    for pg, desc, text in record.collectives:
        _, descs, texts = groups.setdefault(id(pg), (pg, [], []))
        descs.append(desc)
        texts.append(text)
    return [ReplayCheck(pg, descs, texts) for pg, descs, texts in groups.values()]


def check_replay(checks: List[ReplayCheck]) -> None:
    """Before a launch: run ``replay_checks``' checks (see the note).

    Raises:
        CollectiveMismatchError: on every rank of a group, if any rank of it did not replay the same collectives.
        CollectiveTimeoutError: a rank did not come within the group's timeout.
    """
    for check in checks:
        check.run()


__all__ = ["admit", "replay_checks", "check_replay", "ReplayCheck", "replay_descriptor", "REPLAY"]
