"""Preemption with a real signal: SIGUSR1 to one rank of an mpiexec job mid-epoch.

Every rank stops after the same step, one checkpoint is written, the job
exits with 75, and a resumed run ends with the parameters of an
uninterrupted run, bit for bit.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from axonhpc import checkpoint
from axonhpc.trainer import PREEMPTED_EXIT_CODE
from support.paths import ROOT

pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn (extra 'examples')")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
EPOCHS = "60"


def _command(directory):
    return [MPIEXEC, "-n", "2", sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "--epochs", EPOCHS,
            "--checkpoint-dir", directory, "--resume"]


def _env():
    return dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1", OMP_NUM_THREADS="1")


def _rank_pids(directory):
    """PIDs of the Python ranks of the job writing to ``directory`` (not mpiexec itself)."""
    out = subprocess.run(["pgrep", "-f", f"train_digits.py --epochs {EPOCHS} --checkpoint-dir {directory}"],
                         capture_output=True, text=True)
    pids = []
    for pid in map(int, out.stdout.split()):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if os.path.basename(f.read().split(b"\0")[0].decode()).startswith("python"):
                pids.append(pid)
    return sorted(pids)


def _final_state(directory):
    path = checkpoint.latest(directory, "ckpt-*")
    return checkpoint.load(os.path.join(path, "rank-00000-of-00002.npz"))


@pytest.mark.timeout(600)
def test_sigusr1_to_one_rank_checkpoints_exits_75_and_resumes_bit_for_bit(tmp_path):
    straight = str(tmp_path / "straight")
    done = subprocess.run(_command(straight), capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    preempted = str(tmp_path / "preempted")
    job = subprocess.Popen(_command(preempted), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest(preempted, "ckpt-*") is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the first epoch's checkpoint: the job is well into training
        pids = _rank_pids(preempted)
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGUSR1)  # one rank only, mid-epoch
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == PREEMPTED_EXIT_CODE, out[-2000:] + err[-2000:]
    assert "preempted after step" in out, out[-2000:]
    stopped_at = checkpoint.load(os.path.join(checkpoint.latest(preempted, "ckpt-*"), "index.npz"))["extra"]
    assert stopped_at["global_step"] < 60 * 23  # it really stopped early

    resumed = subprocess.run(_command(preempted), capture_output=True, text=True, timeout=300, env=_env())
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    a, b = _final_state(straight), _final_state(preempted)
    for name in a["modules"][0]:
        np.testing.assert_array_equal(a["modules"][0][name], b["modules"][0][name], err_msg=name)
