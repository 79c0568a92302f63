"""A GPT checkpoint saved under one dp x tp x pp layout resumes under another exactly as an uninterrupted run."""
import os
import subprocess
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.checkpoint import load_model_slices, save_model_slices
from axonhpc.checkpoint.sliced import read_full
from axonhpc.errors import CheckpointError
from support.gpt_parallel_cases import CONFIG, GLOBAL_BATCH, LR, batches, relative_error
from support.paths import ROOT

STEPS, SAVE_AT = 6, 3
DATA = batches(STEPS)


def train(layout, start, stop, save=None, load=None, config=None):
    """Steps [start, stop) on ``layout`` (threads), after loading ``load``; returns the losses (rank 0's).

    ``layout`` is (dp, tp, pp), or (dp, tp, 1, "fsdp") to shard over dp with FSDP.
    """
    dp, tp, pp = layout[:3]
    fsdp = layout[3:] == ("fsdp",)

    def fn(world):
        mesh = world.mesh(dp=dp, tp=tp, pp=pp)
        model = ax.ParallelGPT(mesh, **dict(CONFIG, **(config or {})), num_microbatches=pp, fsdp=fsdp)
        opt = optim.AdamW(model.parameters(), lr=LR)
        if load is not None:
            assert load_model_slices(load, model.parameter_boxes(), opt) == {"step": start}
            model.step = start  # dropout masks are keyed by the step
        b, d = GLOBAL_BATCH // dp, mesh.coords.dp
        losses = []
        for x, y in DATA[start:stop]:
            model.zero_grad()
            losses.append(model.train_step(x[d * b:(d + 1) * b], y[d * b:(d + 1) * b]))
            opt.step()
        if save is not None:
            save_model_slices(save, model.parameter_boxes(), opt, extra={"step": stop})
        return losses

    return ax.run_local(fn, world_size=dp * tp * pp)[0]


@pytest.mark.parametrize("saved,resumed", [
    ((2, 1, 2), (1, 2, 2)),
    ((1, 4, 1), (1, 1, 1)),
    ((1, 1, 1), (1, 1, 4)),
    ((1, 1, 3), (2, 2, 1)),
    ((4, 1, 1), (1, 3, 1)),
    ((2, 1, 1, "fsdp"), (1, 2, 2)),
    ((1, 2, 2), (3, 1, 1, "fsdp")),
    ((3, 1, 1, "fsdp"), (2, 2, 1, "fsdp")),
    ((2, 2, 1, "fsdp"), (1, 1, 1, "fsdp")),
    ((4, 1, 1, "fsdp"), (1, 1, 1)),
], ids=str)
def test_resuming_on_another_layout_continues_as_an_uninterrupted_run(tmp_path, saved, resumed):
    path = str(tmp_path / "ckpt")
    uninterrupted = train(resumed, 0, STEPS)
    first = train(saved, 0, SAVE_AT, save=path)
    rest = train(resumed, SAVE_AT, STEPS, load=path)
    assert relative_error(first + rest, uninterrupted) < 1e-10, (first + rest, uninterrupted)


def test_with_dropout_a_run_resumed_on_another_layout_draws_the_uninterrupted_masks(tmp_path):
    path, config = str(tmp_path / "ckpt"), dict(dropout=0.25)
    uninterrupted = train((1, 2, 2), 0, STEPS, config=config)
    first = train((2, 1, 1, "fsdp"), 0, SAVE_AT, save=path, config=config)
    rest = train((1, 2, 2), SAVE_AT, STEPS, load=path, config=config)
    assert relative_error(first + rest, uninterrupted) < 1e-10, (first + rest, uninterrupted)
    assert relative_error(uninterrupted, train((1, 2, 2), 0, STEPS)) > 1e-3  # the masks did drop something


def test_a_checkpoint_of_any_layout_is_the_whole_model_for_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    train((1, 2, 2), 0, SAVE_AT, save=path)
    arrays, extra = read_full(path)
    assert extra["user"] == {"step": SAVE_AT}
    model = nn.GPT(**CONFIG)
    state = {name[len("model/"):]: a for name, a in arrays.items() if name.startswith("model/")}
    model.load_state_dict(state)
    # Continue in one process from the loaded weights and compare with the parallel run resumed there.
    want = train((1, 1, 1), SAVE_AT, SAVE_AT + 1, load=path)
    opt = optim.AdamW(model.parameters(), lr=LR)
    names = dict(model.named_parameters())
    for i, (name, p) in enumerate(model.named_parameters()):
        opt.state[i] = {"step": int(arrays[f"optimizer/step/{name}"]),
                        "exp_avg": arrays[f"optimizer/exp_avg/{name}"].copy(),
                        "exp_avg_sq": arrays[f"optimizer/exp_avg_sq/{name}"].copy()}
    assert len(names) == len(state)
    loss_fn = nn.CrossEntropyLoss()
    x, y = DATA[SAVE_AT]
    got = loss_fn(model(x), y)
    assert relative_error([got], want) < 1e-10


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    train((1, 1, 2), 0, 1, save=path)
    with pytest.raises(CheckpointError, match="shape"):
        train((1, 2, 1), 1, 2, load=path, config=dict(width=36))


def test_an_optimizer_of_another_kind_is_refused_before_anything_changes(tmp_path):
    path = str(tmp_path / "ckpt")
    train((1, 1, 1), 0, 1, save=path)
    model = nn.GPT(**CONFIG)
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    boxes = {n: (p.data.shape, (0,) * p.data.ndim, p) for n, p in model.named_parameters()}

    def fn(world):
        with pytest.raises(CheckpointError, match="state of a AdamW optimizer, not of this SGD"):
            load_model_slices(path, boxes, optim.SGD(model.parameters(), lr=0.1))

    ax.run_local(fn, world_size=1)
    assert all(np.array_equal(before[n], p.data) for n, p in model.named_parameters())


def _example(n, args, cwd):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *args]
    if n > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(n)] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    finals = [line for line in out.stdout.splitlines() if line.startswith("final loss ")]
    assert len(finals) == 1, out.stdout
    return float(finals[0].split()[-1]), out.stdout


def test_the_example_resumes_tp_pp_and_fsdp_checkpoints_in_one_process(tmp_path):
    small = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "16", "--batch", "8", "--dtype", "float64",
             "--max-bytes", "200000", "--eval-batches", "1"]
    uninterrupted, _ = _example(1, small + ["--steps", "6"], tmp_path)
    _example(4, small + ["--steps", "3", "--tp", "2", "--pp", "2", "--microbatches", "2", "--save", "ck",
                         "--plot", "pics/run"], tmp_path)
    assert (tmp_path / "pics" / "run-loss.png").stat().st_size > 0
    assert (tmp_path / "pics" / "run-pipeline.png").stat().st_size > 0
    resumed, text = _example(1, small + ["--steps", "6", "--resume", "ck"], tmp_path)
    assert "resumed from ck at step 3" in text
    assert abs(resumed - uninterrupted) <= 1e-10 * abs(uninterrupted)
    # FSDP's flat shards, saved in the background every step, resume in one process as well.
    _example(2, small + ["--steps", "4", "--dp", "2", "--fsdp", "--save", "fsdp-ck", "--save-every", "1"], tmp_path)
    resumed, text = _example(1, small + ["--steps", "6", "--resume", "fsdp-ck"], tmp_path)
    assert "resumed from fsdp-ck at step 4" in text
    assert abs(resumed - uninterrupted) <= 1e-10 * abs(uninterrupted)
