"""``DistributedTrainer(fault_tolerance="shrink")``: a real SIGKILL in a trainer run, survived with the same loss.

Each run is ``examples/train_digits.py --elastic`` in float64, started as a user
would (``axonhpc launch --fault-tolerant`` with .venv-openmpi), with an outer
timeout. Every run keeps a global batch of 48 samples, so each must end with
the final test loss of the uninterrupted run on 2 ranks to 1e-10 (the steps
see the same samples at every width); a run that cannot go on must end, on
every rank, with a ``RecoveryError`` that says why.
"""
import ast
import os
import re

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import ConfigurationError
from test_elastic import RECOVERED, launch_fault_tolerant
from support.openmpi import needs_openmpi
from support.paths import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
RUN = ["--elastic", "--epochs", "2", "--dtype", "float64"]


def _digits(tmp_path, n, *args):
    return launch_fault_tolerant(tmp_path, n, EXAMPLE, [*RUN, "--checkpoint-dir", str(tmp_path / "ckpt"), *args],
                                 "final test loss")


def _final_loss(text):
    losses = re.findall(r"^final test loss (\S+)$", text, re.M)
    assert len(losses) == 1, text  # rank 0 of the survivors alone prints it
    return float(losses[0])


def _epoch_losses(text):
    """The epochs' mean training losses rank 0 reported (4 decimals)."""
    return re.findall(r"^epoch +\d+ +loss (\S+)", text, re.M)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final test loss and the epochs' losses of the run with no failure, on 2 ranks of 24 samples each."""
    code, out, err = _digits(tmp_path_factory.mktemp("plain"), 2, "--batch-size", "24")
    assert code == 0 and "recovered" not in out, out[-3000:] + err[-3000:]
    return _final_loss(out), _epoch_losses(out)


@needs_openmpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,strategy,failure,extra,lines", [
    (3, "ddp", "2:30", [], [("2", 31, 2)]),                              # in the forward, in the second epoch
    (4, "fsdp", "1:10:backward", [], [("1", 11, 3)]),                    # in the backward's gradient sync
    (4, "ddp", "0:11", [], [("0", 12, 3)]),                              # rank 0, the one that prints
    (3, "fsdp", "1:10:optimizer", [], [("1", 12, 2)]),                   # after the step's communication
    (4, "fsdp", "3:20:save", ["--checkpoint-every", "5"], [("3", 21, 3)]),   # as a checkpoint save starts
    (4, "ddp", "1:10:optimizer,3:40", [], [("1", 12, 3), ("3", 41, 2)]),  # twice
    (4, "fsdp", "1:12,3:12", [], [("1, 3", 13, 2)]),                      # two at once, not each other's buddy
    (4, "fsdp", "0:35:save", ["--spares", "1", "--checkpoint-every", "5"], [("0", 36, 3)]),  # a spare takes over
    (3, "ddp", "2:10", ["--respawn"], [("2", 11, 3)]),                   # a replacement is spawned
    (3, "fsdp", "0:10:backward", ["--respawn"], [("0", 11, 3)]),
    (4, "fsdp", "1:10,3:10:restore", [], [("1, 3", 11, 2)]),              # another dies as the state is gathered
    (4, "ddp", "1:10,2:10:agree", [], [("1, 2", 11, 2)]),                 # ... as the survivors agree on the step
    (4, "ddp", "1:10,2:10:split", ["--spares", "1"], [("1, 2", 11, 2)]),   # ... in the Split that brings the spare in
])
def test_a_killed_rank_is_survived_by_the_trainer_with_the_uninterrupted_loss(tmp_path, uninterrupted, n, strategy,
                                                                             failure, extra, lines):
    spares = int(extra[extra.index("--spares") + 1]) if "--spares" in extra else 0
    batch = 48 // (n - spares)
    code, out, err = _digits(tmp_path, n, "--strategy", strategy, "--batch-size", str(batch), "--simulate-failure",
                             failure, *extra)
    assert code == 0, out[-3000:] + err[-5000:]
    assert [(ranks, int(at), int(dp)) for ranks, at, _, dp, _ in RECOVERED.findall(out)] == lines, out[-3000:]
    loss = _final_loss(out)
    assert abs(loss - uninterrupted[0]) <= 1e-10 * abs(uninterrupted[0]), (loss, uninterrupted)
    assert _epoch_losses(out) == uninterrupted[1] == ["1.7702", "0.5576"], out[-3000:]  # whoever holds rank 0


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_replacement_that_dies_is_replaced_in_turn(tmp_path, uninterrupted):
    code, out, err = launch_fault_tolerant(
        tmp_path, 3, EXAMPLE, [*RUN, "--checkpoint-dir", str(tmp_path / "ckpt"), "--strategy", "fsdp", "--batch-size",
                               "16", "--respawn", "--simulate-failure", "1:10,3:20:backward"],
        "final test loss")
    # Once a spawned process was killed, Open MPI's launcher ends with 137, and sometimes the last replacement
    # waits in MPI_Finalize (ompi_dpm_dyn_finalize) for good: axonhpc launch ends the job, and exits with the ranks'
    # verdict, 0, saying why.
    assert code == 0, out[-3000:] + err[-5000:]
    assert "mpiexec exited with 137, but every rank of the job finished or was recovered from (lost: 1, 3)" in err \
        or "mpiexec exited" not in err, err[-5000:]
    assert [(ranks, int(at), int(dp)) for ranks, at, _, dp, _ in RECOVERED.findall(out)] == [("1", 11, 3), ("3", 21, 3)]
    loss = _final_loss(out)
    assert abs(loss - uninterrupted[0]) <= 1e-10 * abs(uninterrupted[0]), (loss, uninterrupted)


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_shard_lost_with_its_buddy_ends_every_trainer_with_the_reason(tmp_path):
    code, out, err = _digits(tmp_path, 4, "--strategy", "fsdp", "--batch-size", "12", "--simulate-failure", "1:5,2:5")
    assert code != 0 and "final test loss" not in out
    assert "RecoveryError: FSDP shards are lost with their buddy copies: dp rank 1 and its keeper 2 both failed" in err, \
        err[-5000:]


