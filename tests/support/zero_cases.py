"""ZeroRedundancyOptimizer cases, written once, run on threads (plain pytest) and on MPI ranks.

Every parity case trains a model with DDP + ZeroRedundancyOptimizer on each
rank's shard of a global batch and a single-process reference with the
plain optimizer on the whole batch, with the same seeds and data, and
compares the parameters after several steps.
"""
import math

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import StateDictError
from support.ddp_cases import GLOBAL_BATCH, STEPS, TOL, make_data, make_model, shard, train_reference

# The wrapped optimizers: the same hyperparameters as ddp_cases.make_optimizer, plus AdamW.
OPTIMIZERS = {
    "sgd": (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": (optim.Adam, dict(lr=1e-2)),
    "adamw": (optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
}
STATE_ARRAYS = {"sgd": 1, "adam": 2, "adamw": 2}  # K: state arrays per parameter element


def _two_dtype_model(seed=0):
    # float32 layers around a float64 one: the float32 group is not contiguous in the model.
    return nn.Sequential(nn.Linear(6, 8, dtype=np.float32, seed=seed), nn.Tanh(),
                         nn.Linear(8, 5, dtype=np.float64, seed=seed + 1), nn.Tanh(),
                         nn.Linear(5, 3, dtype=np.float32, seed=seed + 2))


def _tiny_model(seed=0):
    # 2 elements: at world size 3 and 4 the last ranks own only padding.
    return nn.Sequential(nn.Linear(1, 1, dtype=np.float64, seed=seed))


def _tiny_data(step, dtype=np.float64):
    rng = np.random.default_rng(200 + step)
    x = rng.standard_normal((GLOBAL_BATCH, 1)).astype(dtype)
    return x, (3.0 * x - 1.0 + 0.1 * rng.standard_normal((GLOBAL_BATCH, 1))).astype(dtype)


def _train(world, kind, build, data, loss_fn, steps, zero=True, start=0, model=None):
    """Train ``build(seed)`` under DDP (+ ZeRO) on this rank's shard of each batch; reference if world is None."""
    cls, kwargs = OPTIMIZERS[kind]
    if world is None:
        model = build(0) if model is None else model
        opt = cls(model.parameters(), **kwargs)
        step_fn = model
        backward = model.backward
        n, r = 1, 0
    else:
        n, r = world.world_size, world.rank
        if model is None:
            model = build(0 if r == 0 else 1000 + r)  # DDP must copy rank 0's values
        ddp = ax.DDP(model)
        opt = ax.ZeroRedundancyOptimizer(cls, ddp.parameters(), **kwargs) if zero else cls(ddp.parameters(), **kwargs)
        step_fn, backward = ddp, ddp.backward
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = data(step)
        loss_fn(step_fn(shard(x, r, n)), shard(y, r, n))
        backward(loss_fn.backward())
        opt.step()
    return model, opt


def _assert_close(model, reference, rtol):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.data.dtype == q.data.dtype, name
        np.testing.assert_allclose(p.data, q.data, rtol=rtol, atol=rtol, err_msg=name)


def _parity(world, dtype, kind):
    r = world.rank
    model = make_model(dtype, seed=0 if r == 0 else 1000 + r)
    arrays = [p.data for p in model.parameters()]
    model, opt = _train(world, kind, None, lambda s: make_data(s, dtype), nn.CrossEntropyLoss(), STEPS,
                        model=model)
    assert all(p.data is a for p, a in zip(model.parameters(), arrays))  # updated in place, never rebound
    if kind in ("sgd", "adam"):
        reference = train_reference(dtype, kind)
    else:
        reference, _ = _train(None, kind, lambda seed: make_model(dtype, seed), lambda s: make_data(s, dtype),
                              nn.CrossEntropyLoss(), STEPS)
    _assert_close(model, reference, TOL[dtype])
    # replicas hold the same values bit for bit
    for p in model.parameters():
        everyone = ax.all_gather(p.data)
        assert all(np.array_equal(everyone[0], row) for row in everyone)
    return opt


def case_parity_sgd_float64(world):
    _parity(world, np.float64, "sgd")


def case_parity_adam_float64(world):
    _parity(world, np.float64, "adam")


def case_parity_adam_float32(world):
    _parity(world, np.float32, "adam")


def case_parity_sgd_float32(world):
    _parity(world, np.float32, "sgd")


def case_parity_adamw_float64(world):
    _parity(world, np.float64, "adamw")


def case_two_dtypes(world):
    data = lambda s: make_data(s, np.float64)  # noqa: E731
    model, opt = _train(world, "adam", _two_dtype_model, data, nn.CrossEntropyLoss(), STEPS)
    reference, _ = _train(None, "adam", _two_dtype_model, data, nn.CrossEntropyLoss(), STEPS)
    _assert_close(model, reference, TOL[np.float32])
    ranges = opt.shard_ranges()
    assert [s["dtype"] for s in ranges] == ["float32", "float64"]  # first-appearance order
    assert [s["numel"] for s in ranges] == [6 * 8 + 8 + 5 * 3 + 3, 8 * 5 + 5]
    assert len(opt.optimizer.params) == 2  # one shard Parameter per dtype
    for s, p in zip(ranges, opt.optimizer.params):
        assert p.data.dtype == np.dtype(s["dtype"]) and p.data.size == math.ceil(s["numel"] / world.world_size)


def case_ranks_owning_only_padding(world):
    n, r = world.world_size, world.rank
    model, opt = _train(world, "sgd", _tiny_model, _tiny_data, nn.MSELoss(), STEPS)
    reference, _ = _train(None, "sgd", _tiny_model, _tiny_data, nn.MSELoss(), STEPS)
    _assert_close(model, reference, TOL[np.float64])
    (s,) = opt.shard_ranges()
    assert s["numel"] == 2 and s["stop"] - s["start"] == math.ceil(2 / n)
    assert s["pad"] == (s["stop"] - s["start"] if r >= 2 else 0)
    shard = opt.optimizer.params[0].data
    if s["pad"]:
        assert np.all(shard[shard.size - s["pad"]:] == 0)  # padding stays zero
        assert np.all(opt.optimizer.state[0]["momentum_buffer"][shard.size - s["pad"]:] == 0)


def _memory(world, kind):
    n = world.world_size
    model, opt = _train(world, kind, lambda seed: make_model(np.float64, seed),
                        lambda s: make_data(s, np.float64), nn.CrossEntropyLoss(), 1)
    total = sum(p.size for p in model.parameters())
    k = STATE_ARRAYS[kind]
    measured = opt.memory_bytes()
    assert measured == math.ceil(total / n) * k * 8  # at most ceil(total/N) * K * itemsize, and exactly that
    # the same model with the unsharded optimizer after one step
    _, plain = _train(None, kind, lambda seed: make_model(np.float64, seed), lambda s: make_data(s, np.float64),
                      nn.CrossEntropyLoss(), 1)
    unsharded = sum(v.nbytes for entry in plain.state for v in entry.values() if hasattr(v, "nbytes"))
    assert unsharded == total * k * 8
    if n > 1:
        assert measured < unsharded
    everyone = ax.all_gather(np.array([measured], dtype=np.int64))
    assert int(everyone.sum()) == ax.bucketing.padded_size(total, n) * k * 8  # the ranks' shards tile the state


def case_memory_sgd(world):
    _memory(world, "sgd")


def case_memory_adam(world):
    _memory(world, "adam")


def case_memory_two_dtypes(world):
    n = world.world_size
    data = lambda s: make_data(s, np.float64)  # noqa: E731
    _, opt = _train(world, "adam", _two_dtype_model, data, nn.CrossEntropyLoss(), 1)
    bound = 2 * (math.ceil(74 / n) * 4 + math.ceil(45 / n) * 8)  # K=2; 74 float32 and 45 float64 elements
    assert 0 < opt.memory_bytes() <= bound


def _is_plain(value):
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    return isinstance(value, (np.ndarray, int, float, str, bool)) or value is None


def _run_steps(world, ddp, opt, data, steps):
    n, r = world.world_size, world.rank
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        opt.zero_grad()
        x, y = data(step)
        loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
        ddp.backward(loss_fn.backward())
        opt.step()


def case_state_dict_round_trip(world):
    r = world.rank
    cls, kwargs = OPTIMIZERS["adam"]
    data = lambda s: make_data(s, np.float64)  # noqa: E731
    model = make_model(np.float64, seed=0)
    ddp = ax.DDP(model)
    opt = ax.ZeroRedundancyOptimizer(cls, ddp.parameters(), **kwargs)
    _run_steps(world, ddp, opt, data, range(3))
    saved_model = model.state_dict()
    saved = opt.state_dict()
    assert _is_plain(saved)
    assert saved["rank"] == r and saved["world_size"] == world.world_size
    assert saved["shards"] == opt.shard_ranges()
    _run_steps(world, ddp, opt, data, range(3, 6))  # the uninterrupted run
    # a resumed run: other initial values and lr, wrapped first, then both states restored
    fresh = make_model(np.float64, seed=50 + r)
    fresh_ddp = ax.DDP(fresh)
    resumed = ax.ZeroRedundancyOptimizer(cls, fresh_ddp.parameters(), lr=0.5)
    fresh.load_state_dict(saved_model)
    resumed.load_state_dict(saved)
    assert resumed.lr == kwargs["lr"]  # hyperparameters come back too
    _run_steps(world, fresh_ddp, resumed, data, range(3, 6))
    for (name, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)


def case_state_dict_through_a_checkpoint_file(world):
    import os
    import shutil
    import tempfile

    from axonhpc import checkpoint

    _, opt = _train(world, "adam", lambda seed: make_model(np.float64, seed), lambda s: make_data(s, np.float64),
                    nn.CrossEntropyLoss(), 2)
    saved = opt.state_dict()
    me = world.split(world.rank)  # each rank writes its own shard: a one-rank group each
    directory = tempfile.mkdtemp()
    try:
        path = os.path.join(directory, f"zero-rank{world.rank}.npz")
        checkpoint.save(path, saved, group=me)
        opt.load_state_dict(checkpoint.load(path, group=me))
    finally:
        shutil.rmtree(directory)
    for mine, theirs in zip(opt.optimizer.state, saved["optimizer"]["state"]):
        assert mine["step"] == theirs["step"] == 2
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(mine[key], theirs[key])


def case_state_dict_from_another_rank_is_refused(world):
    if world.world_size == 1:
        return
    _, opt = _train(world, "sgd", lambda seed: make_model(np.float64, seed), lambda s: make_data(s, np.float64),
                    nn.CrossEntropyLoss(), 1)
    other = opt.state_dict()
    other["rank"] = (world.rank + 1) % world.world_size
    start, stop = other["shards"][0]["start"], other["shards"][0]["stop"]
    other["shards"][0]["start"], other["shards"][0]["stop"] = start + 7, stop + 7
    before = [v.copy() for v in opt.optimizer.state[0].values() if hasattr(v, "shape")]
    with pytest.raises(StateDictError, match=f"saved by rank {other['rank']} of {world.world_size}"):
        opt.load_state_dict(other)
    after = [v for v in opt.optimizer.state[0].values() if hasattr(v, "shape")]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # nothing changed


def case_hyperparameters_pass_through(world):
    _, opt = _train(world, "sgd", lambda seed: make_model(np.float64, seed), lambda s: make_data(s, np.float64),
                    nn.CrossEntropyLoss(), 1)
    assert opt.lr == 0.1 and opt.momentum == 0.9 and opt.nesterov is True
    opt.lr = 0.01
    assert opt.optimizer.lr == 0.01 and opt.hyperparameters()["lr"] == 0.01
    assert "lr" not in vars(opt)  # forwarded, not shadowed
    with pytest.raises(AttributeError, match="betas"):
        opt.betas  # noqa: B018 - SGD has no betas


def case_no_gradients_no_step(world):
    model = make_model(np.float64, seed=0)
    ddp = ax.DDP(model)
    opt = ax.ZeroRedundancyOptimizer(optim.Adam, ddp.parameters(), lr=0.1)
    before = [p.data.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    opt.step()  # nothing stepped (no state made); the unchanged slices are gathered on every rank
    assert opt.memory_bytes() == 0
    assert all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))
    # zero_grad resets the model's gradients
    for p in model.parameters():
        p.grad = np.ones_like(p.data)
    opt.zero_grad()
    assert all(np.all(p.grad == 0) for p in model.parameters())
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def _stepped_once(world, kind="sgd"):
    """DDP + ZeRO over ``make_model`` after one backward (the same gradients on every rank), and its values."""
    model = make_model(np.float64, seed=0)
    ddp = ax.DDP(model)
    cls, kwargs = OPTIMIZERS[kind]
    opt = ax.ZeroRedundancyOptimizer(cls, ddp.parameters(), **kwargs)
    x, y = make_data(0, np.float64)
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(ddp(shard(x, world.rank, world.world_size)), shard(y, world.rank, world.world_size))
    ddp.backward(loss_fn.backward())
    return model, opt, [p.data.copy() for p in model.parameters()]


def _in_step(world):
    """Every rank is still in step: an all-reduce of ones gives the world size."""
    y = np.ones(1)
    ax.all_reduce(y)
    assert y[0] == world.world_size


def case_wrong_gradient_shape_is_refused_on_every_rank(world):
    """One rank's gradient of the wrong shape: it raises ShapeError, the others CollectiveRefusedError naming it
    (not a wait in the all-gather); nothing changes anywhere, and the next step works."""
    bad = world.world_size - 1
    model, opt, before = _stepped_once(world)
    good = model.parameters()[2].grad
    if world.rank == bad:
        model.parameters()[2].grad = np.zeros(3)
    if world.rank == bad or world.world_size == 1:
        with pytest.raises(ax.errors.ShapeError,
                           match=r"params\[2\]\.grad has shape \(3,\), the parameter has \(8, 16\)"):
            opt.step()
    else:
        with pytest.raises(ax.errors.CollectiveRefusedError, match=r"ZeroRedundancyOptimizer\.step") as info:
            opt.step()
        assert info.value.rank == bad and "ShapeError" in info.value.reason, (info.value.rank, str(info.value))
    assert all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))
    _in_step(world)
    model.parameters()[2].grad = good
    opt.step()
    assert not np.array_equal(model.parameters()[2].data, before[2])


