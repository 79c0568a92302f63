"""DDP parity cases, written once, run on threads (plain pytest) and on MPI ranks.

Every case trains a model with DDP on each rank's shard of a global batch
and a single-process reference on the whole batch, with the same seeds and
data, and compares the parameters after several steps.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.bucketing import GradSyncStrategy
from axonhpc.parallel import UnusedParameterError

GLOBAL_BATCH = 60  # divisible by 1, 2, 3, 4 and 5
STEPS = 6
TOL = {np.float64: 1e-12, np.float32: 1e-5}


def make_model(dtype=np.float64, seed=0):
    return nn.Sequential(nn.Linear(6, 16, dtype=dtype, seed=seed), nn.Tanh(),
                         nn.Linear(16, 8, dtype=dtype, seed=seed + 1), nn.ReLU(),
                         nn.Linear(8, 3, dtype=dtype, seed=seed + 2))


def make_data(step, dtype=np.float64):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((GLOBAL_BATCH, 6)).astype(dtype), rng.integers(0, 3, GLOBAL_BATCH)


def make_optimizer(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if kind == "default":  # the optimizer a ParameterServer runs when given none
        return optim.SGD(params)
    return optim.Adam(params, lr=1e-2)


def shard(a, rank, n):
    k = len(a) // n
    return a[rank * k:(rank + 1) * k]


def train_reference(dtype, kind, steps=STEPS, accumulate=1):
    model = make_model(dtype)
    opt = make_optimizer(kind, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = make_data(step * accumulate + micro, dtype)
            loss_fn(model(x), y)
            model.backward(loss_fn.backward())
        opt.step()
    return model


def train_ddp(world, dtype, kind, steps=STEPS, accumulate=1, comm_hook=None, input_grad=True, **ddp_args):
    n, r = world.world_size, world.rank
    model = make_model(dtype, seed=0 if r == 0 else 1000 + r)  # DDP must copy rank 0's values
    ddp = ax.DDP(model, **ddp_args)
    if comm_hook is not None:
        ddp.register_comm_hook(*comm_hook)
    opt = make_optimizer(kind, ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        train_step(ddp, opt, loss_fn, r, n, step, accumulate, dtype, input_grad=input_grad)
    return ddp


def step_fn(wrapper, opt, loss_fn):
    """One whole step as a function of the batch, returning the loss: what ``ax.graph_step`` captures."""
    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(wrapper(x), y)
        wrapper.backward(loss_fn.backward())
        opt.step()
        return loss

    return step


def train_step(ddp, opt, loss_fn, r, n, step, accumulate=1, dtype=np.float64, before_step=None, put=None,
               input_grad=True):
    """One optimizer step on rank r's shard of ``accumulate`` global batches (no_sync before the last).

    ``before_step()``, if given, runs after the last backward and before the optimizer step (clipping);
    ``put``, if given, moves each batch shard where the model lives (``cupy.asarray``);
    ``input_grad=False`` is passed to the wrapper's backward, and it must then return None
    (the first Linear skipped d loss / d input).
    """
    put = put or (lambda a: a)

    def backward():
        if input_grad:
            return ddp.backward(loss_fn.backward())
        assert ddp.backward(loss_fn.backward(), input_grad=False) is None

    opt.zero_grad()
    for micro in range(accumulate):
        x, y = make_data(step * accumulate + micro, dtype)
        loss_fn(ddp(put(shard(x, r, n))), put(shard(y, r, n)))
        if micro < accumulate - 1:
            with ddp.no_sync():
                backward()
        else:
            backward()
    if before_step is not None:
        before_step()
    opt.step()


def assert_same_parameters(model, reference, dtype):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=TOL[dtype], atol=TOL[dtype], err_msg=name)


def parity(world, dtype, kind, accumulate=1, **ddp_args):
    ddp = train_ddp(world, dtype, kind, accumulate=accumulate, **ddp_args)
    assert_same_parameters(ddp.module, train_reference(dtype, kind, accumulate=accumulate), dtype)
    return ddp


def case_parity_sgd_float64(world):
    parity(world, np.float64, "sgd")


def case_parity_adam_float64(world):
    parity(world, np.float64, "adam")


def case_parity_adam_float32(world):
    parity(world, np.float32, "adam")


def case_parity_synchronous(world):
    parity(world, np.float64, "sgd", strategy=GradSyncStrategy.SYNCHRONOUS)


def case_parity_without_bucket_views(world):
    ddp = parity(world, np.float64, "adam", gradient_as_bucket_view=False)
    assert not any(np.shares_memory(p.grad, b.buffer) for b, ps in zip(ddp._buckets, ddp._bucket_params) for p in ps)


def case_parity_many_small_buckets(world):
    ddp = parity(world, np.float64, "sgd", bucket_size_mb=200 / 2**20)  # 200 bytes: 25 doubles
    assert len(ddp.bucket_plan) >= 6
    ddp2 = parity(world, np.float64, "sgd", bucket_size_mb=200 / 2**20, strategy="synchronous",
                  gradient_as_bucket_view=False)
    assert ddp2.bucket_plan == ddp.bucket_plan


def case_parity_without_input_grad(world):
    """backward(..., input_grad=False): the first Linear skips d loss / d x (returns None), same parameters."""
    parity(world, np.float64, "adam", input_grad=False)
    parity(world, np.float64, "sgd", accumulate=2, input_grad=False, strategy=GradSyncStrategy.SYNCHRONOUS)


def case_parity_no_sync_accumulation(world):
    parity(world, np.float64, "sgd", accumulate=3)
    parity(world, np.float64, "adam", accumulate=2, strategy=GradSyncStrategy.SYNCHRONOUS)


def case_overlapped_matches_synchronous(world):
    a = train_ddp(world, np.float64, "adam")
    b = train_ddp(world, np.float64, "adam", strategy=GradSyncStrategy.SYNCHRONOUS)
    for p, q in zip(a.parameters(), b.parameters()):
        if world.world_size <= 2:  # a sum of two is exact in any order
            np.testing.assert_array_equal(p.data, q.data)
        else:
            np.testing.assert_allclose(p.data, q.data, rtol=1e-13, atol=1e-13)


def case_grads_are_bucket_views_and_averaged(world):
    n, r = world.world_size, world.rank
    ddp = ax.DDP(make_model(), bucket_size_mb=1e-4)
    x, y = make_data(0)
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
    ddp.backward(loss_fn.backward())
    for b, params in zip(ddp._buckets, ddp._bucket_params):
        for p, view in zip(params, b.views):
            assert p.grad is view and np.shares_memory(p.grad, b.buffer)
    grads = [p.grad.copy() for p in ddp.parameters()]
    everyone = [ax.all_gather(g) for g in grads]
    for g, all_g in zip(grads, everyone):
        assert all(np.array_equal(g, all_g[k]) for k in range(n))  # identical on every rank
    # set_to_none breaks the views; the next backward restores them
    for p in ddp.parameters():
        p.zero_grad(set_to_none=True)
    loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
    ddp.backward(loss_fn.backward())
    for g, p in zip(grads, ddp.parameters()):
        np.testing.assert_allclose(p.grad, g, rtol=1e-14, atol=1e-15)
    assert all(p.grad is v for b, ps in zip(ddp._buckets, ddp._bucket_params) for p, v in zip(ps, b.views))


def case_sync_parameters_copies_rank0(world):
    r = world.rank
    model = make_model(seed=r * 7)
    ax.DDP(model)
    reference = make_model(seed=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


class WithBuffer(nn.Module):
    """A linear layer with a running-mean buffer and an optionally unused extra layer."""

    def __init__(self, use_extra=True):
        super().__init__()
        self.lin = nn.Linear(4, 2, dtype=np.float64, seed=3)
        self.extra = nn.Linear(2, 2, dtype=np.float64, seed=4)
        self.use_extra = use_extra
        self.register_buffer("running", np.zeros(4))

    def forward(self, x):
        self.running[...] = 0.9 * self.running + 0.1 * x.mean(axis=0)
        h = self.lin(x)
        return self.extra(h) if self.use_extra else h

    def backward(self, g):
        if self.use_extra:
            g = self.extra.backward(g)
        return self.lin.backward(g)


def case_broadcast_buffers(world):
    r = world.rank
    model = WithBuffer()
    model.running[...] = r + 1.0  # rank-dependent on purpose
    ddp = ax.DDP(model)
    assert np.all(model.running == 1.0)  # sync_parameters copies buffers too
    model.running[...] = r + 5.0
    x = np.full((3, 4), float(r))
    ddp(x)  # rank 0's buffer arrives before the forward
    assert np.allclose(model.running, 0.9 * 5.0 + 0.1 * r)


def case_unused_parameters(world):
    model = WithBuffer(use_extra=False)
    ddp = ax.DDP(model, bucket_size_mb=1e-5)
    x = np.ones((2, 4))
    out = ddp(x)
    with pytest.raises(UnusedParameterError, match=r"extra\.weight.*extra\.bias|extra\.bias.*extra\.weight"):
        ddp.backward(np.ones_like(out))
    model2 = WithBuffer(use_extra=False)
    ddp2 = ax.DDP(model2, bucket_size_mb=1e-5, find_unused_parameters=True)
    out = ddp2(x * (world.rank + 1))
    ddp2.backward(np.ones_like(out))
    # No rank gave them a gradient and they had none before: None, as PyTorch's DDP leaves them.
    assert model2.extra.weight.grad is None and model2.extra.bias.grad is None
    n = world.world_size
    np.testing.assert_allclose(model2.lin.bias.grad, np.full(2, 2.0))
    np.testing.assert_allclose(model2.lin.weight.grad, np.full((2, 4), 2.0 * (n + 1) / 2))


def case_bucket_plan_is_identical_everywhere(world):
    ddp = ax.DDP(make_model(), bucket_size_mb=300 / 2**20)
    plan = ddp.bucket_plan
    names = [name for name, _ in ddp.named_parameters()]
    flat = [name for bucket in plan for name in bucket]
    assert flat == names[::-1]  # reverse registration order
    sizes = dict((name, p.data.nbytes) for name, p in ddp.named_parameters())
    for bucket in plan:
        assert len(bucket) == 1 or sum(sizes[b] for b in bucket) <= 300
    code = np.frombuffer(repr(plan).encode().ljust(2048, b" ")[:2048], dtype=np.uint8).copy()
    everyone = ax.all_gather(code)
    assert all(np.array_equal(everyone[0], row) for row in everyone)


# -- uneven inputs: ddp.join() ---------------------------------------------------------------
def uneven_steps(rank):
    """Batches of each rank under join: 2, 3, 4, 2, ... (rank 0 ends first)."""
    return 2 + rank % 3


def train_reference_uneven(n, kind, divide_by_initial_world_size=True, extra_even_steps=0, accumulate=1):
    """One process: at step t, the gradient is the sum over the ranks still active, divided as join does."""
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    longest = max(uneven_steps(r) for r in range(n))
    for step in range(longest + extra_even_steps):
        active = [r for r in range(n) if step < uneven_steps(r) or step >= longest]
        opt.zero_grad()
        for r in active:
            for micro in range(accumulate):
                x, y = make_data(step * accumulate + micro)
                loss_fn(model(shard(x, r, n)), shard(y, r, n))
                model.backward(loss_fn.backward())
        for p in model.parameters():
            p.grad /= n if divide_by_initial_world_size else len(active)
        opt.step()
    return model


def train_ddp_uneven(world, kind, extra_even_steps=0, accumulate=1, pass_optimizer=True, **join_args):
    n, r = world.world_size, world.rank
    ddp = ax.DDP(make_model(seed=0 if r == 0 else 1000 + r), bucket_size_mb=300 / 2**20)
    opt = make_optimizer(kind, ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()

    def step(t):
        train_step(ddp, opt, loss_fn, r, n, t, accumulate)

    with ddp.join(optimizer=opt if pass_optimizer else None, **join_args):
        for t in range(uneven_steps(r)):
            step(t)
    longest = max(uneven_steps(q) for q in range(n))
    assert ddp.last_join["iterations"] == [uneven_steps(q) * accumulate for q in range(n)]
    assert ddp.last_join["shadowed"] == (longest - uneven_steps(r)) * accumulate
    for t in range(longest, longest + extra_even_steps):  # even inputs again after the join
        step(t)
    return ddp


def assert_identical_across_ranks(ddp):
    for name, p in ddp.named_parameters():
        everyone = ax.all_gather(p.data)
        for k in range(len(everyone)):
            np.testing.assert_array_equal(everyone[k], everyone[0], err_msg=f"{name} on rank {k}")


def case_join_uneven_inputs(world):
    ddp = train_ddp_uneven(world, "sgd")
    assert_same_parameters(ddp, train_reference_uneven(world.world_size, "sgd"), np.float64)
    assert_identical_across_ranks(ddp)


def case_join_divide_by_active_ranks(world):
    ddp = train_ddp_uneven(world, "adam", divide_by_initial_world_size=False)
    reference = train_reference_uneven(world.world_size, "adam", divide_by_initial_world_size=False)
    assert_same_parameters(ddp, reference, np.float64)


def case_join_keeps_optimizer_state_in_step(world):
    # Momentum and Adam moments of the joined ranks follow the active ones, so
    # training on after the join still matches the reference.
    for kind in ("sgd", "adam"):
        ddp = train_ddp_uneven(world, kind, extra_even_steps=2)
        assert_same_parameters(ddp, train_reference_uneven(world.world_size, kind, extra_even_steps=2), np.float64)
        assert_identical_across_ranks(ddp)


def case_join_with_no_sync_accumulation(world):
    ddp = train_ddp_uneven(world, "sgd", accumulate=2)
    assert_same_parameters(ddp, train_reference_uneven(world.world_size, "sgd", accumulate=2), np.float64)


def case_join_synchronous_without_bucket_views(world):
    n, r = world.world_size, world.rank
    model = make_model()
    ddp = ax.DDP(model, strategy=GradSyncStrategy.SYNCHRONOUS, gradient_as_bucket_view=False)
    opt = make_optimizer("sgd", ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    with ddp.join(optimizer=opt):
        for t in range(uneven_steps(r)):
            opt.zero_grad()
            x, y = make_data(t)
            loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
            ddp.backward(loss_fn.backward())
            opt.step()
    assert_same_parameters(ddp, train_reference_uneven(n, "sgd"), np.float64)


def case_join_buffers_come_from_an_active_rank(world):
    n, r = world.world_size, world.rank
    model = WithBuffer()
    ddp = ax.DDP(model)
    seen = []
    with ddp.join():
        for t in range(uneven_steps(r)):
            model.running[...] = 100.0 * r + t  # rank-dependent on purpose
            ddp(np.zeros((2, 4)))
            seen.append(float(model.running[0]))
            ddp.backward(np.ones((2, 2)))
    # Each forward used the buffer of the lowest rank still active (times 0.9: the forward's update).
    for t, value in enumerate(seen):
        lowest = min(q for q in range(n) if t < uneven_steps(q))
        assert value == pytest.approx(0.9 * (100.0 * lowest + t)), (t, value, lowest)
    everyone = ax.all_gather(model.running.copy())
    assert all(np.array_equal(row, everyone[0]) for row in everyone)


def case_join_refuses_disagreeing_ranks(world):
    if world.world_size < 2:
        return
    r = world.rank
    ddp = ax.DDP(make_model())
    x, _ = make_data(0)
    one = np.ones(1)
    with pytest.raises(ax.errors.ConfigurationError, match=r"must agree on synchronising gradients"):
        with ddp.join():
            out = ddp(x[:2])
            if r == 0:
                with ddp.no_sync():
                    ddp.backward(np.ones_like(out))
            else:
                ddp.backward(np.ones_like(out))
    with pytest.raises(ax.errors.ConfigurationError, match=r"different points of an iteration"):
        with ddp.join():
            out = ddp(x[:2])
            if r != 0:
                ddp.backward(np.ones_like(out))  # rank 0 skips its backward
            ddp(x[:2])
    # Each error was raised on every rank together: the group still works.
    ax.all_reduce(one)
    assert one[0] == world.world_size


def case_join_disabled_is_plain_ddp(world):
    ddp = train_ddp(world, np.float64, "sgd")
    with ddp.join(enable=False):
        pass
    assert ddp._joiner.state is None


# -- communication hooks ---------------------------------------------------------------------
def _train_with_hook(world, hook, state=None, dtype=np.float32, kind="sgd"):
    return train_ddp(world, dtype, kind, comm_hook=None if hook is None else (state, hook),
                     bucket_size_mb=300 / 2**20)


def case_comm_hook_default_and_custom_equal_plain_ddp(world):
    from axonhpc.parallel.comm_hooks import allreduce_hook

    plain = _train_with_hook(world, None, dtype=np.float64)
    default = _train_with_hook(world, allreduce_hook, dtype=np.float64)
    calls = {"buckets": []}

    def summing_hook(state, bucket):  # a user hook: SUM, then divide (what AVG does)
        assert bucket.kind == "all_reduce" and bucket.group.size == world.world_size
        state["buckets"].append(bucket.index)
        work = ax.all_reduce(bucket.buffer, "SUM", bucket.group, async_op=True)
        return work.then(lambda: np.divide(bucket.buffer, bucket.group.size, out=bucket.buffer))

    custom = _train_with_hook(world, summing_hook, state=calls, dtype=np.float64)
    buckets = len(custom.bucket_plan)
    assert calls["buckets"] == list(range(buckets)) * STEPS  # in plan order, every step
    for other in (default, custom):
        for (name, p), (_, q) in zip(other.named_parameters(), plain.named_parameters()):
            np.testing.assert_array_equal(p.data, q.data, err_msg=name)


def case_comm_hook_fp16_and_bf16_compression(world):
    from axonhpc._dtypes import bfloat16_dtype
    from axonhpc.parallel import bf16_compress_hook, fp16_compress_hook

    reference = train_reference(np.float32, "sgd")
    for hook, tol in ((fp16_compress_hook, 2e-3), (bf16_compress_hook, 2e-2)):
        if hook is bf16_compress_hook and bfloat16_dtype() is None:
            continue
        ddp = _train_with_hook(world, hook)
        for (name, p), (_, q) in zip(ddp.named_parameters(), reference.named_parameters()):
            np.testing.assert_allclose(p.data, q.data, rtol=tol, atol=tol, err_msg=f"{hook.__name__} {name}")
        for name, p in ddp.named_parameters():  # the same bits everywhere
            everyone = ax.all_gather(p.data)
            assert all(np.array_equal(row, everyone[0]) for row in everyone), name


def case_compressed_average_error_is_bounded(world):
    """The error of one compressed average against the exact one: the bound of collectives.compressed."""
    n, r = world.world_size, world.rank
    grads = [np.random.default_rng(k).standard_normal(4099).astype(np.float32) for k in range(n)]
    exact = np.mean(np.stack(grads).astype(np.float64), axis=0)
    half = grads[r].copy()
    ax.compressed_all_reduce(half, "float16")
    scale = np.max(np.abs(exact))
    error = np.max(np.abs(half - exact)) / scale
    assert error <= (n + 1) * 2.0**-11, error  # one rounding per hop plus the first, in units of the largest
    part = ax.compressed_reduce_scatter(np.concatenate([grads[r]] * n), "float16")
    np.testing.assert_allclose(part, exact, rtol=0, atol=(n + 1) * 2.0**-11 * scale)


def case_comm_hook_bad_registration(world):
    ddp = ax.DDP(make_model())
    with pytest.raises(TypeError, match="must be callable"):
        ddp.register_comm_hook(None, "not a hook")
    ddp.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(ax.errors.ConfigurationError, match="already has a communication hook"):
        ddp.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(ax.errors.ConfigurationError, match="a communication hook always averages"):
        with ddp.join(divide_by_initial_world_size=False):
            pass


def train_autocast_float16(world, put=None, on_device=None):
    """DDP with float32 masters, float16 products and the scale in the loss, and its single-process reference.

    The reference runs each rank's shard on its own (a float16 product over the whole batch would round
    differently) and averages the float32 gradients, which is what DDP's all-reduce computes. ``put`` and
    ``on_device`` move the batches and the DDP model to a device (the reference stays on the host).

    Returns:
        ``(ddp, reference)`` after STEPS steps.
    """
    n, r = world.world_size, world.rank
    put = put or (lambda a: a)
    scale = 2.0 ** 10
    loss_fn = nn.CrossEntropyLoss()
    model = make_model(np.float32, seed=0 if r == 0 else 1000 + r)
    ddp = ax.DDP(model if on_device is None else on_device(model))
    opt = make_optimizer("sgd", ddp.parameters())
    scaler = ax.GradScaler(init_scale=scale, growth_interval=10 ** 6)
    reference = make_model(np.float32)
    ref_opt = make_optimizer("sgd", reference.parameters())
    for step in range(STEPS):
        x, y = make_data(step, np.float32)
        opt.zero_grad()
        with nn.autocast("float16"):
            loss_fn(ddp(put(shard(x, r, n))), put(shard(y, r, n)))
        ddp.backward(loss_fn.backward(scaler.scale(1.0)))
        assert scaler.step(opt)
        scaler.update()
        total = [np.zeros_like(p.data) for p in reference.parameters()]
        for k in range(n):
            reference.zero_grad(set_to_none=True)
            with nn.autocast("float16"):
                loss_fn(reference(shard(x, k, n)), shard(y, k, n))
            reference.backward(loss_fn.backward(scale))
            for t, p in zip(total, reference.parameters()):
                t += p.grad
        for t, p in zip(total, reference.parameters()):
            p.grad = t / np.float32(n) / np.float32(scale)
        ref_opt.step()
    assert all(p.grad.dtype == np.float32 and p.data.dtype == np.float32 for p in ddp.parameters())
    return ddp, reference


def case_parity_autocast_float16_with_scaler(world):
    ddp, reference = train_autocast_float16(world)
    assert_same_parameters(ddp.module, reference, np.float32)

class Faulty(nn.Module):
    """Passes values through; its backward raises on the ranks in ``failing`` (a bug in a user's layer)."""

    def __init__(self, failing=()):
        super().__init__()
        self.failing = set(failing)

    def forward(self, x):
        return x

    def backward(self, g):
        rank = ax.get_rank()
        if rank in self.failing:
            raise ValueError(f"layer failed on rank {rank}")
        return g


def _faulty_model(faulty):
    # Several buckets on either side of the failing layer: some are in flight when it raises.
    return nn.Sequential(nn.Linear(4, 16, dtype=np.float64, seed=1), nn.Tanh(), nn.Linear(16, 16, dtype=np.float64, seed=2),
                         faulty, nn.Tanh(), nn.Linear(16, 16, dtype=np.float64, seed=3), nn.Tanh(),
                         nn.Linear(16, 3, dtype=np.float64, seed=4))


def _averaged_grads(world, model, x_of):
    """What a good step must give: the average over the ranks of each rank's local gradients (one process)."""
    total = None
    for r in range(world.world_size):
        for p in model.parameters():
            p.zero_grad()
        out = model(x_of(r))
        model.backward(np.ones_like(out))
        grads = [p.grad.copy() for p in model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return [t / world.world_size for t in total]


def case_failed_backward_reaches_every_rank(world):
    # The last rank's backward raises mid-way: it tells the group, so the others raise CollectiveRefusedError
    # naming its error instead of waiting in a bucket it never launches (or, blocking, taking the next step's
    # buckets for this one's). The next step is whole on every rank.
    n, r = world.world_size, world.rank
    x_of = lambda rank: np.linspace(-1, 1, 24).reshape(6, 4) * (rank + 1)  # noqa: E731
    for strategy in (GradSyncStrategy.OVERLAPPED, GradSyncStrategy.SYNCHRONOUS):
        for failing in ({n - 1}, set(range(n))):
            faulty = Faulty(failing)
            model = _faulty_model(faulty)
            expected = _averaged_grads(world, _faulty_model(Faulty()), x_of)
            ddp = ax.DDP(model, strategy=strategy, bucket_size_mb=1e-4)
            assert len(ddp.bucket_plan) >= 4
            out = ddp(x_of(r))
            if r in failing:
                with pytest.raises(ValueError, match=f"layer failed on rank {r}"):
                    ddp.backward(np.ones_like(out))
            else:
                with pytest.raises(ax.errors.CollectiveRefusedError,
                                   match=f"rank {n - 1} refused.*ValueError: layer failed on rank {n - 1}") as info:
                    ddp.backward(np.ones_like(out))
                assert info.value.rank == n - 1
            faulty.failing = set()
            ddp.zero_grad()
            out = ddp(x_of(r))
            ddp.backward(np.ones_like(out))
            for p, e in zip(model.parameters(), expected):
                np.testing.assert_allclose(p.grad, e, rtol=1e-12, atol=1e-14)


def case_failed_training_forward_reaches_every_rank(world):
    # The last rank's forward raises (a bad batch there): the others hear of it in their backward's first
    # bucket instead of waiting in it; in eval mode a failed forward is the rank's own.
    n, r = world.world_size, world.rank
    x_of = lambda rank: np.linspace(-1, 1, 24).reshape(6, 4) * (rank + 1)  # noqa: E731
    for strategy in (GradSyncStrategy.OVERLAPPED, GradSyncStrategy.SYNCHRONOUS):
        model = _faulty_model(Faulty())
        expected = _averaged_grads(world, _faulty_model(Faulty()), x_of)
        ddp = ax.DDP(model, strategy=strategy, bucket_size_mb=1e-4)
        if r == n - 1:
            with pytest.raises(ax.errors.ShapeError, match="Linear"):
                ddp(np.ones((6, 5)))  # 5 features, not 4
        else:
            out = ddp(x_of(r))
            with pytest.raises(ax.errors.CollectiveRefusedError,
                               match=f"rank {n - 1} refused.*ShapeError: Linear") as info:
                ddp.backward(np.ones_like(out))
            assert info.value.rank == n - 1
        ddp.zero_grad()
        out = ddp(x_of(r))
        ddp.backward(np.ones_like(out))
        for p, e in zip(model.parameters(), expected):
            np.testing.assert_allclose(p.grad, e, rtol=1e-12, atol=1e-14)
        ddp.eval()
        if r == n - 1:  # alone, in eval mode: raises at once, nobody is told
            with pytest.raises(ax.errors.ShapeError):
                ddp(np.ones((6, 5)))
        ax.barrier()
        ddp.train()


def case_unused_parameter_on_some_ranks_reaches_every_rank(world):
    # A gradient that only rank 0 computes: the others raise UnusedParameterError, and rank 0 hears of it
    # instead of waiting for their last bucket.
    n, r = world.world_size, world.rank
    model = WithBuffer(use_extra=r == 0)
    ddp = ax.DDP(model, bucket_size_mb=1e-5)
    out = ddp(np.ones((2, 4)))
    if r == 0 and n > 1:
        with pytest.raises(ax.errors.CollectiveRefusedError, match="UnusedParameterError: parameters .*extra"):
            ddp.backward(np.ones_like(out))
    elif r > 0:
        with pytest.raises(UnusedParameterError, match="extra"):
            ddp.backward(np.ones_like(out))
    else:
        ddp.backward(np.ones_like(out))  # one rank alone: nothing is unused
    model.use_extra = True
    ddp.zero_grad()
    out = ddp(np.ones((2, 4)))
    ddp.backward(np.ones_like(out))
    grads = ax.all_gather(np.concatenate([p.grad.ravel() for p in model.parameters()]))
    assert all(np.array_equal(grads[0], row) for row in grads)


class SometimesBranch(nn.Module):
    """``out = head(tanh(body(x)))``, plus ``side(x)`` added on the steps where ``use_side`` is set."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6, dtype=np.float64, seed=11)
        self.act = nn.Tanh()
        self.head = nn.Linear(6, 3, dtype=np.float64, seed=12)
        self.side = nn.Linear(4, 3, dtype=np.float64, seed=13)
        self.use_side = True

    def forward(self, x):
        self._side = self.use_side
        out = self.head(self.act(self.body(x)))
        return out + self.side(x) if self._side else out

    def backward(self, g):
        gx = self.body.backward(self.act.backward(self.head.backward(g)))
        return gx + self.side.backward(g) if self._side else gx


def case_parameters_without_a_gradient_are_skipped_by_the_optimizer(world):
    # find_unused_parameters=True, zero_grad(set_to_none=True), a branch used on some steps only: where no
    # rank used it, its grad stays None and Adam (and SGD's momentum and weight decay) skip it, as in one
    # process. Where some ranks used it, it is averaged with the others' zeros.
    n, r = world.world_size, world.rank
    x_of = lambda step, rank: np.linspace(-1, 1, 12).reshape(3, 4) * (rank + 1) + step  # noqa: E731
    used_by = lambda step: {0} if step % 3 == 1 else (set() if step % 3 == 2 else set(range(n)))  # noqa: E731
    for strategy in (GradSyncStrategy.OVERLAPPED, GradSyncStrategy.SYNCHRONOUS):
        for opt_cls, kwargs in ((optim.Adam, dict(lr=1e-2)), (optim.SGD, dict(lr=0.1, momentum=0.9,
                                                                               weight_decay=1e-2))):
            reference, model = SometimesBranch(), SometimesBranch()
            ref_opt = opt_cls(reference.parameters(), **kwargs)
            ddp = ax.DDP(model, strategy=strategy, find_unused_parameters=True, bucket_size_mb=1e-4)
            opt = opt_cls(ddp.parameters(), **kwargs)
            for step in range(6):
                ref_opt.zero_grad(set_to_none=True)
                for q in range(n):  # the reference: the average of every rank's gradients, one process
                    reference.use_side = q in used_by(step)
                    out = reference(x_of(step, q))
                    reference.backward(np.ones_like(out) / n)
                ref_opt.step()
                opt.zero_grad(set_to_none=True)
                model.use_side = r in used_by(step)
                out = ddp(x_of(step, r))
                ddp.backward(np.ones_like(out))
                assert (model.side.weight.grad is None) == (not used_by(step)), step
                opt.step()
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-13, err_msg=f"{strategy} {name}")


def _accumulated_steps(world, mode, strategy, find_unused, used, steps, opt_cls, kwargs):
    """Train SometimesBranch for ``steps`` steps of two micro-steps each (``mode``: "NO_SYNC", every backward
    unsynchronised and ``sync_gradients()`` after; "no_sync", the first inside ``ddp.no_sync()``), ``side`` used where
    ``used(step, micro, rank)``; compare with one process accumulating every rank's micro-steps."""
    n, r = world.world_size, world.rank
    x_of = lambda step, micro, rank: np.linspace(-1, 1, 12).reshape(3, 4) * (rank + 1) + step + micro  # noqa: E731
    reference, model = SometimesBranch(), SometimesBranch()
    ref_opt = opt_cls(reference.parameters(), **kwargs)
    ddp = ax.DDP(model, strategy=GradSyncStrategy.NO_SYNC if mode == "NO_SYNC" else strategy,
                 find_unused_parameters=find_unused, bucket_size_mb=1e-4)
    opt = opt_cls(ddp.parameters(), **kwargs)
    for step in range(steps):
        ref_opt.zero_grad(set_to_none=True)
        for q in range(n):
            for micro in range(2):
                reference.use_side = used(step, micro, q)
                out = reference(x_of(step, micro, q))
                reference.backward(np.ones_like(out) / n)
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        for micro in range(2):
            model.use_side = used(step, micro, r)
            if mode == "no_sync" and micro == 0:
                with ddp.no_sync():
                    out = ddp(x_of(step, micro, r))
                    ddp.backward(np.ones_like(out))
            else:
                out = ddp(x_of(step, micro, r))
                ddp.backward(np.ones_like(out))
        if mode == "NO_SYNC":
            ddp.sync_gradients()
        anyone = any(used(step, micro, q) for micro in range(2) for q in range(n))
        assert (model.side.weight.grad is None) == (not anyone), (mode, step)
        opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-13, err_msg=f"{mode} {strategy} {name}")


def case_accumulated_micro_steps_skip_a_parameter_no_rank_used(world):
    # "No gradient" counts every backward since the last synchronisation. Before, NO_SYNC's sync_gradients() gave
    # a parameter no rank used a zero gradient, which weight decay, momentum and Adam then stepped (8e-3 here).
    used = lambda step, micro, rank: (step % 3 == 0 and micro == 0) or (step % 3 == 1 and rank == 0)  # noqa: E731
    for mode, strategy in (("NO_SYNC", None), ("no_sync", GradSyncStrategy.OVERLAPPED),
                           ("no_sync", GradSyncStrategy.SYNCHRONOUS)):
        for opt_cls, kwargs in ((optim.Adam, dict(lr=1e-2)), (optim.SGD, dict(lr=0.1, momentum=0.9,
                                                                               weight_decay=1e-2))):
            _accumulated_steps(world, mode, strategy, True, used, 6, opt_cls, kwargs)


def case_a_parameter_used_in_one_micro_step_only_is_not_unused(world):
    # Without find_unused_parameters: a parameter every rank used in the first micro-step only was refused as
    # unused by the synchronising backward; NO_SYNC's sync_gradients() refused nothing, even a parameter no
    # backward reached. Now both count the micro-steps, and refuse on every rank what none of them reached.
    sgd = (optim.SGD, dict(lr=0.1, momentum=0.9))
    for mode, strategy in (("NO_SYNC", None), ("no_sync", GradSyncStrategy.OVERLAPPED),
                           ("no_sync", GradSyncStrategy.SYNCHRONOUS)):
        _accumulated_steps(world, mode, strategy, False, lambda step, micro, rank: micro == 0, 3, *sgd)
        with pytest.raises(UnusedParameterError, match=r"side\.weight"):
            _accumulated_steps(world, mode, strategy, False, lambda step, micro, rank: False, 1, *sgd)


def case_synchronous_refuses_an_unused_parameter_too(world):
    model = WithBuffer(use_extra=False)
    ddp = ax.DDP(model, strategy=GradSyncStrategy.SYNCHRONOUS, bucket_size_mb=1e-5)
    out = ddp(np.ones((2, 4)))
    with pytest.raises(UnusedParameterError, match=r"extra\.weight.*extra\.bias|extra\.bias.*extra\.weight"):
        ddp.backward(np.ones_like(out))


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
