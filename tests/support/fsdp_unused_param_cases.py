"""Parameters without a gradient inside a used FSDP unit (and a ZeRO-1 slice), against one process.

One process steps a parameter only while its ``grad`` is not None: a parameter of a branch not taken gets
no momentum, Adam moments or step count and no weight decay. The unit ``body`` below holds three Linears:
``main`` always used, ``alt`` used on some ranks in some steps (some micro-steps, under ``no_sync``), and
``spare`` never used. The flat shard's gradient is per unit, so before [Note: parameters without a gradient
inside a unit] (``parallel/fsdp/flat_param.py``) ``alt`` and ``spare`` were stepped with zeros. Each case
trains FSDP on each rank's batch and compares with one process on all of them within 1e-12 (float64). The
shards cut through the parameters differently at 1 to 4 ranks (``body`` has 73 elements).
"""
import contextlib

import numpy as np

import axonhpc as ax
from axonhpc import checkpoint, nn, optim
from support.fsdp_cases import STRATEGIES, hybrid_kwargs
from support.scratch import shared_dir

STEPS = 5
ROWS = 3  # per rank and micro-step
TOL = 1e-12

OPTIMIZERS = {
    "sgd": lambda params: optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    "sgd_dampened": lambda params: optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1),
    "nesterov": lambda params: optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adam": lambda params: optim.Adam(params, lr=0.05, weight_decay=0.1),
    "adamw": lambda params: optim.AdamW(params, lr=0.05, weight_decay=0.1),
}


class Body(nn.Module):
    """One FSDP unit: ``main``, then ``alt`` where ``use_alt``; ``spare`` is never called."""

    def __init__(self, seed):
        super().__init__()
        self.main = nn.Linear(4, 5, dtype=np.float64, seed=1 + seed)
        self.alt = nn.Linear(5, 5, dtype=np.float64, seed=2 + seed)
        self.spare = nn.Linear(5, 3, dtype=np.float64, seed=3 + seed)
        self.use_alt = False

    def forward(self, x):
        h = self.main(x)
        return self.alt(h) if self.use_alt else h

    def backward(self, g):
        if self.use_alt:
            g = self.alt.backward(g)
        return self.main.backward(g)


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.body = Body(seed)
        self.head = nn.Linear(5, 2, dtype=np.float64, seed=4 + seed)

    def forward(self, x):
        return self.head(self.body(x))

    def backward(self, g):
        return self.body.backward(self.head.backward(g))


def _data(rank, step, micro):
    return np.random.default_rng(1000 * step + 10 * rank + micro).standard_normal((ROWS, 4))


def some_ranks(n):
    """alt: nowhere in step 0 (before any use), on the last rank in step 1, everywhere in step 2, on rank 0 in
    step 3, nowhere in step 4 (after use)."""
    return lambda rank, step, micro: (False, rank == n - 1, True, rank == 0, False)[step]


def some_micro_steps(n):
    """As ``some_ranks``, but in one of two micro-steps: the first on the last rank, then the second
    everywhere, then the first on rank 0."""
    return lambda rank, step, micro: (False, rank == n - 1 and micro == 0, micro == 1,
                                      rank == 0 and micro == 0, False)[step]


def reference(n, kind, plan, set_to_none, accumulate=1, steps=STEPS):
    """One process over every rank's micro-batches: a parameter none of them reached keeps the ``grad``
    ``zero_grad`` left (None, or zeros once it had one)."""
    model = Net()
    opt = OPTIMIZERS[kind](model.parameters())
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for r in range(n):
            for m in range(accumulate):
                model.body.use_alt = plan(r, step, m)
                out = model(_data(r, step, m))
                model.backward(np.ones_like(out) / out.size / accumulate / n)
        opt.step()
    return model.state_dict()


def train_fsdp(world, kind, plan, strategy, set_to_none, accumulate=1, steps=STEPS, **kwargs):
    r = world.rank
    model = Net(seed=0 if r == 0 else 50)  # FSDP starts every rank from rank 0's values
    fsdp = ax.FSDP(model, units=[model.body, model.head], sharding_strategy=strategy,
                   **hybrid_kwargs(world, strategy), **kwargs)
    opt = OPTIMIZERS[kind](fsdp.parameters())
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for m in range(accumulate):
            model.body.use_alt = plan(r, step, m)
            quiet = fsdp.no_sync() if m < accumulate - 1 else contextlib.nullcontext()
            with quiet:
                out = fsdp(_data(r, step, m))
                fsdp.backward(np.ones_like(out) / out.size / accumulate)  # averaged over the ranks
        opt.step()
    return fsdp, opt


def assert_close(got, want, tol=TOL, what=""):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=f"{what} {name}")


def _parity(world, strategy, kinds=tuple(OPTIMIZERS), **kwargs):
    n = world.world_size
    for kind in kinds:
        for set_to_none in (True, False):
            fsdp, _ = train_fsdp(world, kind, some_ranks(n), strategy, set_to_none, **kwargs)
            assert_close(fsdp.full_state_dict(rank0_only=False), reference(n, kind, some_ranks(n), set_to_none),
                         what=f"{strategy} {kind} set_to_none={set_to_none}")


def case_full_shard(world):
    _parity(world, "full_shard")


def case_shard_grad_op(world):
    _parity(world, "shard_grad_op")


def case_no_shard(world):
    _parity(world, "no_shard")


def case_hybrid_shard(world):
    _parity(world, "hybrid_shard")


