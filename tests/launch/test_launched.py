"""What ``axonhpc launch`` runs on each rank (``axonhpc/launched.py``): the script as python would, and a job
that ends with a rank's status when that rank exits with an error ([Note: a rank that exits with an error])."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi

EXITS_WHILE_THE_OTHER_WAITS = """
import sys
import numpy as np
import axonhpc as ax

world = ax.init()
if world.rank == 1:
    sys.exit(4)  # an argparse error, a failed check: rank 0 waits for it below
ax.all_reduce(np.ones(4))
print("rank 0 finished the all_reduce", flush=True)
"""


def _launch(python, script, *args, env=None, timeout=180):
    cmd = [python, "-m", "axonhpc", "launch", "-n", "2", "--", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=os.path.dirname(str(script)))


@pytest.mark.timeout(240)
def test_a_rank_that_exits_with_an_error_ends_the_job_with_its_status(tmp_path):
    # The job hung (rank 1 waited at exit in the collective free of its shared-memory windows) until a timeout,
    # and the 4 was lost.
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WHILE_THE_OTHER_WAITS)
    out = _launch(sys.executable, script, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 4, out.stdout + out.stderr
    assert "[axonhpc rank 1] exits with status 4: ending the job" in out.stderr, out.stderr
    assert "finished" not in out.stdout


@needs_openmpi
@pytest.mark.timeout(300)
def test_every_rank_exiting_with_one_status_gives_that_status_under_open_mpi(tmp_path):
    # A preempted trainer exits with 75 on every rank: the runner aborts with it, and Open MPI passes it on.
    script = tmp_path / "preempted.py"
    script.write_text("import sys\nimport axonhpc as ax\nax.init()\nax.barrier()\nsys.exit(75)\n")
    out = _launch(OPENMPI_PYTHON, script, env=job_env(tmp_path))
    assert out.returncode == 75, out.stdout + out.stderr


@pytest.mark.timeout(240)
def test_the_trainers_preemption_exit_on_every_rank_exits_without_an_abort(tmp_path):
    # Every rank raises it together, so none waits for another: the job ends as usual with 75 (under srun an
    # abort would make the step's status 137; tests/launch/test_slurm_cluster.py runs that case).
    script = tmp_path / "preempted.py"
    script.write_text("import axonhpc as ax\nfrom axonhpc.trainer import PreemptedExit\nax.init()\nax.barrier()\n"
                      "raise PreemptedExit()\n")
    out = _launch(sys.executable, script, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 75, out.stdout + out.stderr
    assert "ending the job" not in out.stderr, out.stderr


# Each rank writes its own file: two ranks printing at once may share a line of the launcher's output.
SHOWS_WHAT_IT_SEES = """
import json, os, sys
seen = {"numpy_loaded": "numpy" in sys.modules, "axonhpc_loaded": "axonhpc" in sys.modules,
        "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0]}
with open(f"seen-{os.getpid()}.json", "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.timeout(240)
def test_the_script_sees_what_python_would_give_it(tmp_path):
    # Run as a file, not with -m axonhpc.launched: numpy is not loaded before the script may set its threads.
    script = tmp_path / "shows.py"
    script.write_text(SHOWS_WHAT_IT_SEES)
    out = _launch(sys.executable, script, "--flag", "a b", env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    files = sorted(tmp_path.glob("seen-*.json"))
    assert len(files) == 2, (files, out.stdout, out.stderr)
    for path in files:
        seen = json.loads(path.read_text())
        assert seen == {"numpy_loaded": False, "axonhpc_loaded": False, "name": "__main__", "file": str(script),
                        "argv": [str(script), "--flag", "a b"], "path0": str(tmp_path)}, seen


@pytest.mark.timeout(120)
def test_ctrl_c_on_the_launcher_ends_the_job_without_a_traceback_of_its_own(tmp_path):
    # SIGINT was not passed on: the launcher died in proc.wait() with a KeyboardInterrupt traceback and left the
    # ranks to run on (and a preempted job's status was lost).
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nimport axonhpc as ax\nworld = ax.init()\n"
                      "open(f'pid-{world.rank}.txt', 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "axonhpc", "launch", "-n", "2", "--", str(script)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid-*.txt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0, out
    assert "_run_forwarding_signals" not in out and "in proc.wait" not in out, out[-3000:]
