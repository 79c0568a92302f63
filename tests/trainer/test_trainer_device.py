"""DistributedTrainer on device arrays (the main job's ``--device cuda``), without a GPU.

The model is moved with ``model.to("cuda")`` and the data is handed over as
device arrays of ``fake_cuda``'s strict cupy stand-in (it refuses implicit
conversion to numpy, as cupy does); two thread ranks run DDP over the fake
NCCL. The metrics must equal those of the same run on numpy arrays.
"""
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from support.fake_cuda import FakeCupy, run_device_world


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 8)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return x, y


def _train(world, to_device, checkpoint_dir, epochs, strategy="ddp"):
    x, y = _data()
    model = nn.Sequential(nn.Linear(8, 16, seed=0), nn.ReLU(), nn.Linear(16, 2, seed=1))
    if to_device is not None:
        model.to("cuda")
        x, y = to_device(x), to_device(y)
    trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                                    strategy=strategy, verbose=False, progress=False, skip_nonfinite_steps=True)
    records = trainer.fit((x, y), epochs, eval_arrays=(x, y), batch_size=8, checkpoint_dir=checkpoint_dir)
    return [(r["loss"], r["eval_loss"], r["eval_accuracy"]) for r in records], trainer.evaluate((x, y), 32)


def test_fit_and_evaluate_on_device_arrays_match_the_host_run(fake_cupy, tmp_path):
    host = ax.run_local(lambda w: _train(w, None, str(tmp_path / "host"), 3), world_size=2)
    dev = run_device_world(lambda w: _train(w, fake_cupy.asarray, str(tmp_path / "dev"), 3), 2)
    assert dev[0] == dev[1]
    (records, final), (host_records, host_final) = dev[0], host[0]
    np.testing.assert_allclose(records, host_records, rtol=1e-6)
    assert final["accuracy"] == host_final["accuracy"] > 0.7


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "pipeline"])
def test_the_other_strategies_on_device_arrays_match_the_host_run(fake_cupy, tmp_path, strategy, n):
    """FSDP, ZeRO-1 and the pipeline (its activations over the fake NCCL's point-to-point messages)."""
    host = ax.run_local(lambda w: _train(w, None, str(tmp_path / "host"), 2, strategy), world_size=n)
    dev = run_device_world(lambda w: _train(w, fake_cupy.asarray, str(tmp_path / "dev"), 2, strategy), n)
    assert all(d == dev[0] for d in dev)
    np.testing.assert_allclose(dev[0][0], host[0][0], rtol=1e-5)
    assert dev[0][1]["accuracy"] == host[0][1]["accuracy"]


def test_a_device_run_resumes_from_its_checkpoint(fake_cupy, tmp_path):
    straight = run_device_world(lambda w: _train(w, fake_cupy.asarray, str(tmp_path / "a"), 3), 2)
    run_device_world(lambda w: _train(w, fake_cupy.asarray, str(tmp_path / "b"), 2), 2)
    resumed = run_device_world(lambda w: _train(w, fake_cupy.asarray, str(tmp_path / "b"), 3), 2)
    assert len(resumed[0][0]) == 1  # only the third epoch ran
    assert resumed[0][0][0] == straight[0][0][2] and resumed[0][1] == straight[0][1]


def test_a_bad_device_target_on_one_rank_is_refused_on_both_before_the_update(fake_cupy):
    """The target check of a device batch is read as the step's deferred reads end; the vote after it raises on
    both ranks, and neither has stepped its optimizer."""
    x, y = _data()
    model_values = []

    def body(world):
        model = nn.Sequential(nn.Linear(8, 16, seed=0), nn.ReLU(), nn.Linear(16, 2, seed=1))
        model.to("cuda")
        trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                                        verbose=False, progress=False)
        bad = y.copy()
        if world.rank == 1:
            bad[:] = 5  # every batch of rank 1: refused at the first step
        before = {k: fake_cupy.asnumpy(v) for k, v in trainer.model.state_dict().items()}
        expected = ax.errors.ShapeError if world.rank == 1 else ax.errors.CollectiveRefusedError
        match = (r"targets must be in \[0, 2\), got values in \[5, 5\]" if world.rank == 1 else
                 r"the training step refused the batch of rank 1 \(world numbering\): ShapeError")
        with pytest.raises(expected, match=match):
            trainer.fit((fake_cupy.asarray(x), fake_cupy.asarray(bad)), 1, batch_size=8)
        after = {k: fake_cupy.asnumpy(v) for k, v in trainer.model.state_dict().items()}
        model_values.append((before, after))
        return trainer.global_step

    assert run_device_world(body, 2) == [0, 0]
    for before, after in model_values:
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