@needs_openmpi
@pytest.mark.timeout(300)
def test_a_global_batch_the_survivors_cannot_split_ends_with_the_reason(tmp_path):
    code, out, err = _digits(tmp_path, 4, "--batch-size", "10", "--simulate-failure", "1:5")
    assert code != 0 and "final test loss" not in out
    assert ("RecoveryError: after the loss of rank 1 the run cannot go on on 3 ranks: the global batch of 40 samples "
            "does not split evenly over 3 data-parallel ranks") in err, err[-5000:]
    assert f"The state after 5 steps is saved in '{tmp_path / 'ckpt' / 'whole-state'}'" in err, err[-5000:]


@needs_openmpi
@pytest.mark.timeout(300)
def test_the_docstrings_fault_tolerant_command_runs(tmp_path):
    """The ``axonhpc launch --fault-tolerant`` line of the example's docstring survives its failure (3 epochs)."""
    with open(EXAMPLE) as f:
        docstring = ast.get_docstring(ast.parse(f.read()))
    line = next(x for x in docstring.splitlines() if "launch --fault-tolerant" in x).split()
    assert line[:4] == ["axonhpc", "launch", "--fault-tolerant", "-n"] and line[5:7] == ["--", "examples/train_digits.py"]
    n, args = int(line[4]), line[7:]
    code, out, err = launch_fault_tolerant(tmp_path, n, EXAMPLE, [*args, "--epochs", "3", "--checkpoint-dir",
                                                                  str(tmp_path / "ckpt")], "final test loss")
    assert code == 0, out[-3000:] + err[-5000:]
    assert [(ranks, int(dp)) for ranks, _, _, dp, _ in RECOVERED.findall(out)] == [("2", n - 1)], out[-3000:]
    assert "final test accuracy" in out


def _trainer(**kwargs):
    model = nn.Sequential(nn.Linear(4, 2, seed=0))
    return ax.DistributedTrainer(model, optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), progress=False, **kwargs)


@pytest.mark.parametrize("kwargs,text", [
    (dict(fault_tolerance="restart"), "fault_tolerance must be None or 'shrink', got 'restart'"),
    (dict(simulate_failure="1:2"), "simulate_failure='1:2', spares=0 and respawn=False need fault_tolerance='shrink'"),
    (dict(spares=1), "simulate_failure=None, spares=1 and respawn=False need fault_tolerance='shrink'"),
    (dict(fault_tolerance="shrink", strategy="pipeline"), "strategy must be one of ['ddp', 'fsdp'], got 'pipeline'"),
    (dict(fault_tolerance="shrink"), "needs fault tolerance: ax.init(fault_tolerant=True)"),
])
def test_the_trainer_refuses_fault_tolerance_it_cannot_give(kwargs, text):
    with pytest.raises(ConfigurationError) as info:
        _trainer(**kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize("kwargs,text", [
    (dict(simulate_failure="1"), "simulate_failure '1': expected RANK:STEPS[:WHERE]"),
    (dict(spares=-1), "spares must be an int >= 0, got -1"),
])
def test_the_trainer_refuses_bad_fault_tolerance_options(monkeypatch, kwargs, text):
    monkeypatch.setattr(ax.settings, "fault_tolerant", True)
    with pytest.raises(ConfigurationError) as info:
        _trainer(fault_tolerance="shrink", **kwargs)
    assert text in str(info.value)


def test_a_shrinking_run_takes_the_same_samples_at_every_width():
    """The ranks' k-th batches are the same global batch whatever the width (``trainer.shrink``'s note)."""
    from axonhpc.data import DistributedSampler

    n, global_batch = 103, 12
    for width in (1, 2, 3, 4, 6):
        b = global_batch // width
        parts = [DistributedSampler(n, width, r, shuffle=True, seed=5, drop_last=True).indices() for r in range(width)]
        for k in range(n // global_batch):
            together = np.sort(np.concatenate([p[k * b:(k + 1) * b] for p in parts]))
            whole = DistributedSampler(n, 1, 0, shuffle=True, seed=5, drop_last=True).indices()
            assert np.array_equal(together, np.sort(whole[k * global_batch:(k + 1) * global_batch])), (width, k)


@needs_openmpi
@pytest.mark.timeout(300)
def test_the_docs_trainer_script_survives_a_kill_with_the_same_loss(tmp_path, monkeypatch):
    with open(os.path.join(ROOT, "docs", "fault-tolerance.md")) as f:
        script = re.search(r"```python\n(# shrink_fit.py:.*?)```", f.read(), re.S).group(1)
    (tmp_path / "shrink_fit.py").write_text(script)
    losses = []
    for failure in ("", "2:7"):
        monkeypatch.setenv("SIMULATE_FAILURE", failure)  # the job's environment is a copy of this one
        code, out, err = launch_fault_tolerant(tmp_path, 3, "shrink_fit.py", [], "final loss")
        assert code == 0, out[-3000:] + err[-3000:]
        assert ("lost rank 2 at step 8, continuing on 2 ranks" in out) == bool(failure), out[-3000:]
        losses.append(float(re.search(r"^final loss (\S+) after", out, re.M).group(1)))
    assert abs(losses[1] - losses[0]) <= 1e-10 * abs(losses[0]), losses
