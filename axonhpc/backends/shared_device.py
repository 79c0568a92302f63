"""One GPU per NCCL rank: find the ranks that share a device, on every rank, before NCCL starts.

[Note: why compare devices before ncclCommInitRank]
NCCL refuses two ranks on one GPU ("Duplicate GPU detected") inside ``ncclCommInitRank``, where a
rank that fails has joined nothing and its peers may wait forever. ``devices.check_one_device_per_rank``
catches the usual case from counts, but not two ranks whose ``CUDA_VISIBLE_DEVICES`` name one GPU by
different indexes. So every rank first sends its device's host name and PCI bus id (how NCCL tells
devices apart) over the host backend, and all raise the same error. A device that cannot be
identified is left out, and NCCL decides.
"""
from __future__ import annotations

import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import BackendUnavailableError, InvalidArgumentError

IDENTITY_BYTES = 512  # room for a host name (at most 255 bytes) and a label
SHARED_DEVICE_HINT = ("NCCL needs one GPU per rank and refuses a shared one (NCCL_ERROR_INVALID_USAGE): start one "
                      "rank per GPU (e.g. axonhpc launch -n <number of GPUs>, or the slurm gpu template), or move "
                      "device arrays over MPI instead: ax.init(backend='mpi') stages them through pinned host memory")


def device_identity(cupy_module: Any, hostname: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """(key, label) of the calling thread's current CUDA device; None when it cannot be identified.

    The key is what NCCL compares (host name and PCI bus id); the label adds the local device index.
    """
    try:
        runtime = cupy_module.cuda.runtime
        index = int(runtime.getDevice())
        bus = str(runtime.deviceGetPCIBusId(index))
    except Exception:  # noqa: BLE001 - unknown: left out of the comparison (see the note)
        return None
    host = hostname or socket.gethostname()
    return f"{host}/{bus.lower()}", f"cuda:{index}, PCI {bus}, on {host}"


def encode_identity(identity: Optional[Tuple[str, str]]) -> bytes:
    """``IDENTITY_BYTES`` bytes carrying ``identity`` (all zero for None); the label is cut to fit."""
    if identity is None:
        return bytes(IDENTITY_BYTES)
    key, label = (part.replace("\t", " ").encode() for part in identity)
    if len(key) + 1 > IDENTITY_BYTES:
        raise InvalidArgumentError(f"a device key of {len(key)} bytes does not fit in {IDENTITY_BYTES}")
    raw = (key + b"\t" + label)[:IDENTITY_BYTES]
    return raw.ljust(IDENTITY_BYTES, b"\0")


def decode_identity(raw: bytes) -> Optional[Tuple[str, str]]:
    """The inverse of ``encode_identity``."""
    text = bytes(raw).rstrip(b"\0").decode(errors="replace")
    if not text:
        return None
    key, _, label = text.partition("\t")
    return key, label


def shared_devices(identities: Sequence[Optional[Tuple[str, str]]],
                   global_ranks: Sequence[int]) -> List[Tuple[str, List[int]]]:
    """(label, world ranks) for each device that more than one rank of the group uses, in rank order."""
    by_key: Dict[str, Tuple[str, List[int]]] = {}
    for identity, rank in zip(identities, global_ranks):
        if identity is not None:
            by_key.setdefault(identity[0], (identity[1], []))[1].append(rank)
    return [(label, ranks) for label, ranks in by_key.values() if len(ranks) > 1]


def agree_distinct_devices(identity: Optional[Tuple[str, str]], gather: Callable[[bytes], Sequence[bytes]],
                           global_ranks: Sequence[int]) -> None:
    """Collective: raise on every rank when ranks of the group share a GPU.

    Args:
        identity: this rank's device (``device_identity``), or None when unknown.
        gather: collective; takes this rank's ``IDENTITY_BYTES`` bytes and returns every rank's.

    Raises:
        BackendUnavailableError: naming the ranks and the device they share.
    """
    identities = [decode_identity(raw) for raw in gather(encode_identity(identity))]
    shared = shared_devices(identities, global_ranks)
    if shared:
        which = "; ".join(f"ranks {ranks} share one GPU ({label})" for label, ranks in shared)
        raise BackendUnavailableError(f"NCCL cannot start: {which}. {SHARED_DEVICE_HINT}")


__all__ = ["IDENTITY_BYTES", "SHARED_DEVICE_HINT", "device_identity", "encode_identity", "decode_identity",
           "shared_devices", "agree_distinct_devices"]
