"""Bad benchmark options end in argparse's exit 2 with the option and its value, never a traceback.

Serial suite: the commands run in subprocesses (one under ``axonhpc launch``), never under mpiexec themselves.
"""
import subprocess
import sys

import pytest

from axonhpc.bench.jobs import parse_counts
from axonhpc.mpiexec import find_mpiexec
from support.paths import ROOT

AXONHPC = [sys.executable, "-m", "axonhpc"]


def run(*args, timeout=120):
    return subprocess.run([*AXONHPC, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_parse_counts_names_the_option_and_the_bad_values():
    assert parse_counts("4096, 65536", "--sizes", "sizes in bytes") == [4096, 65536]
    for text, message in (("abc", "'abc' is not an integer"), ("8,x", "'x' is not an integer"),
                          ("-5", "-5 is below 1"), ("8,0,-2", "0, -2 are below 1"), ("", "at least 1 sizes")):
        with pytest.raises(ValueError, match="--sizes") as info:
            parse_counts(text, "--sizes", "sizes in bytes")
        assert message in str(info.value), info.value
    with pytest.raises(ValueError, match="--ranks .* 1 is below 2"):
        parse_counts("1,2", "--ranks", "rank counts", least=2)


@pytest.mark.parametrize("bench", ["allreduce", "p2p"])
@pytest.mark.parametrize("argv, message", [
    (["--sizes", "abc"], "--sizes must be comma-separated integers (sizes in bytes), got 'abc'"),
    (["--sizes", "-5"], "--sizes must be at least 1 each (sizes in bytes), got '-5': -5 is below 1"),
    (["--sizes", "4096,0"], "got '4096,0': 0 is below 1"),
    (["--rounds", "0", "--sizes", "4096"], "--rounds must be at least 1, got 0"),
])
def test_bad_sizes_and_rounds_are_refused_with_exit_2(bench, argv, message):
    out = run("bench", bench, *argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stdout == ""  # nothing was timed


def test_allreduce_refuses_a_max_size_that_leaves_nothing():
    out = run("bench", "allreduce", "--sizes", "4096,8192", "--max-size", "100")
    assert out.returncode == 2 and "--max-size 100 drops every size (4096, 8192)" in out.stderr, out.stderr
    out = run("bench", "allreduce", "--max-size", "0")
    assert out.returncode == 2 and "--max-size must be at least 1, got 0" in out.stderr, out.stderr


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec")
@pytest.mark.timeout(300)
def test_p2p_under_launch_refuses_bad_sizes_on_every_rank_before_mpi():
    out = run("launch", "-n", "2", "--", "-m", "axonhpc", "bench", "p2p", "--sizes", "x", timeout=240)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'x' is not an integer" in out.stderr and "Traceback" not in out.stderr, out.stderr