def case_cpu_offload(world):
    # numpy shards stay where they are (offload is a no-op on the host), through the offload code paths
    _parity(world, "full_shard", kinds=("sgd", "adam"), cpu_offload="full")


def case_no_sync_accumulation(world):
    """Used in any micro-step is used: the flags of the no_sync backwards reach the syncing one."""
    n = world.world_size
    for strategy in ("full_shard", "hybrid_shard"):
        for kind in ("sgd_dampened", "adam"):
            for set_to_none in (True, False):
                fsdp, _ = train_fsdp(world, kind, some_micro_steps(n), strategy, set_to_none, accumulate=2)
                want = reference(n, kind, some_micro_steps(n), set_to_none, accumulate=2)
                assert_close(fsdp.full_state_dict(rank0_only=False), want,
                             what=f"{strategy} {kind} set_to_none={set_to_none}")


def case_a_parameter_never_used_has_no_state(world):
    """spare: its shard pieces keep rank 0's initial values, its moments stay zero, its entry None; alt has
    taken three steps, main five."""
    n = world.world_size
    fsdp, opt = train_fsdp(world, "adam", some_ranks(n), "full_shard", set_to_none=True)
    unit = fsdp.units[0]
    assert unit.param_names == ["body.main.weight", "body.main.bias", "body.alt.weight", "body.alt.bias",
                                "body.spare.weight", "body.spare.bias"]
    state = opt.state[0]
    assert [None if e is None else e["step"] for e in state["segments"]] == [5, 5, 3, 3, None, None]
    assert state["step"] == 5
    initial = Net().body.spare
    for i, first, last, at in unit.held_spans():
        if i >= 4:
            want = (initial.weight if i == 4 else initial.bias).data.reshape(-1)[first:last]
            np.testing.assert_array_equal(unit.shard.data[at:at + last - first], want)
            assert not state["exp_avg"][at:at + last - first].any()
            assert not state["exp_avg_sq"][at:at + last - first].any()
    # a step without a backward: the gradient (kept, zeroed) stands for the same parameters
    opt.zero_grad()
    opt.step()
    assert [None if e is None else e["step"] for e in opt.state[0]["segments"]] == [6, 6, 3, 3, None, None]


def case_resumed_from_a_resharded_checkpoint(world):
    """Adam's per-parameter step counts and the rest of the state, saved at n ranks, loaded on one, go on
    as if nothing had happened (the remaining steps run every rank's micro-batches there under no_sync)."""
    n = world.world_size
    plan = some_ranks(n)
    saved_at = 2
    with shared_dir(world, "axonhpc-unused-") as path:
        fsdp, opt = train_fsdp(world, "adam", plan, "full_shard", set_to_none=True, steps=saved_at)
        checkpoint.save_sharded(path + "/ckpt", fsdp, opt)
        alone = world.split(world.rank)
        model = Net(seed=7)
        one = ax.FSDP(model, group=alone, units=[model.body, model.head])
        one_opt = OPTIMIZERS["adam"](one.parameters())
        checkpoint.load_sharded(path + "/ckpt", one, one_opt)
        for step in range(saved_at, STEPS):
            one_opt.zero_grad(set_to_none=True)
            for k in range(n):  # every rank's batch, the last one syncing
                model.body.use_alt = plan(k, step, 0)
                with one.no_sync() if k < n - 1 else contextlib.nullcontext():
                    out = one(_data(k, step, 0))
                    one.backward(np.ones_like(out) / out.size / n)
            one_opt.step()
    assert_close(one.full_state_dict(), reference(n, "adam", plan, set_to_none=True), what="resumed")


def case_mixed_precision(world):
    """float32 compute and reduction over float64 masters: spare keeps its exact initial values and the rest
    stays within float32 rounding of float64 training (about 1e-8 here; zeros stepped into alt moved it
    about 1e-2)."""
    n = world.world_size
    initial = Net().state_dict()
    for kind in ("sgd", "adam"):
        fsdp, _ = train_fsdp(world, kind, some_ranks(n), "full_shard", set_to_none=True,
                             mixed_precision=ax.MixedPrecision(np.float32))
        got = fsdp.full_state_dict(rank0_only=False)
        for name in ("body.spare.weight", "body.spare.bias"):
            np.testing.assert_array_equal(got[name], initial[name], err_msg=f"{kind} {name}")
        assert_close(got, reference(n, kind, some_ranks(n), set_to_none=True), tol=1e-6, what=f"{kind} mixed")


def case_zero1_leaves_a_parameter_without_a_gradient_alone(world):
    """ZeRO-1 under DDP (find_unused_parameters): the same model without units, each dtype's slice one
    segmented Parameter."""
    n, r = world.world_size, world.rank
    for kind in ("sgd_dampened", "adam"):
        for set_to_none in (True, False):
            model = Net(seed=0 if r == 0 else 50)
            ddp = ax.DDP(model, find_unused_parameters=True)
            opt = ax.ZeroRedundancyOptimizer(OPTIMIZERS[kind], ddp.parameters())
            plan = some_ranks(n)
            for step in range(STEPS):
                opt.zero_grad(set_to_none=set_to_none)
                model.body.use_alt = plan(r, step, 0)
                out = ddp(_data(r, step, 0))
                ddp.backward(np.ones_like(out) / out.size)
                opt.step()
            assert_close(model.state_dict(), reference(n, kind, plan, set_to_none),
                         what=f"ZeRO-1 {kind} set_to_none={set_to_none}")


assert set(STRATEGIES) == {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"}
CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}
