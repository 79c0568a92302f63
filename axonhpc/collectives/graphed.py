"""Collectives inside a CUDA graph: which can be captured, and the ranks' check before each replay.

[Note: collectives in a graph]
A collective on a device array over NCCL is a kernel on a stream, so a
stream capture records it like any other, and each launch of the graph
runs it again (NCCL >= 2.9.6). Every rank must then launch the same graph
at the same point: a replay carries no agreement check of its own, and
NCCL pairs one rank's captured all-reduce with whatever the other ranks
issue next.

- **What is captured.** ``admit`` is called by each collective, after its
  arguments are checked and before anything is sent. Outside a capture, or
  on a group of one rank (nothing is sent), it does nothing. In a capture
  it refuses, with ``GraphCaptureError``, every call a graph could not
  repeat: host arrays (MPI is driven by the host: the call would run once,
  at the capture), device arrays over a backend that is not NCCL (staged or
  CUDA-aware MPI), the deterministic ring and the point-to-point
  algorithms, gather, scatter and barriers. Otherwise it notes the call's
  descriptor in the recording, and the call goes on as usual: its
  agreement check runs on the host, once, at the capture, and NCCL records
  the transfer.
- **Each replay is compared.** Before every launch, ``check_replay`` makes
  one agreement step per group the graph holds, in the order the capture
  first used them, with a descriptor of everything the graph sends on that
  group (kind "graph": the count of calls and a 64-bit hash of their
  descriptors). It takes a sequence number and a flight record
  ("graph_replay"), as a collective does. So a rank that replays while
  another calls a collective eagerly, or replays a graph of other
  collectives, raises ``CollectiveMismatchError`` on every rank, as an
  eager mismatch does, instead of NCCL mixing the two calls. Its cost is
  that of one agreement check per group (on one node a step through the
  shared-memory engine; across nodes a 64-byte MPI all-reduce), on the
  host, while the previous replay may still run on the GPU.
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
        pg: the (checked) group; x: the caller's array; reduce: the ReduceOp's name; root: the root's group rank.
        why_not: why the route this call takes cannot be captured, when it cannot (the deterministic
            ring, a point-to-point algorithm, a barrier); array-level reasons come first.

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
