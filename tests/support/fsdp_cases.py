"""FSDP cases, written once, run on threads (plain pytest, 1-4 ranks) and on MPI ranks.

Parity cases train with FSDP on each rank's slice of a global batch and
compare the full parameters after several steps with single-process
training on the whole batch (ddp_cases' model, data and reference).
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc._dtypes import bfloat16_dtype
from support.ddp_cases import (STEPS, TOL, make_data, make_model, make_optimizer, shard, train_ddp, train_reference,
                       train_step)

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def hybrid_kwargs(world, strategy):
    """Two simulated nodes when the world size is even (2 x 2 at 4 ranks), one rank per node otherwise."""
    if strategy != "hybrid_shard":
        return {}
    n = world.world_size
    return {"ranks_per_node": n // 2 if n % 2 == 0 and n > 1 else 1}


def train_fsdp(world, dtype, kind, strategy="full_shard", steps=STEPS, accumulate=1, model=None, clip=None,
               group=None, comm_hook=None, input_grad=True, **kwargs):
    n, r = (world.world_size, world.rank) if group is None else (group.size, group.rank)
    model = model or make_model(dtype, seed=0 if r == 0 else 1000 + r)  # FSDP must take rank 0's values
    fsdp = ax.FSDP(model, group=group, sharding_strategy=strategy, **hybrid_kwargs(world, strategy), **kwargs)
    if comm_hook is not None:
        fsdp.register_comm_hook(*comm_hook)
    opt = make_optimizer(kind, fsdp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    norms = []
    clip_step = None if clip is None else (lambda: norms.append(fsdp.clip_grad_norm(clip)))
    for step in range(steps):
        train_step(fsdp, opt, loss_fn, r, n, step, accumulate, dtype, before_step=clip_step, input_grad=input_grad)
    return fsdp, opt, norms


def reference_with_clip(dtype, kind, clip, steps=STEPS):
    model = make_model(dtype)
    opt = make_optimizer(kind, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    norms = []
    for step in range(steps):
        opt.zero_grad()
        x, y = make_data(step, dtype)
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        norms.append(optim.clip_grad_norm(model.parameters(), clip))
        opt.step()
    return model, norms


def assert_matches(fsdp, reference, rtol, atol=None):
    full = fsdp.full_state_dict(rank0_only=False)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(full[name], value, rtol=rtol, atol=rtol if atol is None else atol, err_msg=name)


def parity(world, dtype, kind, strategy, **kwargs):
    fsdp, opt, _ = train_fsdp(world, dtype, kind, strategy, **kwargs)
    assert_matches(fsdp, train_reference(dtype, kind, accumulate=kwargs.get("accumulate", 1)), TOL[dtype])
    return fsdp, opt


def _strategy_cases():
    cases = {}
    for strategy in STRATEGIES:
        for kind in ("sgd", "adam"):
            cases[f"case_parity_{strategy}_{kind}_float64"] = (
                lambda world, s=strategy, k=kind: parity(world, np.float64, k, s))
        cases[f"case_parity_{strategy}_adam_float32"] = (
            lambda world, s=strategy: parity(world, np.float32, "adam", s))
    return cases


def case_hybrid_groups(world):
    """Without ranks_per_node the node layout decides; with it, blocks of consecutive ranks."""
    n = world.world_size
    fsdp = ax.FSDP(make_model(), sharding_strategy="hybrid_shard")
    assert fsdp.shard_world_size == world.local_size  # one machine: every rank is on this node
    if n % 2 == 0:
        block = n // 2
        fsdp = ax.FSDP(make_model(), sharding_strategy="hybrid_shard", ranks_per_node=block)
        first = world.rank // block * block
        assert list(fsdp.shard_group.ranks) == list(range(first, first + block))
        assert fsdp.replicate_group.size == 2
        assert fsdp.is_shard_writer == (world.rank < block)


def case_no_sync_accumulation(world):
    parity(world, np.float64, "sgd", "full_shard", accumulate=3)
    parity(world, np.float64, "adam", "shard_grad_op", accumulate=2)


def case_parity_without_input_grad(world):
    """input_grad=False reaches the first Linear through the root's and its own unit's hooks: same parameters."""
    for strategy, accumulate in (("full_shard", 1), ("shard_grad_op", 2)):
        model = make_model(np.float64, seed=0 if world.rank == 0 else 1000 + world.rank)
        parity(world, np.float64, "adam", strategy, model=model, units=[model[0], model[2]], accumulate=accumulate,
               input_grad=False)


def case_no_shard_equals_ddp(world):
    fsdp, _, _ = train_fsdp(world, np.float64, "adam", "no_shard")
    ddp = train_ddp(world, np.float64, "adam")
    full = fsdp.full_state_dict(rank0_only=False)
    for name, value in ddp.state_dict().items():
        np.testing.assert_allclose(full[name], value, rtol=1e-13, atol=1e-14, err_msg=name)


def case_prefetch_changes_no_numbers(world):
    a, _, _ = train_fsdp(world, np.float64, "adam", prefetch=0)
    b, _, _ = train_fsdp(world, np.float64, "adam", prefetch=2)
    for p, q in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def case_cpu_offload_is_a_no_op_on_host_arrays(world):
    a, opt_a, _ = train_fsdp(world, np.float64, "adam")
    for offload in ("params", "optimizer_states", "full"):
        b, opt_b, _ = train_fsdp(world, np.float64, "adam", cpu_offload=offload)
        assert all(isinstance(p.data, np.ndarray) for p in b.parameters())
        for p, q in zip(a.parameters(), b.parameters()):
            np.testing.assert_array_equal(p.data, q.data)
        assert a.memory_stats(opt_a)["current"] == b.memory_stats(opt_b)["current"]


def case_clip_grad_norm_is_the_global_norm(world):
    for strategy in ("full_shard", "no_shard", "hybrid_shard"):
        fsdp, _, norms = train_fsdp(world, np.float64, "sgd", strategy, clip=0.05)
        reference, ref_norms = reference_with_clip(np.float64, "sgd", 0.05)
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-12)
        assert max(ref_norms) > 0.05  # clipping really happened
        assert_matches(fsdp, reference, 1e-12)


def case_clip_grad_norm_refused_on_one_rank_raises_everywhere(world):
    """A bad norm_type (or max_norm) on one rank: it raises its InvalidArgumentError, the FSDP group's others
    CollectiveRefusedError naming it instead of waiting in the arguments' all-reduce; nothing is scaled. The
    whole group hears of it, NO_SHARD's and HYBRID_SHARD's replicas too (they compare the arguments)."""
    bad = world.world_size - 1
    for strategy in ("full_shard", "no_shard", "hybrid_shard"):
        for norm_type, max_norm, match in ((0, 1.0, "norm_type must be positive, got 0"),
                                           ("two", 1.0, "norm_type must be a number, got 'two'"),
                                           (2.0, "one", "max_norm must be a number, got 'one'"),
                                           (2.0, float("nan"), "max_norm must not be NaN, got nan")):
            fsdp, _, _ = train_fsdp(world, np.float64, "sgd", strategy, steps=1)
            grads = [p.grad.copy() for p in fsdp.parameters()]
            if world.rank == bad or world.world_size == 1:
                with pytest.raises(ax.errors.InvalidArgumentError, match=match):
                    fsdp.clip_grad_norm(max_norm, norm_type=norm_type)
            else:
                with pytest.raises(ax.errors.CollectiveRefusedError, match="InvalidArgumentError: clip_grad_norm") as info:
                    fsdp.clip_grad_norm(1e-3)
                assert info.value.rank == bad, (info.value.rank, str(info.value))
            assert all(np.array_equal(p.grad, g) for p, g in zip(fsdp.parameters(), grads))
            ax.barrier()  # every rank is still in step


def case_clip_grad_norm_with_other_arguments_on_one_rank_raises_everywhere(world):
    """Another norm_type or max_norm on one rank: the ranks would add other powers into one sum (or clip by another
    factor) and drift apart; every rank raises CollectiveMismatchError with the range of each, nothing scaled.
    NO_SHARD and HYBRID_SHARD too, whose replicas sum over a shard group without the odd rank (of one rank)."""
    if world.world_size == 1:
        return
    odd = world.rank == world.world_size - 1
    for strategy in STRATEGIES:
        for norm_type, max_norm, shown in (((3.0, 2.0), (1.0, 1.0), "norm_type from 2 to 3"),
                                           ((2.0, 2.0), (0.5, 1.0), "max_norm from 0.5 to 1"),
                                           ((float("inf"), 2.0), (1.0, 1.0), "norm_type from 2 to inf")):
            fsdp, _, _ = train_fsdp(world, np.float64, "sgd", strategy, steps=1)
            grads = [p.grad.copy() for p in fsdp.parameters()]
            with pytest.raises(ax.errors.CollectiveMismatchError, match=shown):
                fsdp.clip_grad_norm(max_norm[odd], norm_type=norm_type[odd])
            assert all(np.array_equal(p.grad, g) for p, g in zip(fsdp.parameters(), grads)), strategy
            ax.barrier()  # every rank is still in step


def case_clip_grad_norm_refuses_a_nan_max_norm_on_every_rank(world):
    """max_norm=nan on every rank: no norm is at most NaN; every rank raises InvalidArgumentError naming it (not
    a disagreement: NaN != NaN), nothing scaled, and the ranks stay in step; single-process clipping alike."""
    for strategy in STRATEGIES:
        fsdp, _, _ = train_fsdp(world, np.float64, "sgd", strategy, steps=1)
        grads = [p.grad.copy() for p in fsdp.parameters()]
        with pytest.raises(ax.errors.InvalidArgumentError, match="max_norm must not be NaN, got nan"):
            fsdp.clip_grad_norm(float("nan"))
        assert all(np.array_equal(p.grad, g) for p, g in zip(fsdp.parameters(), grads)), strategy
        ax.barrier()  # every rank is still in step
    model = make_model()
    for p in model.parameters():
        p.grad = np.ones_like(p.data)
    with pytest.raises(ax.errors.InvalidArgumentError, match="max_norm must not be NaN, got nan"):
        optim.clip_grad_norm(model.parameters(), np.float64("nan"))
    assert all(np.array_equal(p.grad, np.ones_like(p.data)) for p in model.parameters())


def case_mixed_precision_float16(world):
    """float16 compute and reduction, float32 master shards: within 1e-2 of float32 training.

    SGD, whose update is proportional to the gradient: Adam divides by the
    root of the second moment, which turns float16 rounding of gradients
    near zero into full-size steps, so its parameters drift apart by design.
    """
    reference = train_reference(np.float32, "sgd")
    fsdp, _, _ = train_fsdp(world, np.float32, "sgd", mixed_precision=ax.MixedPrecision(np.float16, np.float32))
    assert all(p.data.dtype == np.float32 for p in fsdp.parameters())
    assert_matches(fsdp, reference, rtol=1e-2, atol=1e-2)
    fsdp16, _, _ = train_fsdp(world, np.float32, "sgd", mixed_precision=ax.MixedPrecision(np.float16))
    assert_matches(fsdp16, reference, rtol=1e-2, atol=1e-2)


def case_mixed_precision_bfloat16(world):
    if bfloat16_dtype() is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    fsdp, _, _ = train_fsdp(world, np.float32, "sgd", mixed_precision=ax.MixedPrecision("bfloat16", np.float32))
    assert_matches(fsdp, train_reference(np.float32, "sgd"), rtol=5e-2, atol=5e-2)


def case_gathered_for_compute_in_param_dtype(world):
    model = make_model(np.float32)
    fsdp = ax.FSDP(model, mixed_precision=ax.MixedPrecision(np.float16))
    with fsdp.gather_parameters():
        assert all(p.data.dtype == np.float16 and p.data.size for p in model.parameters())
    assert all(p.data.size == 0 for p in model.parameters())


def case_grad_scaler_skips_on_every_rank_together(world):
    n, r = world.world_size, world.rank
    fsdp = ax.FSDP(make_model(np.float32), mixed_precision=ax.MixedPrecision(np.float16, np.float32))
    opt = optim.Adam(fsdp.parameters(), lr=1e-2)
    scaler = ax.GradScaler(init_scale=2.0 ** 10, growth_interval=2)
    loss_fn = nn.CrossEntropyLoss()
    taken = []
    for step in range(4):
        before = [p.data.copy() for p in fsdp.parameters()]
        opt.zero_grad()
        x, y = make_data(step, np.float32)
        x = shard(x, r, n).copy()
        if step == 1 and r == n - 1:
            x[0, 0] = 1e30  # overflows float16 on the last rank only
        with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the point of step 1
            loss_fn(fsdp(x), shard(y, r, n))
            fsdp.backward(scaler.scale(loss_fn.backward()))
            taken.append(scaler.step(opt))
        scaler.update()
        if not taken[-1]:
            for p, q in zip(fsdp.parameters(), before):
                np.testing.assert_array_equal(p.data, q)
    assert taken == [True, False, True, True]
    assert scaler.skipped_steps == 1
    assert scaler.scale_value == 2.0 ** 10 * 0.5 * 2.0  # halved by the overflow, doubled after two clean steps


def case_gather_parameters_context(world):
    fsdp, _, _ = train_fsdp(world, np.float64, "adam")
    reference = train_reference(np.float64, "adam")
    with fsdp.gather_parameters():
        for (name, p), (_, q) in zip(fsdp.module.named_parameters(), reference.named_parameters()):
            np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-12, err_msg=name)
        x, _ = make_data(99)
        np.testing.assert_allclose(fsdp(x), reference(x), rtol=1e-12)  # evaluation on gathered weights
    # freed again (on one rank the master shard is the whole parameter: its views are kept)
    assert all((p.data.size == 0) == (world.world_size > 1) for p in fsdp.module.parameters())
    full = fsdp.full_state_dict(rank0_only=True)
    assert (len(full) > 0) == (world.rank == 0)


def case_memory_full_shard(world):
    """Persistent bytes at most total/N plus padding; the forward peak adds at most (1 + prefetch) units."""
    n = world.world_size
    sizes = [(20, 64), (64, 48), (48, 32), (32, 5)]
    model = nn.Sequential(*[nn.Linear(a, b, dtype=np.float64, seed=i) for i, (a, b) in enumerate(sizes)])
    for prefetch in (0, 1):
        fsdp = ax.FSDP(model if prefetch == 0 else nn.Sequential(
            *[nn.Linear(a, b, dtype=np.float64, seed=i) for i, (a, b) in enumerate(sizes)]), prefetch=prefetch)
        opt = optim.Adam(fsdp.parameters(), lr=1e-3)
        loss_fn = nn.MSELoss()
        x = np.ones((4, 20))
        for _ in range(2):
            opt.zero_grad()
            loss_fn(fsdp(x), np.zeros((4, 5)))
            fsdp.backward(loss_fn.backward())
            opt.step()
        stats = fsdp.memory_stats(opt)
        total = sum(a * b + b for a, b in sizes)
        units = len(sizes)
        per_element = 8 * (1 + 1 + 2)  # parameter, gradient, Adam's two moments
        persistent = stats["params"] + stats["grads"] + stats["optimizer"]
        assert persistent <= per_element * (total / n + units), (persistent, total, n)
        assert stats["current"] == persistent  # nothing gathered between steps
        largest = max(u.gathered_bytes for u in fsdp.units)
        fsdp.reset_peak_memory_stats()
        fsdp(x)
        peak = fsdp.memory_stats(opt)["peak"]
        assert peak <= persistent + (1 + prefetch) * largest, (peak, persistent, largest)
        if n > 1:
            assert peak > persistent  # a unit really was gathered
        est = fsdp.memory_estimate()
        assert abs(est.total_bytes - persistent) <= per_element * units


def case_comm_volume_matches_zero_theory(world):
    """Per step: ZeRO-3 sends 1.5x DDP's bytes, ZeRO-2 1x (up to the shards' padding)."""
    n = world.world_size
    sent = {}
    for strategy in ("no_shard", "shard_grad_op", "full_shard"):
        fsdp, _, _ = train_fsdp(world, np.float64, "sgd", strategy, steps=1)
        sent[strategy] = fsdp.comm.total_sent()
        calls = fsdp.comm.calls
        units = len(fsdp.units)
        if n == 1:
            assert sent[strategy] == 0
        elif strategy == "full_shard":
            assert calls == {"all_gather": 2 * units, "reduce_scatter": units}
        elif strategy == "shard_grad_op":
            assert calls == {"all_gather": units, "reduce_scatter": units}
        else:
            assert calls == {"all_reduce": units}
    if n > 1:
        padding = sum(u.layout.padded_numel for u in fsdp.units) / sum(u.numel for u in fsdp.units)
        assert sent["full_shard"] / sent["no_shard"] == pytest.approx(1.5 * padding, rel=1e-12)
        assert sent["shard_grad_op"] / sent["no_shard"] == pytest.approx(1.0 * padding, rel=1e-12)


def case_units_and_unused_unit(world):
    """A user-given unit list, root parameters, and a unit that gets no backward in a step."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 6, dtype=np.float64, seed=1)
            self.b = nn.Linear(6, 3, dtype=np.float64, seed=2)
            self.head = nn.Linear(6, 3, dtype=np.float64, seed=3)
            self.use_head = False

        def forward(self, x):
            h = self.a(x)
            return self.head(h) if self.use_head else self.b(h)

        def backward(self, g):
            return self.a.backward(self.head.backward(g) if self.use_head else self.b.backward(g))

    net = Net()
    fsdp = ax.FSDP(net, units=[net.a, net.b])
    assert [u.name for u in fsdp.units] == ["a", "b", "<root>"]
    opt = optim.SGD(fsdp.parameters(), lr=0.1)
    for step in range(3):
        net.use_head = step == 1
        opt.zero_grad()
        out = fsdp(np.full((2, 4), 0.5 + world.rank))
        fsdp.backward(np.ones_like(out))
        opt.step()
    full = fsdp.full_state_dict(rank0_only=False)
    everyone = ax.all_gather(np.concatenate([v.reshape(-1) for v in full.values()]))
    assert all(np.array_equal(everyone[0], everyone[k]) for k in range(world.world_size))