def case_a_rank_without_gradients_still_gathers(world):
    """One rank's zero_grad(set_to_none=True) before step: every rank steps (none waits for it), its slices go
    out unchanged, the others' are updated, and the replicas stay equal."""
    lazy = world.world_size - 1
    model, opt, before = _stepped_once(world, "adam")
    if world.rank == lazy:
        opt.zero_grad(set_to_none=True)
    opt.step()
    flat_before = np.concatenate([b.reshape(-1) for b in before])
    flat_after = np.concatenate([p.data.reshape(-1) for p in model.parameters()])
    everyone = ax.all_gather(flat_after)
    assert all(np.array_equal(everyone[0], row) for row in everyone)
    for r in range(world.world_size):
        start, stop, pad = ax.all_gather(np.array([opt.shard_ranges()[0][k] for k in ("start", "stop", "pad")]))[r]
        owned = slice(start, stop - pad)
        if r == lazy:
            assert np.array_equal(flat_after[owned], flat_before[owned]), r
        else:
            assert not np.array_equal(flat_after[owned], flat_before[owned]), r
    assert (opt.memory_bytes() == 0) == (world.rank == lazy)  # its optimizer made no state


def case_a_parameter_without_a_gradient_keeps_its_values(world):
    """As in PyTorch: with weight decay and momentum a parameter whose grad is None still does not move."""
    model, opt, before = _stepped_once(world, "sgd")
    model.parameters()[1].grad = None
    opt.step()
    after = [p.data for p in model.parameters()]
    assert np.array_equal(after[1], before[1])
    assert all(not np.array_equal(a, b) for i, (a, b) in enumerate(zip(after, before)) if i != 1)


