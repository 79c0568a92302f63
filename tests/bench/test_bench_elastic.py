"""``axonhpc bench elastic`` launches its own Open MPI jobs with ULFM, kills a rank, and prints a parsable table.

It spawns mpiexec itself, so it belongs to the serial suite. No wall-clock
assertions: only that every row is there, the survivors recovered, and the
buddy copy is the rank's own shard state (FSDP) or nothing (DDP).
"""
import os
import re
import subprocess
import sys

import pytest

from support.openmpi import OPENMPI_PYTHON, needs_openmpi

ROW = re.compile(r"^(?P<mode>ddp|fsdp)\s+(?P<ranks>\d+)\s+(?P<plain>\d+\.\d\d)\s+(?P<elastic>\d+\.\d\d)\s+"
                 r"(?P<ratio>\d+\.\d{3})\s+(?P<own>\d+\.\d\d)\s+(?P<buddy>\d+\.\d\d)\s+(?P<detect>-?\d+\.\d{3})\s+"
                 r"(?P<recover>\d+\.\d{3})\s+(?P<next>\d+\.\d{3})$", re.M)
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


@needs_openmpi
@pytest.mark.timeout(300)
def test_driver_kills_a_rank_and_prints_the_table(tmp_path):
    out = subprocess.run([OPENMPI_PYTHON, "-m", "axonhpc", "bench", "elastic", "--ranks", "2,3", "--width", "32",
                          "--layers", "1", "--context", "16", "--batch", "6", "--steps", "2", "--warmup", "0",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=280,
                         cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [m.groupdict() for m in ROW.finditer(out.stdout)]
    assert [(r["mode"], int(r["ranks"])) for r in rows] == [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3)], \
        out.stdout
    for r in rows:
        assert float(r["buddy"]) == (float(r["own"]) if r["mode"] == "fsdp" else 0.0), r
        assert float(r["next"]) >= float(r["recover"]) > 0, r
    assert (tmp_path / "r.json").exists()


def test_driver_refuses_mpich_and_bad_counts():
    run = lambda *args: subprocess.run([sys.executable, "-m", "axonhpc", "bench", "elastic", *args],  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    mpich = run("--ranks", "2")
    assert mpich.returncode == 2 and "is not Open MPI's" in mpich.stderr, mpich.stderr
    for args, text in ((["--ranks", "1"], "at least 2"), (["--modes", "zero"], "--modes takes ddp, fsdp"),
                       (["--ranks", "4", "--batch", "16"], "divisible by the survivors' count 3")):
        bad = run(*args)
        assert bad.returncode == 2 and text in bad.stderr, bad.stderr