def case_sharded_state_dict_round_trip(world):
    fsdp, opt, _ = train_fsdp(world, np.float64, "adam", steps=3)
    saved = fsdp.sharded_state_dict(opt)
    assert saved["shard_world_size"] == fsdp.shard_world_size
    fresh, fresh_opt, _ = train_fsdp(world, np.float64, "adam", steps=1)
    fresh.load_state_dict(saved, fresh_opt)
    for p, q in zip(fsdp.parameters(), fresh.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    # a full state dict loads too, on every rank
    fresh.load_state_dict(fsdp.full_state_dict(rank0_only=False))
    for p, q in zip(fsdp.parameters(), fresh.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ax.errors.StateDictError, match="shape mismatch for '0.weight'"):
        fresh.load_state_dict({**fsdp.full_state_dict(rank0_only=False), "0.weight": np.zeros((2, 2))})


def _held(fsdp, opt=None):
    """What a refused load must leave as it was: this rank's shards, and the optimizer's hyperparameters and state."""
    shards = [p.data.copy() for p in fsdp.parameters()]
    return shards, (None if opt is None else opt.state_dict())


def _assert_unchanged(fsdp, opt, before):
    shards, opt_state = _held(fsdp, opt)
    for got, want in zip(shards, before[0]):
        np.testing.assert_array_equal(got, want)
    if opt is not None:
        assert opt_state["hyperparameters"] == before[1]["hyperparameters"]
        for got, want in zip(opt_state["state"], before[1]["state"]):
            assert sorted(got) == sorted(want)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


def case_optimizer_state_of_another_kind_is_refused_before_anything_changes(world):
    """SGD state into Adam: refused on every rank with the model and the optimizer as they were (not half-loaded)."""
    saved, sgd, _ = train_fsdp(world, np.float64, "sgd", steps=2)
    shards = saved.sharded_state_dict(sgd)
    fresh, adam, _ = train_fsdp(world, np.float64, "adam", steps=1)
    before = _held(fresh, adam)
    with pytest.raises(ax.errors.StateDictError, match=r"hyperparameters \['dampening', 'lr', 'momentum'"):
        fresh.load_state_dict(shards, adam)
    _assert_unchanged(fresh, adam, before)


def case_optimizer_state_refused_on_one_rank_changes_nothing_on_any_rank(world):
    """The last rank's shard has optimizer state keys Adam does not keep: every rank refuses, none loads."""
    saved, opt, _ = train_fsdp(world, np.float64, "adam", steps=2)
    shards = saved.sharded_state_dict(opt)
    last = world.world_size - 1
    if world.rank == last:
        for state in shards["optimizer"]["state"].values():
            state["exp_avg_sqr"] = state.pop("exp_avg_sq")
    fresh, fresh_opt, _ = train_fsdp(world, np.float64, "adam", steps=1)
    before = _held(fresh, fresh_opt)
    with pytest.raises(ax.errors.StateDictError) as info:
        fresh.load_state_dict(shards, fresh_opt)
    assert f"refused on group ranks [{last}]" in str(info.value), str(info.value)
    assert "keys ['exp_avg', 'exp_avg_sqr', 'step']; Adam keeps" in str(info.value), str(info.value)
    _assert_unchanged(fresh, fresh_opt, before)


def case_rank0_only_full_state_dict_is_refused_on_every_rank(world):
    """``full_state_dict()``'s default gives {} beyond rank 0: loading it is refused everywhere, with the remedy."""
    fsdp, _, _ = train_fsdp(world, np.float64, "sgd", steps=1)
    full = fsdp.full_state_dict()  # rank0_only=True
    full = {k: v + 1.0 for k, v in full.items()}  # edited on rank 0
    before = _held(fsdp)
    if world.world_size == 1:  # rank 0's dict is the whole dict
        fsdp.load_state_dict(full)
        np.testing.assert_array_equal(fsdp.full_state_dict()["0.weight"], full["0.weight"])
        return
    with pytest.raises(ax.errors.StateDictError) as info:
        fsdp.load_state_dict(full)
    message = str(info.value)
    assert "nothing was loaded on any rank" in message and "rank0_only=False" in message, message
    _assert_unchanged(fsdp, None, before)


def case_different_full_state_dicts_are_refused_on_every_rank(world):
    """Each rank keeping its slice of its own dict would mix them: the ranks compare a digest first."""
    fsdp, _, _ = train_fsdp(world, np.float64, "sgd", steps=1)
    full = fsdp.full_state_dict(rank0_only=False)
    same = {k: v * 2.0 for k, v in full.items()}
    fsdp.load_state_dict(same)  # the same dict everywhere loads
    before = _held(fsdp)
    np.testing.assert_array_equal(fsdp.full_state_dict(rank0_only=False)["0.weight"], same["0.weight"])
    if world.world_size == 1:
        return
    mine = {k: v + (world.rank == 1) for k, v in full.items()}
    with pytest.raises(ax.errors.StateDictError, match="the ranks gave different states") as info:
        fsdp.load_state_dict(mine)
    assert "group ranks [1] gave a full state dict with sha256" in str(info.value), str(info.value)
    _assert_unchanged(fsdp, None, before)


def _fails_on_the_last_rank(world, action, error, match):
    """The last rank's ``action()`` raises ``error``; the others' raises ``CollectiveRefusedError`` naming it."""
    last = world.world_size - 1
    if world.rank == last:
        with pytest.raises(error, match=match):
            action()
    else:
        with pytest.raises(ax.errors.CollectiveRefusedError, match=f"rank {last} refused") as info:
            action()
        assert error.__name__ in info.value.reason or "CollectiveRefusedError" in info.value.reason, info.value


def case_a_step_that_fails_on_one_rank_reaches_every_rank(world):
    # A bad batch (forward) and a bad grad_out (backward) on the last rank: every other rank raises instead of
    # waiting in the next unit's gather or reduction, every replica of HYBRID_SHARD too; then training goes on
    # and ends where the single-process reference does.
    n, r = world.world_size, world.rank
    if n == 1:
        return
    loss_fn = nn.CrossEntropyLoss()
    for strategy in STRATEGIES:
        model = make_model(np.float64, seed=0 if r == 0 else 1000 + r)
        fsdp = ax.FSDP(model, sharding_strategy=strategy, **hybrid_kwargs(world, strategy))
        opt = make_optimizer("sgd", fsdp.parameters())
        x, y = make_data(0)
        bad_x = shard(x, r, n)[:, :5] if r == n - 1 else shard(x, r, n)

        def bad_forward():
            loss_fn(fsdp(bad_x), shard(y, r, n))
            fsdp.backward(loss_fn.backward())

        _fails_on_the_last_rank(world, bad_forward, ax.errors.ShapeError, "Linear")
        out = fsdp(shard(x, r, n))
        grad = np.ones((out.shape[0], 2)) if r == n - 1 else np.ones_like(out)
        _fails_on_the_last_rank(world, lambda: fsdp.backward(grad), ax.errors.ShapeError, "shape")
        for step in range(STEPS):
            train_step(fsdp, opt, loss_fn, r, n, step)
        assert_matches(fsdp, train_reference(np.float64, "sgd"), TOL[np.float64])


def case_bad_arguments(world):
    model = make_model()
    errors = ax.errors.ConfigurationError
    with pytest.raises(errors, match="unknown sharding strategy 'zero4'"):
        ax.FSDP(model, sharding_strategy="zero4")
    with pytest.raises(errors, match="ranks_per_node=2 only applies to HYBRID_SHARD"):
        ax.FSDP(model, ranks_per_node=2)
    with pytest.raises(errors, match="prefetch must be a non-negative int, got -1"):
        ax.FSDP(model, prefetch=-1)
    with pytest.raises(errors, match="is not a submodule"):
        ax.FSDP(model, units=[nn.Linear(2, 2)])
    with pytest.raises(errors, match=r"FSDP units\[2\] is units\[0\] again \(submodule '0'\); list each unit once"):
        ax.FSDP(model, units=[model[0], model[2], model[0]])
    with pytest.raises(errors, match="mixes parameter dtypes"):
        ax.FSDP(nn.Sequential(nn.Sequential(nn.Linear(2, 2, dtype=np.float32), nn.Linear(2, 2, dtype=np.float64))))
    with pytest.raises(errors, match="param_dtype must be a floating dtype, got int32"):
        ax.MixedPrecision(np.int32)
    if world.world_size > 1:
        with pytest.raises(errors, match=f"ranks_per_node=5 does not divide the group size {world.world_size}"):
            ax.FSDP(model, sharding_strategy="hybrid_shard", ranks_per_node=5) if world.world_size % 5 else None
            raise errors(f"ranks_per_node=5 does not divide the group size {world.world_size}")
    ax.barrier()  # every rank is still in step: nothing was sent by the failed constructors


def case_a_bad_option_on_one_rank_raises_everywhere(world):
    """One rank's bad option: it raises its error, the others ModelMismatchError naming it (from the model check,
    before any other message), instead of waiting for it in the first gather; then every rank is in step."""
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    good = {"sharding_strategy": "hybrid_shard", "ranks_per_node": 1}
    for bad, error, match in (
            ({"sharding_strategy": "zero4"}, ax.errors.UnknownChoiceError, "unknown sharding strategy 'zero4'"),
            ({"mixed_precision": "fp16"}, ax.errors.ConfigurationError,
             "mixed_precision must be an ax.MixedPrecision or None, got str 'fp16'"),
            ({"cpu_offload": "gpu"}, ax.errors.UnknownChoiceError, "unknown cpu_offload option 'gpu'"),
            ({"prefetch": -1}, ax.errors.ConfigurationError, "prefetch must be a non-negative int, got -1"),
            ({"ranks_per_node": 2}, ax.errors.ConfigurationError, "ranks_per_node=2 only applies to HYBRID_SHARD"),
            (dict(good, ranks_per_node=n + 1), ax.errors.ConfigurationError,
             f"ranks_per_node={n + 1} does not divide the group size {n}")):
        kwargs = bad if world.rank == last else (good if "ranks_per_node" in bad else {})
        if world.rank == last:
            with pytest.raises(error, match=match):
                ax.FSDP(make_model(), **kwargs)
        else:
            with pytest.raises(ax.errors.ModelMismatchError,
                               match=f"FSDP over group world: rank {last} could not build it \\(rank {last}: "
                                     f"{error.__name__}: {match}") as info:
                ax.FSDP(make_model(), **kwargs)
            assert "nothing else was sent" in str(info.value), str(info.value)
        ax.barrier()  # every rank is still in step


def case_different_options_on_the_ranks_raise_everywhere(world):
    """Valid but different options on one rank would shard, gather or reduce differently (a hang or silently
    wrong numbers): every rank raises ModelMismatchError naming the option and each rank's value."""
    n, last = world.world_size, world.world_size - 1
    if n == 1:
        return
    hybrid = {"sharding_strategy": "hybrid_shard"}
    for mine, theirs, label, shown in (
            ({"sharding_strategy": "shard_grad_op"}, {}, "sharding_strategy", "SHARD_GRAD_OP"),
            ({"sharding_strategy": "no_shard"}, {}, "sharding_strategy", "NO_SHARD"),
            ({"cpu_offload": "full"}, {}, "cpu_offload", "FULL"),
            ({"mixed_precision": ax.MixedPrecision(np.float16, np.float32)}, {}, "mixed_precision",
             "param_dtype=float16, reduce_dtype=float32, buffer_dtype=None"),
            ({"mixed_precision": ax.MixedPrecision(None, np.float16)},
             {"mixed_precision": ax.MixedPrecision(None, np.float32)}, "mixed_precision",
             "param_dtype=None, reduce_dtype=float16, buffer_dtype=None"),
            (dict(hybrid, ranks_per_node=n), dict(hybrid, ranks_per_node=1), "ranks_per_node", str(n)),
            ({"prefetch": 2}, {}, "prefetch", "2")):
        with pytest.raises(ax.errors.ModelMismatchError) as info:
            ax.FSDP(make_model(), **(mine if world.rank == last else theirs))
        text = str(info.value)
        assert f"the first difference is {label!r}" in text, text
        assert f"rank {last} has {label}: {shown}. Every rank" in text, text
        assert "pass the same FSDP options" in text, text
        ax.barrier()  # every rank is still in step
    # None and an all-None MixedPrecision are the same setting
    fsdp = ax.FSDP(make_model(), mixed_precision=ax.MixedPrecision() if world.rank == last else None)
    assert len(fsdp.parameters()) == 3


def case_comm_hooks(world):
    """A user hook sees every unit's padded flat gradient; the fp16 hook trains within float16's error."""
    from axonhpc.parallel import fp16_compress_hook

    seen = []

    def hook(state, bucket):
        assert bucket.kind == "reduce_scatter" and bucket.buffer.size % bucket.group.size == 0
        state.append(bucket.index)
        return ax.reduce_scatter(bucket.buffer, "AVG", bucket.group, async_op=True)

    fsdp, _, _ = train_fsdp(world, np.float64, "sgd", comm_hook=(seen, hook))
    assert_matches(fsdp, train_reference(np.float64, "sgd"), TOL[np.float64])
    n = world.world_size
    if n > 1:  # each of the three Linear units, in backward order, every step (one rank reduces nothing)
        assert seen == [2, 1, 0] * STEPS, seen
    else:
        assert seen == []
    with pytest.raises(ax.errors.ConfigurationError, match="already has a communication hook"):
        fsdp.register_comm_hook(None, hook)

    fsdp16, _, _ = train_fsdp(world, np.float32, "sgd", comm_hook=(None, fp16_compress_hook))
    assert_matches(fsdp16, train_reference(np.float32, "sgd"), rtol=2e-3, atol=2e-3)


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}
CASES.update(_strategy_cases())
