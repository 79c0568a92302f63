"""``Pipeline.clip_grad_norm`` over stages holding a ``TensorParallelAttention`` (a block with a group of its own,
built of tensor-parallel linear layers): the unsplit model's norm and clipped gradients, at pp=2 x tp=2 on
threads and on MPI ranks; a layer with parameters of its own split over its group is still refused."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from support.runner import case_tests

BATCH, SEQ, EMBED, HEADS = 4, 3, 4, 2
NORMS = ((0.05, 2.0), (0.1, 1.0), (0.01, float("inf")))


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((BATCH, SEQ, EMBED)), rng.standard_normal((BATCH, SEQ, 2))


def _head():
    return nn.Linear(EMBED, 2, dtype=np.float64, seed=1)


def _reference(max_norm, norm_type):
    """One process: the norm ``optim.clip_grad_norm`` gives over the unsplit model, and its clipped gradients."""
    x, y = _data()
    whole = nn.Sequential(ax.TensorParallelAttention.dense_equivalent(EMBED, HEADS, dtype=np.float64, seed=0),
                          _head())
    loss_fn = nn.MSELoss()
    loss_fn(whole(x), y)
    whole.backward(loss_fn.backward())
    norm = optim.clip_grad_norm(whole.parameters(), max_norm, norm_type)
    return norm, {name: p.grad for name, p in whole.named_parameters()}


def _whole_gradient(layer, param, tp):
    """``param``'s gradient over the whole layer: its parts gathered over ``tp`` where ``layer`` splits it."""
    axis = dict((id(p), a) for p, a in layer.split_axes()).get(id(param))
    if axis is None:
        return param.grad
    parts = ax.all_gather(np.ascontiguousarray(param.grad), tp)
    return np.concatenate(list(parts), axis=axis)


def case_attention_stage_clips_as_the_unsplit_model(world):
    mesh = world.mesh(tp=2, pp=2)
    x, y = _data()
    attn = ax.TensorParallelAttention(EMBED, HEADS, group=mesh.tp, dtype=np.float64, seed=0)
    stages = [nn.Sequential(attn), nn.Sequential(_head())]
    pipe = ax.Pipeline.from_modules(stages, group=mesh.pp, num_microbatches=2, loss_fn=nn.MSELoss())
    for max_norm, norm_type in NORMS:
        want, grads = _reference(max_norm, norm_type)
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x, y)
        norm = pipe.clip_grad_norm(max_norm, norm_type)
        assert want > max_norm  # so the step clips
        np.testing.assert_allclose(norm, want, rtol=1e-12, atol=1e-12, err_msg=f"norm_type={norm_type}")
        for s in pipe.stages:
            for name, layer in pipe.stage_modules[s].named_modules():  # stage s is Sequential(whole[s])
                for pname, p in layer.named_parameters(prefix=f"{s}{name[1:]}", recurse=False):
                    got = _whole_gradient(layer, p, mesh.tp) if hasattr(layer, "split_axes") else p.grad
                    np.testing.assert_allclose(got, grads[pname], rtol=1e-12, atol=1e-12,
                                               err_msg=f"norm_type={norm_type}: {pname}")


class _OwnSplit(nn.Module):
    """A layer with a group of its own and a parameter of its own beside its tensor-parallel one: how that
    parameter is split is not known."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.proj = ax.ColumnParallelLinear(EMBED, EMBED, group=group, gather_output=True, dtype=np.float64,
                                             seed=0)
        self.scale = nn.Parameter(np.ones(EMBED // group.size))

    def forward(self, x):
        return self.proj(x)

    def backward(self, g):
        return self.proj.backward(g)


def case_a_layer_with_a_split_parameter_of_its_own_is_still_refused(world):
    mesh = world.mesh(tp=2, pp=2)
    x, y = _data()
    stages = [nn.Sequential(_OwnSplit(mesh.tp)), nn.Sequential(_head())]
    pipe = ax.Pipeline.from_modules(stages, group=mesh.pp, num_microbatches=2, loss_fn=nn.MSELoss())
    pipe.train_step(x, y)
    if mesh.pp.rank == 0:
        with pytest.raises(ax.errors.ConfigurationError,
                           match=r"stages hold layers split over groups of their own that are not tensor-parallel "
                                 r"linear layers \(\['0'\]\)"):
            pipe.clip_grad_norm(1.0)
    else:
        with pytest.raises(ax.errors.AxonError, match="not tensor-parallel linear layers"):
            pipe.clip_grad_norm(1.0)


CASES = {fn.__name__: fn for fn in (case_attention_stage_clips_as_the_unsplit_model,
                                   case_a_layer_with_a_split_parameter_of_its_own_is_still_refused)}

test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES, sizes=lambda case: (4,), min_size=4)
