"""Timing helpers shared by the benchmarks: interleaved rounds, medians, BLAS pinned."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import numpy as np


def pin_blas_threads(n: int = 1):
    """Limit BLAS/OpenMP pools to ``n`` threads (threadpoolctl when installed).

    Returns:
        The threadpoolctl limiter (keep a reference), or None without it.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=n)


def median_times(candidates: Dict[str, Callable[[], None]], iters: int, rounds: int,
                 sync: Optional[Callable[[float], float]] = None) -> Dict[str, float]:
    """Median seconds per call of each candidate over interleaved rounds.

    The order rotates each round (A B C, B C A, ...): a noisy neighbour slows all alike, and no candidate
    always inherits the caches another warmed or flushed. ``sync(elapsed)`` turns one rank's elapsed
    time into the job's (e.g. the maximum over ranks, after a barrier).
    """
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            fn = candidates[name]
            if sync is not None:
                sync(0.0)
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = (time.perf_counter() - start) / iters
            samples[name].append(sync(elapsed) if sync is not None else elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def empty_aligned_like(x: np.ndarray) -> np.ndarray:
    """An empty array like ``x`` whose data lies at the same distance from a 64-byte boundary as ``x``'s.

    A copy bound measured with ``numpy.copyto`` into it is the ceiling it claims to be: glibc's copy of a
    few KiB or more runs 15-20x slower on AMD CPUs when the destination is 1-31 bytes ahead of the
    source modulo 64 (cython_src/byte_copy.h), and ``numpy.empty_like`` lands there half the time.
    """
    raw = np.empty(x.nbytes + 64, dtype=np.uint8)
    start = (x.ctypes.data - raw.ctypes.data) % 64
    return raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
