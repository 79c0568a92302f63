"""``axonhpc bench ddp`` launches its own 1- and 2-rank jobs and prints a parsable table.

It spawns mpiexec itself, so it belongs to the serial suite (never run it
under mpiexec). No wall-clock assertions: only that every row and column is
there and consistent.
"""
import os
import re
import subprocess
import sys

import pytest

from axonhpc.bench import ddp as bench_ddp
from support.paths import ROOT

ROW = re.compile(r"^(?P<label>.+?)\s+(?P<t1>\d+\.\d+)\s+(?P<t2>\d+\.\d+)\s+(?P<eff>\d+\.\d)%\s+(?P<vs>\d+\.\d)%$")


def test_parse_sizes():
    assert bench_ddp.parse_sizes("512,1024,1024,10") == [512, 1024, 1024, 10]
    assert bench_ddp.parameter_count([512, 1024, 1024, 10]) == 1_585_162
    for bad in ("8", "8,x", "8,0,4"):
        with pytest.raises(ValueError, match="--sizes"):
            bench_ddp.parse_sizes(bad)


def test_step_schedule_rotates_and_counts():
    chunks = bench_ddp._step_schedule(("a", "b", "c"), 25)
    assert [name for name, _ in chunks[:6]] == ["a", "b", "c", "b", "c", "a"]
    for name in "abc":
        assert sum(n for c, n in chunks if c == name) == 25


@pytest.mark.skipif(bench_ddp.find_mpiexec() is None, reason="no mpiexec")
@pytest.mark.timeout(300)
def test_driver_prints_table():
    cmd = [sys.executable, "-m", "axonhpc", "bench", "ddp", "--sizes", "8,16,4", "--batch", "8", "--steps", "3",
           "--warmup", "1", "--repeats", "1", "--no-torch", "--timeout", "120"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert lines[header].split()[-4:] == ["ms", "efficiency", "vs", "compute"]
    rows = {}
    for line in lines[header + 1:]:
        if line.startswith("#"):
            continue
        m = ROW.match(line)
        assert m, f"unparsable row: {line!r}"
        rows[m["label"]] = m
    assert list(rows) == ["axonhpc compute (no DDP)", "axonhpc DDP OVERLAPPED", "axonhpc DDP SYNCHRONOUS"]
    for m in rows.values():
        t1, t2 = float(m["t1"]), float(m["t2"])
        assert t1 > 0 and t2 > 0
        # the times are printed to 0.01 ms, so allow for their rounding
        low, high = 100 * (t1 - 0.005) / (t2 + 0.005), 100 * (t1 + 0.005) / (t2 - 0.005)
        assert low - 0.05 <= float(m["eff"]) <= high + 0.05
    overlap = [line for line in lines if line.startswith("# 2 ranks: OVERLAPPED")]
    assert len(overlap) == 1 and "buckets done before it" in overlap[0]
    # One process as users start it (no thread variables): ax.init gives it the usable cores.
    users = [line for line in lines if line.startswith("# one process as `axonhpc launch -n 1` runs it")]
    assert len(users) == 1, lines
    threads = len(os.sched_getaffinity(0))
    assert f"({threads} BLAS thread{'s' if threads != 1 else ''})" in users[0], users[0]
    m = re.search(r"plain model ([0-9.]+) ms/step; .* ([0-9.]+)% of its step rate per rank, ([0-9.]+)x", users[0])
    assert m and float(m[1]) > 0 and abs(2 * float(m[2]) / 100 - float(m[3])) <= 0.011, users[0]


@pytest.mark.skipif(bench_ddp.find_mpiexec() is None, reason="no mpiexec")
@pytest.mark.timeout(300)
def test_shared_memory_ab_script_prints_both_sides():
    """benchmarks/ddp_shm_ab.py: a DDP built with shared memory and one built without, in one 2-rank job."""
    import os

    script = os.path.join(ROOT, "benchmarks", "ddp_shm_ab.py")
    cmd = ["timeout", "-k", "5", "240", bench_ddp.find_mpiexec(), "-n", "2", sys.executable, script,
           "--sizes", "8,16,4", "--batch", "8", "--steps", "2", "--rounds", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"compute", "MPI", "shared"}, out.stdout
    for name in ("MPI", "shared"):
        step, backward, sync, share = rows[name][-4:]
        assert float(step) > 0 and float(backward) > 0 and float(sync) >= 0 and share.endswith("%")
