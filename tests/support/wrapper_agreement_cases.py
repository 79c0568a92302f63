"""The parallel wrappers check at construction that every rank holds the same model (issue 18): cases.

Each case takes a world, makes one rank build something else (another dtype,
shape, layer count, geometry, or a model that fails its own checks), and
expects every rank to raise: ``ModelMismatchError`` naming the first
parameter that differs and which ranks have which, or, on the rank whose own
checks failed, that rank's own error. Then it proves that nobody was left
waiting (an all-reduce on the group gives the right answer) and that the
same wrapper over the same model still builds. The FSDP optimizer cases
check that an optimizer over the module's own Parameters raises at its first
step on every rank. Used by ``tests/parallel/test_wrapper_agreement.py`` (``run_local``
at several world sizes, and MPI ranks under mpiexec).
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import ConfigurationError, ModelMismatchError, UsageError


def _in_step(world, group=None):
    """Every rank of the group is still in step: an all-reduce of ones gives the group size."""
    pg = group or world.default_group
    y = np.ones(1)
    ax.all_reduce(y, group=pg)
    assert y[0] == pg.size


def _who(ranks, verb_one, verb_many):
    ranks = list(ranks)
    return f"ranks {ranks} {verb_many}" if len(ranks) > 1 else f"rank {ranks[0]} {verb_one}"


def _mlp(last_dtype=np.float32, last_out=3, extra=False):
    layers = [nn.Linear(4, 5, seed=0), nn.Tanh(), nn.Linear(5, last_out, dtype=last_dtype, seed=1)]
    if extra:
        layers += [nn.ReLU(), nn.Linear(last_out, 2, seed=2)]
    return nn.Sequential(*layers)


def _data(world, rows=8):
    rng = np.random.default_rng(world.rank)
    return rng.standard_normal((rows, 4)).astype(np.float32), rng.integers(0, 3, rows)


def case_ddp_names_the_first_parameter_that_differs(world):
    n, last = world.world_size, world.world_size - 1
    model = _mlp(last_dtype=np.float64 if world.rank == last else np.float32)
    if n == 1:
        ax.DDP(model)  # one rank: nothing to compare
        return
    with pytest.raises(ModelMismatchError) as info:
        ax.DDP(model)
    text = str(info.value)
    assert f"DDP over group world: the {n} ranks hold different models" in text, text
    assert "the first difference is parameter '2.weight' (position 2, shown as name:dtype:shape)" in text, text
    assert _who(range(last), "has", "have") + " 2.weight:float32:(3, 5)" in text, text
    assert f"rank {last} has 2.weight:float64:(3, 5)" in text, text
    assert "nothing else was sent" in text
    assert isinstance(info.value, ValueError) and isinstance(info.value, ax.errors.CollectiveMismatchError)
    _in_step(world)
    ax.DDP(_mlp())  # the same model everywhere builds


def case_ddp_a_rank_with_an_extra_layer(world):
    n = world.world_size
    if n == 1:
        return
    with pytest.raises(ModelMismatchError) as info:
        ax.DDP(_mlp(extra=world.rank == 0), bucket_size_mb=25)
    text = str(info.value)
    assert "the first difference is parameter '4.weight' (position 4" in text, text
    assert "rank 0 has 4.weight:float32:(2, 3)" in text, text
    assert _who(range(1, n), "has", "have") + " no parameter there (only 4)" in text, text
    _in_step(world)


def case_ddp_a_rank_whose_model_fails_its_own_check(world):
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    model = nn.Sequential(nn.ReLU()) if world.rank == last else _mlp()
    if world.rank == last:
        with pytest.raises(ConfigurationError, match="DDP needs a module with parameters; Sequential has none"):
            ax.DDP(model)
    else:
        with pytest.raises(ModelMismatchError) as info:
            ax.DDP(model)
        text = str(info.value)
        assert f"rank {last} could not build it (rank {last}: ConfigurationError: DDP needs a " \
               f"module with parameters" in text, text
    _in_step(world)


def case_a_rank_with_an_array_that_cannot_be_sent_in_place(world):
    # One rank's weight in Fortran order, another's buffer read-only: named on that rank, refused on all,
    # before the broadcast of rank 0's values (which waited forever for the rank that raised).
    last = world.world_size - 1
    for wrap in (ax.DDP, ax.FSDP):
        model = _mlp()
        model.register_buffer("stats", np.zeros(3, np.float32))
        if world.rank == last:
            model[0].weight.data = np.asfortranarray(model[0].weight.data)
        label = "DDP" if wrap is ax.DDP else "FSDP"
        mine = (ax.errors.NonContiguousBufferError, rf"{label}: parameter '0.weight' .* is not C-contiguous; make "
                r"it C-contiguous before wrapping the model")
        if world.rank == last:
            with pytest.raises(mine[0], match=mine[1]):
                wrap(model)
        else:
            with pytest.raises(ModelMismatchError, match=f"rank {last} could not build it .*NonContiguousBufferError"):
                wrap(model)
        _in_step(world)
        model = _mlp()
        model.register_buffer("stats", np.zeros(3, np.float32))
        if world.rank == 0:
            model.stats.flags.writeable = False
        if world.rank == 0:
            with pytest.raises(ax.errors.ReadOnlyBufferError, match="buffer 'stats'"):
                wrap(model)
        else:
            with pytest.raises(ModelMismatchError, match="rank 0 could not build it .*ReadOnlyBufferError"):
                wrap(model)
        _in_step(world)


def case_fsdp_names_shapes_and_units(world):
    n, last = world.world_size, world.world_size - 1
    model = _mlp(last_out=4 if world.rank == last else 3)
    if n == 1:
        ax.FSDP(model)
        return
    with pytest.raises(ModelMismatchError) as info:
        ax.FSDP(model)
    text = str(info.value)
    assert text.startswith(f"FSDP over group world: the {n} ranks hold different models"), text
    assert "parameter '2.weight'" in text and f"rank {last} has 2.weight:float32:(4, 5)" in text, text
    _in_step(world)
    # The same parameters, cut into other units on one rank: the units are compared first.
    model = _mlp()
    units = [model[0]] if world.rank == 0 else [model[0], model[2]]
    with pytest.raises(ModelMismatchError) as info:
        ax.FSDP(model, units=units)
    text = str(info.value)
    assert "the first difference is 'units'" in text, text
    assert "rank 0 has units: ['0', '<root>']" in text, text
    assert _who(range(1, n), "has", "have") + " units: ['0', '2']" in text, text
    _in_step(world)
    fsdp = ax.FSDP(_mlp())
    assert len(fsdp.parameters()) == 2


def case_fsdp_a_rank_whose_unit_mixes_dtypes(world):
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    inner = [nn.Linear(2, 2, dtype=np.float32), nn.Linear(2, 2, dtype=np.float64 if world.rank == last else
                                                              np.float32)]
    model = nn.Sequential(nn.Sequential(*inner))
    if world.rank == last:
        with pytest.raises(ConfigurationError, match="mixes parameter dtypes"):
            ax.FSDP(model)
    else:
        with pytest.raises(ModelMismatchError, match=f"rank {last} could not build it .*mixes "
                                                     "parameter dtypes"):
            ax.FSDP(model)
    _in_step(world)


def case_zero_parameters_differ(world):
    n, last = world.world_size, world.world_size - 1
    model = _mlp(last_out=2 if world.rank == last else 3)
    if n == 1:
        ax.ZeroRedundancyOptimizer(optim.SGD, model.parameters(), lr=0.1)
        return
    with pytest.raises(ModelMismatchError) as info:
        ax.ZeroRedundancyOptimizer(optim.SGD, model.parameters(), lr=0.1)
    text = str(info.value)
    assert text.startswith(f"ZeroRedundancyOptimizer over group world: the {n} ranks hold different "), text
    assert "parameter 'params[2]'" in text and f"rank {last} has params[2]:float32:(2, 5)" in text, text
    assert "Every rank must pass the same parameters (the same model's, in the same order)" in text, text
    _in_step(world)


def case_tensor_parallel_geometry(world):
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        ax.ColumnParallelLinear(4, 6, seed=0)
        return
    out = 4 * n if world.rank == last else 2 * n
    with pytest.raises(ModelMismatchError) as info:
        ax.ColumnParallelLinear(4, out, seed=0)
    text = str(info.value)
    assert text.startswith(f"ColumnParallelLinear over group world: the {n} ranks hold different models"), text
    assert "the first difference is 'layer'" in text, text
    assert (_who(range(last), "has", "have") + f" layer: ColumnParallelLinear(in_features=4, out_features={2 * n}, "
            "gather_output=False, bias=True, dtype=float32)") in text, text
    assert f"rank {last} has layer: ColumnParallelLinear(in_features=4, out_features={4 * n}," in text, text
    _in_step(world)
    dtype = np.float64 if world.rank == 0 else np.float32
    with pytest.raises(ModelMismatchError, match=r"rank 0 has layer: RowParallelLinear\(.*dtype=float64\)"):
        ax.RowParallelLinear(2 * n, 3, dtype=dtype, seed=0)
    _in_step(world)
    # seed=None broadcasts: only after the check, so mismatched ranks never reach it.
    with pytest.raises(ModelMismatchError, match="TensorParallelAttention"):
        ax.TensorParallelAttention(8 * n, 2 * n if world.rank else 4 * n)
    _in_step(world)
    # Equal geometry with "float32", np.float32 and a numpy integer alike builds.
    ax.ColumnParallelLinear(np.int64(4), 2 * n, dtype="float32" if world.rank else np.float32)


def case_tensor_parallel_mlp_a_rank_whose_sizes_fail(world):
    n = world.world_size
    if n == 1:
        return
    ffn = 2 * n + 1 if world.rank == 0 else 2 * n
    if world.rank == 0:
        with pytest.raises(ConfigurationError, match=f"TensorParallelMLP ffn_hidden={2 * n + 1} must be"):
            ax.TensorParallelMLP(4, ffn)
    else:
        with pytest.raises(ModelMismatchError, match="rank 0 could not build it .*ffn_hidden"):
            ax.TensorParallelMLP(4, ffn)
    _in_step(world)
    mlp = ax.TensorParallelMLP(4, 2 * n, seed=3)
    assert mlp.fc1.weight.shape == (2, 4)


def case_pipeline_replicas_and_settings(world):
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    # The pipeline's ranks pass other micro-batch counts: every rank raises.
    stages = [nn.Sequential(nn.Linear(4, 4, seed=s)) for s in range(n)]
    with pytest.raises(ModelMismatchError) as info:
        ax.Pipeline.from_modules(stages, num_microbatches=4 if world.rank == 0 else 8)
    text = str(info.value)
    assert "the first difference is 'pipeline'" in text and "rank 0 has pipeline: " in text, text
    assert "num_microbatches=4" in text and "num_microbatches=8" in text
    _in_step(world)
    # One rank gives the wrong stage to from_stages: it raises its own error, the others name it.
    mine = world.rank if world.rank != last else 0
    given = [ax.PipelineStage(stages[mine], mine, n)]
    if world.rank == last and n > 1:
        with pytest.raises(ConfigurationError, match=f"must hold stages \\[{last}\\]"):
            ax.Pipeline.from_stages(given)
    else:
        with pytest.raises(ModelMismatchError, match=f"rank {last} could not build it"):
            ax.Pipeline.from_stages(given)
    _in_step(world)
    # Data-parallel replicas of one stage: the replicas must hold the same parameters.
    mesh = world.mesh(dp=n)
    stage = nn.Sequential(nn.Linear(4, 3 if world.rank == last else 2, seed=0))
    with pytest.raises(ModelMismatchError) as info:
        ax.Pipeline.from_modules([stage], group=mesh.pp, dp_group=mesh.dp, loss_fn=nn.CrossEntropyLoss())
    text = str(info.value)
    assert text.startswith("Pipeline stages [0] over dp_group mesh.dp"), text
    assert "parameter 'stage0.0.weight'" in text and f"rank {last} has stage0.0.weight:float32:(3, 4)" in text
    _in_step(world)
    ax.Pipeline.from_modules([nn.Sequential(nn.Linear(4, 2, seed=0))], group=mesh.pp, dp_group=mesh.dp)


def case_a_long_model_names_the_exact_parameter(world):
    """A difference far past the first 2 KiB of the description is still named exactly."""
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    layers = [nn.Linear(3, 3, seed=k) for k in range(80)]
    if world.rank == last:
        layers[71] = nn.Linear(3, 3, dtype=np.float64, seed=71)
    with pytest.raises(ModelMismatchError) as info:
        ax.DDP(nn.Sequential(*layers), bucket_size_mb=25)
    text = str(info.value)
    assert "parameter '71.weight' (position 142" in text, text
    assert f"rank {last} has 71.weight:float64:(3, 3)" in text, text
    _in_step(world)


def _fsdp_step(world, fsdp):
    x, y = _data(world)
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(fsdp(x), y)
    fsdp.backward(loss_fn.backward())


def case_fsdp_with_an_optimizer_over_the_module_parameters(world):
    model = _mlp()
    fsdp = ax.FSDP(model)
    for wrong in (optim.SGD(model.parameters(), lr=0.1), optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                  optim.Adam(model.parameters(), lr=0.1)):
        _fsdp_step(world, fsdp)
        before = [p.data.copy() for p in fsdp.parameters()]
        with pytest.raises(UsageError) as info:
            wrong.step()
        text = str(info.value)
        assert "'0.weight' is the module's own Parameter, whose gradient FSDP unit '0' reduced into its flat " \
               "shard" in text, text
        assert "optim.SGD(fsdp.parameters(), ...)" in text
        assert all(np.array_equal(p.data, b) for p, b in zip(fsdp.parameters(), before))
        fsdp.zero_grad()
        _in_step(world)
    right = optim.SGD(fsdp.parameters(), lr=0.1)
    for _ in range(2):  # FSDP drops its markers before each backward: training goes on
        right.zero_grad()
        _fsdp_step(world, fsdp)
        before = [p.data.copy() for p in fsdp.parameters()]
        right.step()
        assert any(not np.array_equal(p.data, b) for p, b in zip(fsdp.parameters(), before))
    with fsdp.no_sync():  # an accumulating backward leaves real gradients; the next one reduces them
        _fsdp_step(world, fsdp)
    _fsdp_step(world, fsdp)
    right.step()
    _in_step(world)


def case_zero_over_fsdp_parameters(world):
    model = _mlp()
    fsdp = ax.FSDP(model)
    with pytest.raises(UsageError, match=r"params\[0\] is the module Parameter '0.weight' of FSDP unit '0'; FSDP "
                                         r"already shards"):
        ax.ZeroRedundancyOptimizer(optim.SGD, model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"params\[0\] is the flat shard of FSDP unit '0'"):
        ax.ZeroRedundancyOptimizer(optim.SGD, fsdp.parameters(), lr=0.1)
    _in_step(world)
    fsdp.remove_hooks()  # the module's Parameters are its own again
    ax.ZeroRedundancyOptimizer(optim.SGD, model.parameters(), lr=0.1)


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
