"""``python -m axonhpc.bench.pack``: the compiled pack against numpy, in one process.

Interleaved rounds (medians) of two comparisons:

- bandwidth: ``pack`` of ``nbytes`` in ``count`` arrays into a preallocated buffer, against one
  ``numpy.copyto`` of the same bytes (the single-copy ceiling); ours / numpy's, 1.00 = memcpy speed.
- fusion overhead: ``pack`` of many small arrays against ``numpy.concatenate(..., out=)``; numpy's
  time / ours, above 1 pack is cheaper.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..bucketing import pack
from .timing import empty_aligned_like, human_bytes, median_times

# (number of arrays, total bytes) of each bandwidth case: a 25 MB bucket as
# 25 gradients of 1 MB, as one gradient, and as 1000 gradients of 25 KB.
DEFAULT_BANDWIDTH_CASES: Tuple[Tuple[int, int], ...] = ((25, 25_000_000), (1, 25_000_000), (1000, 25_000_000))
# (number of arrays, bytes per array) of each fusion case.
DEFAULT_SMALL_CASES: Tuple[Tuple[int, int], ...] = ((100, 1024), (1000, 1024))


def _arrays(count: int, total_bytes: int) -> List[np.ndarray]:
    per = max(1, total_bytes // count // 4)
    rng = np.random.default_rng(0)
    return [rng.standard_normal(per, dtype=np.float32) for _ in range(count)]


REPEATS = 15  # interleaved rounds of each case; the table gives their medians


def run(bandwidth_cases: Optional[Sequence[Tuple[int, int]]] = None,
        small_cases: Optional[Sequence[Tuple[int, int]]] = None,
        repeats: int = REPEATS) -> List[Dict[str, object]]:
    """Time pack against its numpy baselines.

    Args:
        bandwidth_cases: ``(count, total_bytes)`` pairs compared with ``copyto`` (None: the defaults).
        small_cases: ``(count, bytes_each)`` pairs compared with ``concatenate`` (None: the defaults).

    Returns:
        One dict per case: ``case``, ``count``, ``nbytes``, ``baseline``, ``ours_s`` and ``baseline_s``
        (median seconds per call), ``ours_gbps``, ``baseline_gbps``, and ``ratio`` (baseline time over ours).
    """
    rows: List[Dict[str, object]] = []

    def row(case, arrays, baseline, fn_ours, fn_base, iters):
        nbytes = sum(a.nbytes for a in arrays)
        t = median_times({"ours": fn_ours, "base": fn_base}, iters=iters, rounds=repeats)
        rows.append({
            "case": case, "count": len(arrays), "nbytes": nbytes, "baseline": baseline,
            "ours_s": t["ours"], "baseline_s": t["base"],
            "ours_gbps": nbytes / t["ours"] / 1e9, "baseline_gbps": nbytes / t["base"] / 1e9,
            "ratio": t["base"] / t["ours"],
        })

    for count, total in DEFAULT_BANDWIDTH_CASES if bandwidth_cases is None else bandwidth_cases:
        arrays = _arrays(count, total)
        out = np.empty(sum(a.size for a in arrays), dtype=np.float32)
        src = np.concatenate(arrays)
        dst = empty_aligned_like(src)
        row(f"{count} x {total // count:,} B", arrays, "numpy.copyto (one array)",
            lambda: pack(arrays, out=out), lambda: np.copyto(dst, src), iters=5)
    for count, each in DEFAULT_SMALL_CASES if small_cases is None else small_cases:
        arrays = _arrays(count, count * each)
        out = np.empty(sum(a.size for a in arrays), dtype=np.float32)
        row(f"{count} x {human_bytes(each)}", arrays, "numpy.concatenate(out=)",
            lambda: pack(arrays, out=out), lambda: np.concatenate(arrays, out=out), iters=200)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table of ``run()`` (``axonhpc bench pack``; no options but ``--help``); returns 0."""
    import argparse

    argparse.ArgumentParser(prog="axonhpc bench pack",
                            description="The compiled pack against numpy.copyto / numpy.concatenate, in this one "
                                        "process (no MPI needed); prints one row per case.").parse_args(
        [] if argv is None else list(argv))
    print(f"# pack against its baseline in this process, medians of {REPEATS} interleaved rounds "
          f"(base/pack = baseline time / pack time, above 1 pack is faster)")
    print(f"{'case':>20} {'MB':>10} {'pack':>10} {'baseline':>10} {'pack GB/s':>10} "
          f"{'base GB/s':>10} {'base/pack':>10}  baseline")
    for r in run():
        print(f"{r['case']:>20} {r['nbytes'] / 1e6:10.3f} {r['ours_s'] * 1e6:8.1f}us "
              f"{r['baseline_s'] * 1e6:8.1f}us {r['ours_gbps']:10.2f} {r['baseline_gbps']:10.2f} "
              f"{r['ratio']:10.2f}  {r['baseline']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
