"""The main job: trains to >= 95% and resumes bit for bit (2 MPI ranks, launched here)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from axonhpc import checkpoint
from support.paths import ROOT

pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn (extra 'examples')")


def launch(tmp_path, *args):
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", sys.executable,
           os.path.join(ROOT, "examples", "train_digits.py"), *args]
    env = dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def run(tmp_path, *args):
    out = launch(tmp_path, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _no_gpu():
    """Why --device cuda cannot work here (no cupy, or no CUDA device), or None where it can."""
    from axonhpc.backends.devices import device_facts

    facts = device_facts()
    return None if facts.cupy is not None and facts.devices >= 1 else "; ".join(facts.problems) or "no device"


@pytest.mark.timeout(600)
def test_trains_to_95_percent_and_resumes_bit_for_bit(tmp_path):
    straight = run(tmp_path, "--epochs", "6", "--checkpoint-dir", "a", "--min-accuracy", "0.9")
    assert "final test accuracy" in straight
    # stdout is a pipe here, as an sbatch .out file: plain progress lines, no carriage returns (issue 42)
    assert "\r" not in straight and "epoch 1/6: 100%" in straight and len(straight) < 8000, straight[:2000]
    run(tmp_path, "--epochs", "3", "--checkpoint-dir", "b")
    resumed = run(tmp_path, "--epochs", "6", "--checkpoint-dir", "b", "--resume")
    assert "resuming from" in resumed and "at epoch 4/6" in resumed  # epochs 1-3 ran: it goes on with the 4th
    # each rank's state is an ordinary checkpoint file inside the newest checkpoint directory
    a = checkpoint.load(os.path.join(checkpoint.latest(tmp_path / "a", "ckpt-*"), "rank-00000-of-00002.npz"))
    b = checkpoint.load(os.path.join(checkpoint.latest(tmp_path / "b", "ckpt-*"), "rank-00000-of-00002.npz"))
    assert list(a["modules"][0]) == list(b["modules"][0])
    for name in a["modules"][0]:
        assert np.array_equal(a["modules"][0][name], b["modules"][0][name]), name
    assert a["optimizer"]["state"][0]["step"] == b["optimizer"]["state"][0]["step"]

    def epoch6(text):  # loss and accuracy of the last epoch, without its wall time
        return [line.split("(")[0] for line in text.splitlines() if line.startswith("epoch   6 ")]

    assert epoch6(straight) and epoch6(straight) == epoch6(resumed)


@pytest.mark.timeout(600)
def test_parameter_server_example_reaches_95_percent_async(tmp_path):
    """1 server + 3 workers, async with max_staleness 2, on 4 MPI ranks."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "4", sys.executable,
           os.path.join(ROOT, "examples", "train_digits_ps.py"), "--min-accuracy", "0.95"]
    env = dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "max 2" in out.stdout or "max 1" in out.stdout or "max 0" in out.stdout, out.stdout[-2000:]


def test_device_cuda_without_a_gpu_stops_every_rank_saying_cupy_is_needed(tmp_path):
    why = _no_gpu()
    if why is None:
        pytest.skip("cupy and a CUDA device are here: test_trains_to_95_percent_on_the_gpu runs instead")
    out = launch(tmp_path, "--device", "cuda", "--epochs", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    line = f"train_digits --device cuda needs cupy and a CUDA device: {why}"
    assert out.stderr.count(line) == 2, out.stderr  # each rank says it, before MPI is used
    assert "training on" not in out.stdout
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(_no_gpu() is not None, reason="needs cupy and a CUDA device")
def test_trains_to_95_percent_on_the_gpu(tmp_path):
    """The main job with --device cuda (2 ranks: NCCL with a GPU each, staged MPI when they share one)."""
    out = run(tmp_path, "--device", "cuda", "--epochs", "20", "--min-accuracy", "0.95", "--checkpoint-dir", "g")
    assert "training on 2 rank(s) (device cuda:" in out and "final test accuracy" in out
