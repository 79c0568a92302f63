"""A real SIGKILL in a training run under Open MPI with ULFM: the survivors shrink, rebuild and finish with the same loss.

Each run is ``examples/train_gpt.py --elastic --simulate-failure R:K[:where]``
started as a user would (``axonhpc launch --fault-tolerant``, the Open MPI
environment .venv-openmpi), float64, with an outer timeout and its process
group killed if it outlives it. The loss of every run that goes on must be
the uninterrupted run's to 1e-10; one that cannot go on must end, on every
rank, with a ``RecoveryError`` that says why.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi
from support.paths import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
GUARD = 150  # seconds: the outer timeout of every job
EXIT_GRACE = 20  # seconds a job has to end once rank 0 printed its last line
RUN = ["--max-bytes", "200000", "--steps", "8", "--dtype", "float64", "--eval-batches", "1"]
RECOVERED = re.compile(r"^recovered: lost ranks? ([\d, ]+) at step (\d+), continuing on (\d+) ranks? \(dp=(\d+)\) "
                       r"in (\d+\.\d\d) s$", re.M)


def _stacks(pid, name):
    """The native stacks of the job's Python processes (gdb, where installed): what a job that hangs waits in."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb to show the stacks)"
    pids = subprocess.run(["pgrep", "-g", str(os.getpgid(pid)), "-f", name], capture_output=True,
                          text=True).stdout.split()
    out = []
    for p in pids:
        bt = subprocess.run([gdb, "-p", p, "-batch", "-ex", "thread apply all bt 16"], capture_output=True, text=True,
                            timeout=60).stdout
        out.append(f"--- pid {p}\n" + "\n".join(line[:200] for line in bt.splitlines() if line.startswith(("#", "Thread"))))
    return "\n".join(out)


def launch_fault_tolerant(tmp_path, n, script, args, last_line):
    """``axonhpc launch --fault-tolerant -n n -- script args``: (return code, stdout, stderr).

    The job has EXIT_GRACE seconds to end once rank 0 printed ``last_line``, and GUARD in all; one
    that outlives them has its native stacks shown and its process group killed.
    """
    cmd = [OPENMPI_PYTHON, "-m", "axonhpc", "launch", "--fault-tolerant", "-n", str(n), "--", script, *args]
    out_path, err_path = tmp_path / "job.out", tmp_path / "job.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                env=job_env(tmp_path), start_new_session=True)
        deadline = time.monotonic() + GUARD
        while proc.poll() is None and time.monotonic() < deadline:
            if last_line in out_path.read_text():
                deadline = min(deadline, time.monotonic() + EXIT_GRACE)
            try:
                proc.wait(timeout=0.2)  # returns as the job ends, not up to 0.2 s after
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            stacks = _stacks(proc.pid, os.path.basename(script))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the job did not end:\n{out_path.read_text()[-2000:]}\n{err_path.read_text()[-3000:]}\n"
                        f"{stacks}")
    return proc.returncode, out_path.read_text(), err_path.read_text()


def _run(tmp_path, n, *args):
    """``axonhpc launch --fault-tolerant -n n -- train_gpt.py --elastic ...``: (return code, stdout, stderr)."""
    return launch_fault_tolerant(tmp_path, n, EXAMPLE, ["--elastic", *RUN, *args], "peak activations")


def _final_loss(text):
    losses = re.findall(r"^final loss (\S+)$", text, re.M)
    assert len(losses) == 1, text  # rank 0 alone prints it
    return float(losses[0])


