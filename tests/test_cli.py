"""The axonhpc command: info, launch (its argument list and its clear errors)."""
import json
import os
import subprocess
import sys

from axonhpc.mpiexec import launch_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AXONHPC = [sys.executable, "-m", "axonhpc"]


def run(*args, timeout=120):
    return subprocess.run([*AXONHPC, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_info_reports_mpi_and_world():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["mpi_vendor"].split()[0] in ("MPICH", "Open")
    assert facts["thread_level"] in ("single", "funneled", "serialized", "multiple")
    assert facts["world_size"] == 1 and facts["num_nodes"] == 1
    assert "cuda_aware_mpi" in facts and "nccl" in facts


def test_launch_runs_a_script_on_several_ranks():
    out = run("launch", "-n", "3", "--", "examples/collectives_demo.py", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world: 3 ranks" in out.stdout and "all checks passed on every rank" in out.stdout


def test_launch_refuses_bad_input_clearly():
    zero = run("launch", "-n", "0", "--", "examples/collectives_demo.py")
    assert zero.returncode == 2 and "-n must be at least 1, got 0" in zero.stderr
    missing = run("launch", "-n", "2", "--", "no/such/script.py")
    assert missing.returncode == 2 and "script 'no/such/script.py' does not exist" in missing.stderr
    empty = run("launch", "-n", "2")
    assert empty.returncode == 2 and "no script given" in empty.stderr


def test_launch_command_is_an_argument_list_with_open_mpi_settings():
    hostile = "$(touch /tmp/pwned); echo 'x'"
    cmd = launch_command("/opt/mpi/bin/mpiexec", "openmpi", 4, "train.py", ["--name", hostile], is_root=True)
    assert cmd[:3] == ["/opt/mpi/bin/mpiexec", "--allow-run-as-root", "--oversubscribe"]
    assert cmd[-2:] == ["--name", hostile]  # passed through untouched, never through a shell
    mpich = launch_command("/x/mpiexec", "mpich", 2, "t.py", [], hosts="a,b")
    assert mpich == ["/x/mpiexec", "-hosts", "a,b", "-n", "2", sys.executable, "t.py"]
