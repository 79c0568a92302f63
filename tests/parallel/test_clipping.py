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


def _stage(index, tp=None):
    """Stage 0: an MLP and a LayerNorm (whole on every rank of the tp group); stage 1: an MLP and a Linear. The
    MLPs are tensor-parallel over ``tp``, or their dense equivalents without it."""
    mlp = (ax.TensorParallelMLP(4, 8, group=tp, dtype=np.float64, seed=10 + index) if tp is not None
           else ax.TensorParallelMLP.dense_equivalent(4, 8, dtype=np.float64, seed=10 + index))
    last = nn.LayerNorm(4, dtype=np.float64) if index == 0 else nn.Linear(4, 3, dtype=np.float64, seed=30)
    return nn.Sequential(mlp, last)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_a_pipeline_of_tensor_parallel_stages_gives_the_whole_models_norm(norm_type):
    # Refused before: a sum over the pipeline alone would count the whole parameters once per tp rank.
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 4)), rng.integers(0, 3, 8)
    whole = nn.Sequential(_stage(0), _stage(1))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(whole(x), y)
    whole.backward(loss_fn.backward())
    want = optim.clip_grad_norm(whole.parameters(), 0.01, norm_type)

    def job(world):
        mesh = world.mesh(pp=2, tp=2)
        index = mesh.pp.rank
        stage = ax.PipelineStage(_stage(index, mesh.tp), index, 2)
        pipe = ax.Pipeline.from_stages([stage], group=mesh.pp, num_microbatches=2, loss_fn=nn.CrossEntropyLoss())
        pipe.train_step(x, y)
        return ax.clip_grad_norm(pipe, 0.01, norm_type)

    assert ax.run_local(job, world_size=4) == pytest.approx([want] * 4, rel=1e-12)


def _clip_on_a_mesh(world, max_norm):
    mesh = world.mesh(pp=2, tp=2)
    index = mesh.pp.rank
    pipe = ax.Pipeline.from_stages([ax.PipelineStage(_stage(index, mesh.tp), index, 2)], group=mesh.pp,
                                   num_microbatches=1, loss_fn=nn.CrossEntropyLoss())
    pipe.train_step(np.ones((2, 4)), np.zeros(2, dtype=np.int64))
    try:
        pipe.clip_grad_norm(max_norm)
    except ax.errors.AxonError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_refusal_in_a_pipeline_of_tensor_parallel_stages_reaches_every_rank():
    # The last rank's NaN max_norm: its tp peer hears it in the tp group's check, the other stage's ranks in
    # the pipeline's; none waits.
    got = ax.run_local(lambda world: _clip_on_a_mesh(world, np.nan if world.rank == 3 else 1.0), world_size=4)
    assert got[3][0] == "InvalidArgumentError" and "max_norm must not be NaN" in got[3][1], got[3]
    for kind, text in got[:3]:
        assert kind == "CollectiveRefusedError" and "rank 3 refused" in text, text
    # Another max_norm on the last rank: its tp group finds the difference, and tells the other stage's ranks.
    got = ax.run_local(lambda world: _clip_on_a_mesh(world, 0.5 if world.rank == 3 else 1.0), world_size=4)
    for kind, text in got[2:]:
        assert kind == "CollectiveMismatchError" and "max_norm from 0.5 to 1" in text, text
    for kind, text in got[:2]:
        assert kind == "CollectiveRefusedError" and "max_norm from 0.5 to 1" in text, text


def test_a_tensor_parallel_group_across_the_pipelines_stages_is_refused_on_every_rank():
    def job(world):
        tp = world.split(0)  # the layers' group: both ranks, the pipeline's too
        stages = [nn.Sequential(ax.ColumnParallelLinear(4, 4, group=tp, dtype=np.float64, seed=0)),
                  nn.Sequential(ax.RowParallelLinear(4, 4, group=tp, dtype=np.float64, seed=1))]
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=1, loss_fn=nn.MSELoss())
        with pytest.raises(ax.errors.ConfigurationError, match=r"the tensor-parallel group .* shares ranks with "
                                                               r"this pipeline \[0, 1\] other than this one"):
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