@pytest.fixture(scope="module")
def uninterrupted():
    """The final loss of the same run in one process, by global batch (no MPI: the losses are layout-free)."""
    losses = {}
    for batch in (12, 16):
        out = subprocess.run([sys.executable, EXAMPLE, *RUN, "--batch", str(batch)], capture_output=True, text=True,
                             timeout=GUARD, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr
        losses[batch] = _final_loss(out.stdout)
    return losses


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,fsdp,failure,lost,step", [
    (3, False, "2:3", [2], 4),                # during the forward
    (4, True, "1:3", [1], 4),
    (4, False, "0:3", [0], 4),                # rank 0, the one that prints
    (3, True, "0:3", [0], 4),
    (4, False, "2:3:backward", [2], 4),       # in the backward's first bucket all-reduce / reduce-scatter
    (3, True, "1:3:backward", [1], 4),
    (3, False, "1:4:optimizer", [1], 6),      # after the step's communication: the others finish step 5
    (4, True, "2:4:optimizer", [2], 6),
    (4, True, "3:2:save", [3], 3),            # as the checkpoint save of step 2 starts
    (3, False, "1:4:save", [1], 5),
    (4, True, "1:3,3:3", [1, 3], 4),          # two at once (not each other's buddies)
    (4, False, "1:3,2:3", [1, 2], 4),
])
def test_a_killed_rank_is_survived_with_the_uninterrupted_loss(tmp_path, uninterrupted, n, fsdp, failure, lost, step):
    args = ["--batch", "12", "--simulate-failure", failure, "--save", str(tmp_path / "ckpt"), "--save-every", "2"]
    code, out, err = _run(tmp_path, n, *args, *(["--fsdp"] if fsdp else []))
    assert code == 0, out[-3000:] + err[-5000:]
    recovered = RECOVERED.findall(out)
    assert len(recovered) == 1, out  # one line, on rank 0 of the survivors
    ranks, at, left, dp, seconds = recovered[0]
    assert [int(r) for r in ranks.split(",")] == lost
    assert (int(at), int(left), int(dp)) == (step, n - len(lost), n - len(lost))
    assert float(seconds) < 30
    loss = _final_loss(out)
    assert abs(loss - uninterrupted[12]) <= 1e-10 * abs(uninterrupted[12]), (loss, uninterrupted[12])


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,mesh,failure,line", [
    (4, ["--tp", "2"], "3:3", ("3", 4, 2, 1)),                            # replica 1 dropped; rank 2 waits as a spare
    (4, ["--pp", "2", "--microbatches", "2"], "1:3", ("1", 4, 2, 1)),     # a pipeline replica dropped
    (4, ["--tp", "2", "--fsdp"], "0:3", ("0", 4, 2, 1)),                  # replica 0's shards from its keepers
    (5, ["--tp", "2", "--spares", "1"], "1:3", ("1", 4, 4, 2)),           # the spare takes the place: dp stays
    (3, ["--respawn"], "2:3", ("2", 4, 3, 3)),                            # a replacement is spawned
    (4, ["--tp", "2", "--respawn"], "3:3", ("3", 4, 4, 2)),               # ... into the lost rank's place
])
def test_a_replica_that_lost_a_rank_is_dropped_with_the_uninterrupted_loss(tmp_path, uninterrupted, n, mesh, failure,
                                                                          line):
    code, out, err = _run(tmp_path, n, "--batch", "12", "--simulate-failure", failure, *mesh)
    assert code == 0, out[-3000:] + err[-5000:]
    assert [(ranks, int(at), int(left), int(dp)) for ranks, at, left, dp, _ in RECOVERED.findall(out)] == [line], out
    loss = _final_loss(out)
    assert abs(loss - uninterrupted[12]) <= 1e-10 * abs(uninterrupted[12]), (loss, uninterrupted[12])


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fsdp,spares,failure,lines", [
    (True, 1, "", []),                                              # no failure: the spare waits, then leaves
    (True, 1, "1:3", [("1", 4, 3)]),                                # the spare takes the lost rank's place
    (False, 2, "0:3", [("0", 4, 2)]),                               # rank 0, the one that prints
    (False, 1, "1:2,2:5", [("1", 3, 3), ("2", 6, 2)]),              # one spare: the second loss shrinks
    (True, 1, "3:0:spare", []),                                     # a spare dies: seen in close(), the run ends
])
def test_spares_keep_the_width_with_the_uninterrupted_loss(tmp_path, uninterrupted, fsdp, spares, failure, lines):
    args = ["--batch", "12", "--spares", str(spares), *(["--simulate-failure", failure] if failure else []),
            *(["--fsdp"] if fsdp else [])]
    code, out, err = _run(tmp_path, 4, *args)
    assert code == 0, out[-3000:] + err[-5000:]
    assert f"= {4 - spares} rank(s)" in out and f"{spares} spare(s)" in out, out[:2000]
    assert [(ranks, int(at), int(left)) for ranks, at, left, dp, _ in RECOVERED.findall(out)] == lines, out
    loss = _final_loss(out)
    assert abs(loss - uninterrupted[12]) <= 1e-10 * abs(uninterrupted[12]), (loss, uninterrupted[12])


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,extra,failure,line", [
    # A working rank dies as the survivors and the spare enter the Split that brings the spare in: the spare
    # takes rank 1's place, and rank 2's is given up (dp 3 -> 2).
    (4, ["--spares", "1"], "1:3,2:3:split", ("1, 2", 4, 2, 2)),
    (4, ["--spares", "1", "--fsdp"], "1:3,3:0:split", ("1, 3", 4, 2, 2)),            # the spare itself dies there
    (5, ["--tp", "2", "--spares", "1"], "1:3,4:0:split", ("1, 4", 4, 2, 1)),         # ... with tp: replica dropped
    (4, [], "1:3,3:3:agree", ("1, 3", 4, 2, 2)),                    # as the survivors agree on the step
    (4, [], "1:3,2:3:shrink", ("1, 2", 4, 2, 2)),                   # as they enter MPI_Comm_shrink
    (4, ["--fsdp"], "1:3,3:3:restore", ("1, 3", 4, 2, 2)),          # as the state is gathered (not 1's keeper)
    (3, ["--respawn"], "2:3,1:3:restore", ("1, 2", 4, 3, 3)),       # ... after a replacement was spawned: another
])
def test_a_rank_lost_during_recovery_is_survived_with_the_uninterrupted_loss(tmp_path, uninterrupted, n, extra,
                                                                            failure, line):
    """A second rank SIGKILLs itself at a named point of the recovery from the first: the survivors shrink again."""
    code, out, err = launch_fault_tolerant(tmp_path, n, EXAMPLE, ["--elastic", *RUN, "--batch", "12",
                                                                  "--simulate-failure", failure, *extra],
                                           "peak activations")
    # With a replacement spawned, Open MPI's launcher often stays once every rank has left its script (a
    # replacement waits in MPI_Finalize for good): axonhpc launch ends such a job, with the ranks' verdict.
    assert code == 0, out[-3000:] + err[-5000:]
    assert [(ranks, int(at), int(left), int(dp)) for ranks, at, left, dp, _ in RECOVERED.findall(out)] == [line], out
    loss = _final_loss(out)
    assert abs(loss - uninterrupted[12]) <= 1e-10 * abs(uninterrupted[12]), (loss, uninterrupted[12])


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra,failure,said,survivors", [
    ([], "1:3,2:3:restore", "dp rank 1 and its keeper 2 both failed (ranks 1, 2 of the job)", 2),
    (["--spares", "1"], "1:3,0:3:agree", "dp rank 0 and its keeper 1 both failed (ranks 0, 1 of the job)", 2),
])
def test_a_keeper_lost_during_recovery_ends_every_survivor_with_the_reason(tmp_path, extra, failure, said, survivors):
    """The lost shard's keeper dies while the survivors recover: its state is gone, and every survivor says so."""
    code, out, err = _run(tmp_path, 4, "--fsdp", "--batch", "12", "--simulate-failure", failure, *extra)
    assert code != 0 and "final loss" not in out
    text = f"RecoveryError: FSDP shards are lost with their buddy copies: {said}; resume from the last checkpoint"
    assert err.count(text) == survivors, err[-5000:]  # every survivor, the spare too


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_shard_lost_with_its_buddy_copy_ends_every_survivor_with_the_reason(tmp_path):
    code, out, err = _run(tmp_path, 4, "--fsdp", "--batch", "12", "--simulate-failure", "1:3,2:3")
    assert code != 0 and "final loss" not in out
    assert ("RecoveryError: FSDP shards are lost with their buddy copies: dp rank 1 and its keeper 2 both failed "
            "(ranks 1, 2 of the job); resume from the last checkpoint") in err, err[-5000:]


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_width_that_cannot_go_on_saves_the_whole_state_which_resumes_elsewhere(tmp_path, uninterrupted):
    ckpt = tmp_path / "whole"
    code, out, err = _run(tmp_path, 4, "--batch", "16", "--simulate-failure", "2:3", "--save", str(ckpt))
    assert code != 0 and "final loss" not in out
    assert "RecoveryError: after the loss of rank 2 the run cannot go on on 3 ranks: TextWindows needs" in err
    assert f"The state after 3 steps is saved in '{ckpt}'" in err, err[-5000:]
    # The saved state resumes on 2 ranks of MPICH and ends with the uninterrupted loss.
    started = time.monotonic()
    resumed = subprocess.run([sys.executable, "-m", "axonhpc", "launch", "-n", "2", "--", EXAMPLE, *RUN, "--batch",
                              "16", "--resume", str(ckpt)], capture_output=True, text=True, timeout=GUARD, cwd=tmp_path,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
    loss = _final_loss(resumed.stdout)
    assert abs(loss - uninterrupted[16]) <= 1e-10 * abs(uninterrupted[16]), (loss, uninterrupted[16])
    assert time.monotonic() - started < GUARD


def test_the_example_refuses_what_elastic_training_cannot_do(tmp_path):
    for args, text in ((["--simulate-failure", "1:2"], "--simulate-failure needs --elastic"),
                       (["--spares", "1"], "--spares needs --elastic"),
                       (["--elastic", "--dp", "2"], "--elastic sets dp from the ranks left")):
        out = subprocess.run([sys.executable, EXAMPLE, *RUN, *args], capture_output=True, text=True, timeout=GUARD,
                             cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode != 0 and text in out.stderr, out.stderr


@needs_openmpi
@pytest.mark.timeout(300)
def test_the_docs_script_survives_a_kill(tmp_path):
    with open(os.path.join(ROOT, "docs", "fault-tolerance.md")) as f:
        text = f.read()
    script = re.search(r"```python\n(# elastic_steps.py:.*?)```", text, re.S).group(1)
    (tmp_path / "elastic_steps.py").write_text(script)
    cmd = [OPENMPI_PYTHON, "-m", "axonhpc", "launch", "--fault-tolerant", "-n", "3", "--", "elastic_steps.py"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=GUARD, cwd=tmp_path, env=job_env(tmp_path))
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=GUARD, cwd=tmp_path,
                            env=job_env(tmp_path, SIMULATE_FAILURE="1:2"))
    assert plain.returncode == 0 and killed.returncode == 0, plain.stderr[-3000:] + killed.stderr[-3000:]
    assert "recovered" not in plain.stdout
    assert RECOVERED.findall(killed.stdout) and "lost rank 1 at step 3, continuing on 2 ranks" in killed.stdout
    assert abs(_final_loss(killed.stdout) - _final_loss(plain.stdout)) < 1e-5  # float32
