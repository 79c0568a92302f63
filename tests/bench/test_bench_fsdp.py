"""``axonhpc bench fsdp`` launches its own 2-rank job and prints a parsable table (no timing assertions)."""
import re
import subprocess
import sys

import pytest

from axonhpc.bench import fsdp as bench_fsdp
from axonhpc.mpiexec import find_mpiexec

ROW = re.compile(r"^\s*(?P<ranks>\d+) (?P<config>\w+)\s+(?P<ms>\d+\.\d+)\s+(?P<vs>\d+\.\d+)\s+(?P<persist>\d+\.\d+)"
                 r"\s+(?P<peak>\d+\.\d+)\s+(?P<sent>\d+\.\d+)\s+(?P<ratio>\d+\.\d+)\s+(?P<theory>\d+\.\d+)$")


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec")
@pytest.mark.timeout(300)
def test_driver_prints_table():
    cmd = [sys.executable, "-m", "axonhpc", "bench", "fsdp", "--sizes", "16,64,4", "--ranks", "2", "--batch", "8",
           "--steps", "2", "--warmup", "1", "--repeats", "1", "--timeout", "120"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    rows = {m["config"]: m for m in map(ROW.match, out.stdout.splitlines()) if m}
    assert sorted(rows) == sorted(bench_fsdp.CONFIGS), out.stdout
    assert float(rows["ddp"]["vs"]) == 1.0 and float(rows["ddp"]["ratio"]) == 1.0
    # counted, not timed: sharding halves the persistent bytes on 2 ranks (up to padding),
    # and ZeRO-3 sends 1.5x DDP's bytes (the padding of 64*16+64 and 4*64+4 elements over 2 ranks is zero)
    assert float(rows["full_shard"]["persist"]) < float(rows["no_shard"]["persist"])
    assert float(rows["full_shard"]["ratio"]) == pytest.approx(1.5, abs=1e-3)
    assert float(rows["shard_grad_op"]["ratio"]) == pytest.approx(1.0, abs=1e-3)


def test_bad_ranks_are_refused():
    out = subprocess.run([sys.executable, "-m", "axonhpc", "bench", "fsdp", "--ranks", "1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--ranks must all be at least 2" in out.stderr
