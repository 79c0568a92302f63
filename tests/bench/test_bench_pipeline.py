"""``axonhpc bench pipeline`` launches its own job and prints a parsable table.

It spawns mpiexec itself, so it belongs to the serial suite (never run it
under mpiexec). No wall-clock assertions: only that every row is there and
consistent with the formula column.
"""
import re
import subprocess
import sys

import pytest

from axonhpc.bench import pipeline as bench_pipeline
from axonhpc.mpiexec import find_mpiexec

ROW = re.compile(r"^(?P<schedule>GPipe|1F1B|interleaved)\s+(?P<ranks>\d+)\s+(?P<m>\d+)\s+(?P<v>\d+)\s+"
                 r"(?P<ms>\d+\.\d{3})\s+(?P<bubble>\d+\.\d{3})\s+(?P<formula>\d+\.\d{3})\s+"
                 r"(?P<ratio>\d+\.\d{2})\s+(?P<speedup>\d+\.\d{2})$")
BASELINES = re.compile(r"^# (?P<ranks>\d+) ranks: raw mpi4py GPipe (?P<raw>\d+\.\d{3}) ms, one rank "
                       r"(?P<one>\d+\.\d{3}) ms$")


def test_formula_and_configurations():
    assert bench_pipeline.bubble_formula(4, 8) == pytest.approx(3 / 11)
    assert bench_pipeline.bubble_formula(4, 8, v=2) == pytest.approx(3 / 19)
    assert bench_pipeline.configurations(4, 8, 2) == [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
    assert bench_pipeline.configurations(3, 8, 2) == [("gpipe", 1), ("1f1b", 1)]  # m % p != 0
    assert bench_pipeline.configurations(2, 8, 1) == [("gpipe", 1), ("1f1b", 1)]  # one block: no chunks
    assert bench_pipeline.parse_ranks("2,4") == [2, 4]
    for bad in ("1", "x", ""):
        with pytest.raises(ValueError, match="--ranks"):
            bench_pipeline.parse_ranks(bad)


def test_cli_lists_it():
    from axonhpc.cli import BENCHMARKS

    assert BENCHMARKS["pipeline"] == "axonhpc.bench.pipeline"


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec")
@pytest.mark.timeout(300)
def test_driver_prints_table():
    cmd = [sys.executable, "-m", "axonhpc", "bench", "pipeline", "--ranks", "2", "--width", "8", "--batch", "8",
           "--microbatches", "4", "--steps", "2", "--warmup", "1", "--timeout", "200"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("schedule"))
    assert lines[header].split() == list(bench_pipeline.COLUMNS)
    rows = []
    for line in lines[header + 1:]:
        m = ROW.match(line)
        assert m, f"unparsable row: {line!r}"
        rows.append(m)
    assert [(r["schedule"], r["v"]) for r in rows] == [("GPipe", "1"), ("1F1B", "1"), ("interleaved", "2")]
    (base,) = [BASELINES.match(line) for line in lines if BASELINES.match(line)]
    raw, one = float(base["raw"]), float(base["one"])
    assert base["ranks"] == "2" and raw > 0 and one > 0
    for r in rows:
        assert r["ranks"] == "2" and r["m"] == "4"
        # the ratios are the row's time against the same job's baselines (to the printed rounding)
        assert float(r["ratio"]) == pytest.approx(float(r["ms"]) / raw, rel=0.01, abs=0.006)
        assert float(r["speedup"]) == pytest.approx(one / float(r["ms"]), rel=0.01, abs=0.006)
        assert float(r["ms"]) > 0 and 0 <= float(r["bubble"]) < 1
        v = int(r["v"])
        assert float(r["formula"]) == pytest.approx(bench_pipeline.bubble_formula(2, 4, v), abs=5e-4)
