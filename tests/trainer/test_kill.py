"""Kill tests: SIGKILL a rank of a real mpiexec job, mid-step and mid-checkpoint, then resume.

Each kill must end the whole job promptly with a non-zero exit code; the
newest complete checkpoint must load (every array's checksum checked); and
after all the kills, resuming runs to the end with parameters bit-for-bit
equal to an uninterrupted run with the same seed. The job is
``tests/support/jobs/kill_job.py`` (DDP through the trainer, a 25 MB checkpoint
every two steps, so a kill can land inside a save).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from axonhpc import checkpoint
from support.paths import JOBS

JOB = os.path.join(JOBS, "kill_job.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ARGS = ["--width", "1024", "--epochs", "6"]
FINAL_STEP = 24  # 6 epochs of 4 steps
PATTERN = "ckpt-*"


def _command(directory):
    return [MPIEXEC, "-n", "2", sys.executable, JOB, "--checkpoint-dir", directory, "--resume", *ARGS]


def _env():
    return dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1", OMP_NUM_THREADS="1")


def _rank_pids(directory):
    """PIDs of the Python ranks of the job writing to ``directory``, in rank order of their start."""
    out = subprocess.run(["pgrep", "-f", f"kill_job.py --checkpoint-dir {directory} "], capture_output=True, text=True)
    pids = []
    for pid in map(int, out.stdout.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if os.path.basename(argv0).startswith("python"):
            rank = env.get(b"PMI_RANK") or env.get(b"OMPI_COMM_WORLD_RANK") or b"-1"
            pids.append((int(rank), pid))
    return [pid for _, pid in sorted(pids)]


def _step_of(path):
    return int(os.path.basename(path).split("-")[1])


def _load_all(path):
    """Every file of a checkpoint directory, fully checked; the model parameters of rank 0."""
    index = checkpoint.load(os.path.join(path, "index.npz"))
    states = [checkpoint.load(os.path.join(path, f"rank-{r:05d}-of-00002.npz")) for r in range(2)]
    return index, states[0]["modules"][0]


def _wait_for(predicate, seconds, job):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and job.poll() is None:
        if predicate():
            return True
        time.sleep(0.001)
    return False


def _kill_one(directory, rank, moment):
    """Start the job (resuming), SIGKILL group rank ``rank`` at ``moment``; return what happened."""
    before = checkpoint.latest(directory, PATTERN)
    start_step = _step_of(before) if before else 0
    stale = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    job = subprocess.Popen(_command(directory), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=_env())
    try:
        def newer_checkpoint():
            now = checkpoint.latest(directory, PATTERN)
            return now is not None and _step_of(now) > start_step

        def saving():  # a save of this run in progress (not a leftover of an earlier kill)
            return any(".tmp-" in name and name not in stale for name in os.listdir(directory))

        if moment == "mid-step":
            assert _wait_for(newer_checkpoint, 120, job), "the job wrote no new checkpoint"
            time.sleep(0.15)  # inside the next step
        else:
            assert _wait_for(newer_checkpoint, 120, job), "the job wrote no new checkpoint"
            assert _wait_for(saving, 120, job), "never saw a checkpoint being written"
        pids = _rank_pids(directory)
        assert len(pids) == 2, pids
        killed_at = time.monotonic()
        os.kill(pids[rank], 9)
        out, _ = job.communicate(timeout=120)
        detected_s = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    after = checkpoint.latest(directory, PATTERN)
    assert after is not None
    index, _ = _load_all(after)  # the newest complete checkpoint is whole and checks out
    leftovers = sorted(n for n in os.listdir(directory) if ".tmp-" in n or ".old-" in n)
    return {"fault": f"SIGKILL rank {rank} {moment}", "exit_code": job.returncode, "detected_s": round(detected_s, 2),
            "checkpoint_before": start_step, "checkpoint_after": _step_of(after),
            "step_in_checkpoint": int(index["extra"]["global_step"]), "leftovers": leftovers, "output": out[-1500:]}


@pytest.mark.timeout(600)
def test_sigkill_ranks_mid_step_and_mid_checkpoint_then_resume_bit_for_bit(tmp_path):
    straight = str(tmp_path / "straight")
    done = subprocess.run(_command(straight), capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"finished at step {FINAL_STEP}" in done.stdout

    killed = str(tmp_path / "killed")
    faults = []
    for rank, moment in [(1, "mid-step"), (0, "mid-checkpoint"), (1, "mid-checkpoint"), (0, "mid-step")]:
        result = _kill_one(killed, rank, moment)
        faults.append(result)
        assert result["exit_code"] != 0, result
        assert result["checkpoint_after"] >= result["checkpoint_before"], result  # nothing older came back
        assert result["step_in_checkpoint"] == result["checkpoint_after"], result
    assert any(f["leftovers"] for f in faults)  # some kill did land inside a save
    resumed = subprocess.run(_command(killed), capture_output=True, text=True, timeout=300, env=_env())
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and f"finished at step {FINAL_STEP}" in resumed.stdout
    # The resumed run tidied the killed saves' temporary directories away before training.
    assert not [n for n in os.listdir(killed) if ".tmp-" in n or ".old-" in n], os.listdir(killed)

    _, a = _load_all(checkpoint.latest(straight, PATTERN))
    _, b = _load_all(checkpoint.latest(killed, PATTERN))
    assert _step_of(checkpoint.latest(killed, PATTERN)) == FINAL_STEP
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    report = [{k: v for k, v in f.items() if k != "output"} for f in faults]
    (tmp_path / "faults.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