def case_bad_arguments_raise_before_sending(world):
    model = make_model(np.float64, seed=0)
    params = model.parameters()
    with pytest.raises(ax.errors.ConfigurationError, match="subclass of axonhpc.optim.Optimizer.*<class 'object'>"):
        ax.ZeroRedundancyOptimizer(object, params, lr=0.1)
    with pytest.raises(ax.errors.ConfigurationError, match="empty parameter list"):
        ax.ZeroRedundancyOptimizer(optim.SGD, [], lr=0.1)
    with pytest.raises(ax.errors.ConfigurationError, match=r"params\[3\] is the same Parameter as params\[1\]"):
        ax.ZeroRedundancyOptimizer(optim.SGD, params[:3] + [params[1]], lr=0.1)
    with pytest.raises(ax.errors.ConfigurationError, match=r"lr=-1 must be >= 0"):
        ax.ZeroRedundancyOptimizer(optim.SGD, params, lr=-1)
    ax.barrier()  # every rank got here: nothing was sent by the failed constructors



def case_a_bad_argument_on_one_rank_raises_everywhere(world):
    """One rank's bad optimizer class or hyperparameter: it raises its error, the others ModelMismatchError naming
    it, from the model check (not a wait in step()'s all-gather); then every rank is in step and builds."""
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    model = make_model(np.float64, seed=0)
    ddp = ax.DDP(model)
    for cls, kwargs, error, match in (
            (optim.SGD, dict(lr=-1.0), ax.errors.ConfigurationError, "SGD: lr=-1.0 must be >= 0"),
            (object, dict(lr=0.1), ax.errors.ConfigurationError,
             "ZeroRedundancyOptimizer: optimizer_class must be a subclass of axonhpc.optim.Optimizer"),
            (optim.SGD, dict(lr=0.1, momentun=0.9), ax.errors.ConfigurationError,
             "ZeroRedundancyOptimizer: SGD takes no hyperparameter 'momentun' \\(got momentun=0.9\\); .* did you mean "
             "'momentum'\\?"),
            (lambda ps: [ps], {}, ax.errors.ConfigurationError,
             "ZeroRedundancyOptimizer: <function .*> returned a list, not an axonhpc.optim.Optimizer")):
        if world.rank == last:
            with pytest.raises(error, match=match):
                ax.ZeroRedundancyOptimizer(cls, ddp.parameters(), **kwargs)
        else:
            with pytest.raises(ax.errors.ModelMismatchError,
                               match=f"rank {last} could not build it \\(rank {last}: {error.__name__}: {match}"):
                ax.ZeroRedundancyOptimizer(optim.SGD, ddp.parameters(), lr=0.1)
        _in_step(world)
    ax.ZeroRedundancyOptimizer(optim.SGD, ddp.parameters(), lr=0.1)


