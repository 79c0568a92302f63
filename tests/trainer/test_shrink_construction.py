"""``DistributedTrainer(fault_tolerance="shrink")``: a rank SIGKILLed while the trainer is built is survived.

The job (``tests/support/jobs/shrink_build_job.py``, started as a user would: ``axonhpc launch
--fault-tolerant`` with .venv-openmpi, an outer timeout) has one rank kill itself for real inside the DDP or
FSDP wrapper's construction: as its model comparison starts, or as its broadcast of rank 0's parameters starts,
the other ranks waiting there. The survivors must build the trainer again on themselves and end with the
final loss of the uninterrupted run (the same global batch: the same samples at every width) to 1e-10, within
seconds of the kill.
"""
import os
import re
import subprocess

import pytest

from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi
from support.paths import JOBS

JOB = os.path.join(JOBS, "shrink_build_job.py")
GUARD = 120  # seconds: the outer timeout of every job
BUILT_AGAIN = re.compile(r"^recovered: lost rank (\d+) while the run was built, continuing on (\d+) ranks \(dp=(\d+)\) "
                         r"in (\d+\.\d\d) s$", re.M)


def _job(tmp_path, n, *args):
    """``axonhpc launch --fault-tolerant -n n -- shrink_build_job.py args``: (return code, stdout, stderr)."""
    cmd = ["timeout", "-k", "5", str(GUARD), OPENMPI_PYTHON, "-m", "axonhpc", "launch", "--fault-tolerant", "-n",
           str(n), "--", JOB, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=job_env(tmp_path),
                         stdin=subprocess.DEVNULL, timeout=GUARD + 20, errors="replace")
    return out.returncode, out.stdout, out.stderr


def _final_loss(text):
    losses = re.findall(r"^final loss (\S+) at step (\d+)$", text, re.M)
    assert len(losses) == 1, text  # rank 0 of the survivors alone prints it
    return float(losses[0][0]), int(losses[0][1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final loss of the run with no failure on 3 ranks, each rank's own model or the same on every rank."""
    losses = {}
    for seeds in ([], ["--seed-by-rank"]):
        code, out, err = _job(tmp_path_factory.mktemp("plain"), 3, *seeds)
        assert code == 0 and "recovered" not in out, out[-3000:] + err[-3000:]
        losses[bool(seeds)] = _final_loss(out)
    return losses


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,kill,seeds", [
    ("ddp", "1:compare", []),                     # in DDP's model comparison
    ("ddp", "2:broadcast", ["--seed-by-rank"]),   # in DDP's broadcast: rank 0's own model is still the one trained
    ("ddp", "0:broadcast", []),                   # rank 0, the one whose parameters are broadcast
    ("fsdp", "2:compare", []),                    # in FSDP's model comparison
    ("fsdp", "1:broadcast", ["--seed-by-rank"]),  # in FSDP's broadcast
    ("fsdp", "0:compare", []),
])
def test_a_rank_killed_while_the_trainer_is_built_is_survived_with_the_uninterrupted_loss(tmp_path, uninterrupted,
                                                                                         strategy, kill, seeds):
    code, out, err = _job(tmp_path, 3, "--strategy", strategy, "--kill", kill, *seeds)
    assert code == 0, out[-3000:] + err[-5000:]
    assert [m[:3] for m in BUILT_AGAIN.findall(out)] == [(kill.split(":")[0], "2", "2")], out[-3000:]
    loss, step = _final_loss(out)
    expected, steps = uninterrupted[bool(seeds)]
    assert step == steps == 40  # 2 epochs of 20 global batches of 30 samples, at 3 or 2 ranks
    assert abs(loss - expected) <= 1e-10 * abs(expected), (loss, expected)
    killed = float(re.search(r"^killed at (\S+)$", out, re.M).group(1))
    lost, at, ranks, seconds, caught = re.search(r"^recovery \[(\d+)\] (\d+) (\d+) (\S+) (\S+)$", out, re.M).groups()
    assert float(caught) - killed + float(seconds) < 10, out  # from the kill to the rebuilt trainer


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_resumed_run_killed_while_the_trainer_is_built_resumes_on_the_survivors(tmp_path, uninterrupted):
    """The survivors' build loads the checkpoint again (FSDP's loads on any width): the run goes on from it."""
    ckpt = str(tmp_path / "ckpt")
    code, out, err = _job(tmp_path, 3, "--strategy", "fsdp", "--epochs", "1", "--checkpoint-dir", ckpt)
    assert code == 0 and _final_loss(out)[1] == 20, out[-3000:] + err[-3000:]
    code, out, err = _job(tmp_path, 3, "--strategy", "fsdp", "--epochs", "2", "--checkpoint-dir", ckpt, "--kill",
                          "1:broadcast")
    assert code == 0, out[-3000:] + err[-5000:]
    assert [m[:3] for m in BUILT_AGAIN.findall(out)] == [("1", "2", "2")], out[-3000:]
    assert re.search(r"^resuming from .*ckpt-00000020 at epoch 2/2$", out, re.M), out[-3000:]
    assert "\nepochs run 1\n" in out, out[-3000:]  # the second epoch alone: the survivors resumed
    loss, step = _final_loss(out)
    expected = uninterrupted[False][0]
    assert step == 40 and abs(loss - expected) <= 1e-10 * abs(expected), (loss, step, expected)


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_ddp_checkpoint_the_survivors_cannot_load_ends_every_survivor_with_the_reason(tmp_path):
    """A DDP checkpoint loads only on the width that wrote it: every survivor raises, naming the lost rank."""
    ckpt = str(tmp_path / "ckpt")
    code, out, err = _job(tmp_path, 3, "--epochs", "1", "--checkpoint-dir", ckpt)
    assert code == 0, out[-3000:] + err[-3000:]
    code, out, err = _job(tmp_path, 3, "--epochs", "2", "--checkpoint-dir", ckpt, "--kill", "2:compare")
    assert code != 0 and "final loss" not in out, out[-3000:]
    text = ("RecoveryError: after the loss of rank 2 while the run was built, it cannot be built on 2 ranks: "
            f"'{ckpt}/ckpt-00000020' was saved by 3 ranks; this group has 2")
    assert err.count(text) == 2, err[-5000:]  # on both survivors
