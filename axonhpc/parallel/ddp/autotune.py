"""DDP's bucket size, measured on this machine and world size at start-up.

[Note: choosing the bucket size]
A bucket must be large enough that its all-reduce runs near the bandwidth
the machine reaches for large messages (small messages pay a fixed latency
each), and no larger: the first bucket's reduction can start only when all
its gradients are ready, so a larger bucket starts later and overlaps less
of backward. ``measure_bucket_bytes`` times the all-reduce of candidate sizes
(256 KiB to 64 MiB, in steps of 4x, none larger than the model's gradients),
takes the time of each as the maximum over the ranks (so every rank decides
on the same numbers), and picks the smallest candidate whose bandwidth is at
least ``GOOD_ENOUGH`` of the best one's. It stops adding larger candidates
once the measurements have used ``budget_s`` seconds.

DDP does this when it is built with ``bucket_size_mb=None`` and
``ax.settings.bucket_size_mb`` is "auto" (the default), on an MPI group of
more than one rank; the first DDP of a group measures and later ones reuse
the result (kept on the group). The choice and the table are logged on
rank 0. ``AXONHPC_BUCKET_SIZE_MB=25`` (any number) fixes the size instead,
and so does ``ax.settings.deterministic``: the measured choice can differ
between runs, and with it which gradients are reduced together. Threads as
ranks (``run_local``) and one-rank groups use 25 MB.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Dict, List, Tuple

import numpy as np

from ...backends import ReduceOp
from ...backends.mpi import MPIBackend
from ...collectives import all_reduce
from ...collectives.shm_path import free_shared_memory_array, shared_memory_array
from ...errors import SharedMemoryError
from ...observe.log import get_logger
from ...settings import settings

CANDIDATES = tuple(256 << 10 << (2 * k) for k in range(5))  # 256 KiB, 1, 4, 16, 64 MiB
GOOD_ENOUGH = 0.8
DEFAULT_BUCKET_MB = 25.0
# group -> {dtype str: bucket bytes}: measured once per group and dtype, forgotten with the group.
_MEASURED: "weakref.WeakKeyDictionary[Any, Dict[str, int]]" = weakref.WeakKeyDictionary()


def measured(group: Any) -> Dict[str, int]:
    """The bucket sizes measured on ``group`` so far, by dtype (``np.dtype.str``)."""
    return dict(_MEASURED.get(group, {}))


def measure_bucket_bytes(group: Any, dtype: Any, model_bytes: int,
                         budget_s: float = 1.0) -> Tuple[int, List[Dict[str, float]]]:
    """Collective: the bucket size in bytes for ``group``, and the measured table (see the module note).

    Args:
        group: the DDP group (every member calls).
        dtype: the gradients' dtype.
        model_bytes: bytes of all the gradients (no candidate is larger than needed).
        budget_s: seconds after which no larger candidate is measured.

    Returns:
        ``(bytes, rows)``; each row has ``bytes``, ``seconds`` (max over ranks) and ``gbs``.
    """
    dtype = np.dtype(dtype)
    sizes = [s for s in CANDIDATES if s <= max(model_bytes, CANDIDATES[0])]
    rows: List[Dict[str, float]] = []
    started = time.perf_counter()
    # The buffer DDP's buckets will be: in the node's shared window where it can (collective). A /dev/shm
    # too small for it (a container's 64 MiB) is refused on every rank alike: all measure in private memory.
    try:
        buffer = shared_memory_array(max(sizes) // dtype.itemsize, dtype, group)
    except SharedMemoryError as exc:
        get_logger("ddp").warning(f"measuring the bucket size in private memory: {exc}")
        buffer = np.zeros(max(sizes) // dtype.itemsize, dtype=dtype)
    for nbytes in sizes:
        x = buffer[:max(nbytes // dtype.itemsize, 1)]
        x[...] = 1
        all_reduce(x, ReduceOp.AVG, group)  # warm-up: first touch, window set-up
        reps = 3 if nbytes >= (16 << 20) else 10
        begin = time.perf_counter()
        for _ in range(reps):
            all_reduce(x, ReduceOp.AVG, group)
        mine = np.array([(time.perf_counter() - begin) / reps, time.perf_counter() - started])
        all_reduce(mine, ReduceOp.MAX, group)  # the same numbers on every rank
        rows.append({"bytes": float(nbytes), "seconds": float(mine[0]), "gbs": nbytes / float(mine[0]) / 1e9})
        if mine[1] > budget_s:
            break
    free_shared_memory_array(buffer, group)
    best = max(row["gbs"] for row in rows)
    chosen = next(int(row["bytes"]) for row in rows if row["gbs"] >= GOOD_ENOUGH * best)
    return chosen, rows


def bucket_bytes(group: Any, dtype: Any, model_bytes: int, requested_mb: Any) -> int:
    """Collective when it measures: DDP's bucket cap in bytes for ``bucket_size_mb=requested_mb``."""
    if requested_mb is None:
        requested_mb = settings.bucket_size_mb
    if requested_mb != "auto":
        return int(float(requested_mb) * (1 << 20))
    measurable = group.size > 1 and isinstance(group.backend.host_side(), MPIBackend)  # real transfers to time
    if not measurable or settings.deterministic:
        return int(DEFAULT_BUCKET_MB * (1 << 20))
    cache = _MEASURED.setdefault(group, {})
    key = np.dtype(dtype).str
    if key not in cache:
        chosen, rows = measure_bucket_bytes(group, dtype, model_bytes)
        cache[key] = chosen
        table = ", ".join(f"{row['bytes'] / 2**20:g} MiB {row['gbs']:.2f} GB/s" for row in rows)
        get_logger("ddp").info(f"bucket size {chosen / 2**20:g} MiB measured on {group.size} ranks of group "
                               f"{group.name} ({table}; the smallest within {GOOD_ENOUGH:.0%} of the best)")
    return cache[key]


__all__ = ["measure_bucket_bytes", "bucket_bytes", "measured", "CANDIDATES", "GOOD_ENOUGH", "DEFAULT_BUCKET_MB"]