def case_different_hyperparameters_raise_everywhere(world):
    """Another optimizer or hyperparameter on one rank would update its slice differently, a silently wrong model
    on every rank: every rank raises ModelMismatchError naming the setting and each rank's value."""
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    odd = world.rank == last
    ddp = ax.DDP(make_model(np.float64, seed=0))
    for cls, kwargs, label, shown in (
            (optim.SGD, dict(lr=1.0 if odd else 0.1, momentum=0.9), "optimizer lr", "1.0"),
            (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=odd, weight_decay=1e-3), "optimizer nesterov", "True"),
            (optim.Adam if odd else optim.SGD, dict(lr=0.1), "optimizer", "axonhpc.optim.adam.Adam"),
            # the defaults count: betas given on one rank only, but other than the default
            (optim.Adam, dict(lr=0.1, **(dict(betas=(0.8, 0.999)) if odd else {})), "optimizer betas", "(0.8, 0.999)"),
            (lambda ps: optim.SGD(ps, lr=0.5 if odd else 0.1), {}, "optimizer lr", "0.5")):
        with pytest.raises(ax.errors.ModelMismatchError) as info:
            ax.ZeroRedundancyOptimizer(cls, ddp.parameters(), **kwargs)
        text = str(info.value)
        assert f"the first difference is {label!r}" in text, text
        assert f"rank {last} has {label}: {shown}. Every rank must pass the same parameters" in text, text
        assert "the same optimizer class and the same hyperparameters" in text, text
        _in_step(world)
    # the same values written otherwise are the same settings
    opt = ax.ZeroRedundancyOptimizer(optim.SGD, ddp.parameters(), lr=np.float64(0.1) if odd else 0.1,
                                     momentum=1 if odd else 1.0)
    assert opt.lr == 0.1

CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
