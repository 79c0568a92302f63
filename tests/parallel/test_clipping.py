"""``ax.clip_grad_norm`` on each kind of model: the whole model's norm, as one process computes it."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim


def _model(seed=0):
    return nn.Sequential(nn.Linear(4, 6, dtype=np.float64, seed=seed), nn.Tanh(),
                         nn.Linear(6, 3, dtype=np.float64, seed=seed + 1))


def _reference_norm(x, y, max_norm, norm_type):
    model = _model()
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    return optim.clip_grad_norm(model.parameters(), max_norm, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_every_kind_of_model_gives_the_whole_models_norm(norm_type):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4)), rng.integers(0, 3, 8)
    want = _reference_norm(x, y, 0.01, norm_type)

    def job(world):
        n, r = world.world_size, world.rank
        rows = slice(r * 8 // n, (r + 1) * 8 // n)
        loss_fn = nn.CrossEntropyLoss()
        got = {}
        for kind in ("module", "ddp", "fsdp"):
            model = _model()
            wrapped = {"module": lambda m: m, "ddp": ax.DDP, "fsdp": ax.FSDP}[kind](model)
            if kind == "module":  # every rank the whole batch: nothing to reduce
                loss_fn(wrapped(x), y)
            else:
                loss_fn(wrapped(x[rows]), y[rows])
            wrapped.backward(loss_fn.backward())
            got[kind] = ax.clip_grad_norm(wrapped, 0.01, norm_type)
        whole = _model()
        stages = [nn.Sequential(whole[0], whole[1]), nn.Sequential(whole[2])] if n == 2 else [whole]
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=2, loss_fn=nn.CrossEntropyLoss())
        pipe.train_step(x, y)
        got["pipeline"] = ax.clip_grad_norm(pipe, 0.01, norm_type)
        return got

    for size in (1, 2):
        for got in ax.run_local(job, world_size=size):
            for kind, norm in got.items():
                assert norm == pytest.approx(want, rel=1e-12), (size, kind)


def test_what_it_cannot_clip_is_refused():
    with pytest.raises(ax.errors.ArgumentTypeError, match="takes an FSDP, a Pipeline, a DDP or an axonhpc.nn.Module, "
                                                          "got list"):
        ax.clip_grad_norm([1, 2], 1.0)


def test_a_pipeline_of_tensor_parallel_stages_is_refused_on_every_rank():
    def job(world):
        tp = world.split(0)  # the layers' group: both ranks, as the pipeline's
        stages = [nn.Sequential(ax.ColumnParallelLinear(4, 4, group=tp, dtype=np.float64, seed=0)),
                  nn.Sequential(ax.RowParallelLinear(4, 4, group=tp, dtype=np.float64, seed=1))]
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=1, loss_fn=nn.MSELoss())
        with pytest.raises(ax.errors.ConfigurationError, match=r"tensor-parallel: \['0'\]\), .* not implemented"):
            pipe.clip_grad_norm(1.0)

    ax.run_local(job, world_size=2)


def test_a_nan_max_norm_is_refused_before_anything_is_scaled():
    """No norm is at most NaN: refused as single-process ``optim.clip_grad_norm`` and ``ax.clip_grad_norm`` on a
    module, naming it (the distributed ones alike, on every rank: fsdp_cases)."""
    model = _model()
    for p in model.parameters():
        p.grad = np.ones_like(p.data)
    for clip in (optim.clip_grad_norm, lambda m, v: ax.clip_grad_norm(model, v)):
        with pytest.raises(ax.errors.InvalidArgumentError, match="max_norm must not be NaN, got nan"):
            clip(model.parameters(), float("nan"))
    assert all(np.array_equal(p.grad, np.ones_like(p.data)) for p in model.parameters())
    assert optim.clip_grad_norm(model.parameters(), float("inf")) == pytest.approx(np.sqrt(51))
