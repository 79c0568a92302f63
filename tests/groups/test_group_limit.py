"""Groups never destroyed pile up; when MPI runs out of communicators the error says so and what to do
(``test_destroy``'s ``many_groups`` case makes 2000 that are destroyed)."""
import os
import subprocess
import sys

import pytest

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

MAKES_GROUPS = """
import sys
import numpy as np
import axonhpc as ax

world = ax.init()
with open(f"{sys.argv[1]}/rank{world.rank}.txt", "w") as out:  # one file per rank: no interleaved lines
    for i in range(5000):
        try:
            group = world.new_group([0, 1])
        except ax.errors.UsageError as exc:
            out.write(f"refused group {i}: {exc}")
            break
        x = np.ones(2)
        ax.all_reduce(x, group=group)
    else:
        out.write("made 5000 groups")
"""


@pytest.mark.timeout(300)
def test_running_out_of_communicators_is_a_clear_error(tmp_path):
    # A raw mpi4py "Other MPI error ... Too many communicators" at about the 680th group (MPICH).
    script = tmp_path / "groups.py"
    script.write_text(MAKES_GROUPS)
    out = subprocess.run(["timeout", "-k", "5", "240", MPIEXEC, "-n", "2", sys.executable, str(script), str(tmp_path)],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for rank in (0, 1):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        if "made 5000 groups" in line:
            pytest.skip("this MPI made 5000 groups without running out")
        assert "it has run out of them" in line and "make each group once and reuse it" in line, line
        assert "group.destroy()" in line and "mesh.destroy()" in line, line
