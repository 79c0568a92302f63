"""Every parallel strategy on device (cupy) arrays, against single-process host training.

Written once and run two ways:

- on CI, on threads, with ``fake_cuda``'s strict cupy stand-in (not a numpy
  subclass: it refuses implicit conversion to numpy, host arrays mixed in,
  ``flags.writeable``, the buffer protocol, as cupy does) and the fake NCCL,
  by ``tests/parallel/test_device_strategies.py`` at 1-4 ranks;
- on a GPU node, with real cupy, by ``tests/parallel/test_gpu_strategies.py`` (marked
  ``gpu``; ``scripts/gpu-check.sh`` runs it on one rank and on two ranks).

Each case is ``case_*(world, cupy)``: it builds the model on the host with
the reference's seed, moves it with ``model.to("cuda")``, trains on this
rank's shard of each global batch (moved with ``cupy.asarray``), and checks
that every parameter is still a device array and equals the host reference
(float64: 1e-12, float32: 1e-5 relative).
"""
import os
import tempfile

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.bucketing import GradSyncStrategy
from support.ddp_cases import STEPS, TOL, make_data, make_model, make_optimizer, shard, train_reference, train_step


def host(a):
    """A host copy of a device array (numpy arrays as they are)."""
    return a if isinstance(a, np.ndarray) else a.get()


def assert_on_device(cupy, model):
    for name, p in model.named_parameters():
        assert isinstance(p.data, cupy.ndarray), f"{name} left the device: {type(p.data)}"
        assert p.grad is None or isinstance(p.grad, cupy.ndarray), f"{name}.grad left the device"


def assert_matches(named, reference, dtype, rtol=None):
    tol = TOL[dtype] if rtol is None else rtol
    for (name, p), (_, q) in zip(named, reference.named_parameters()):
        np.testing.assert_allclose(host(p.data), q.data, rtol=tol, atol=tol, err_msg=name)


def device_model(cupy, world, dtype=np.float64, seed_others=True):
    """The reference model (rank 0's seed; other ranks a different one: the wrapper must copy rank 0's)."""
    r = world.rank
    return make_model(dtype, seed=0 if (r == 0 or not seed_others) else 1000 + r).to("cuda")


def device_batch(cupy, step, r, n, dtype=np.float64, micro=0, accumulate=1):
    x, y = make_data(step * accumulate + micro, dtype)
    return cupy.asarray(shard(x, r, n)), cupy.asarray(shard(y, r, n))


def train(cupy, world, wrapper, opt, dtype=np.float64, steps=STEPS, accumulate=1, before_step=None):
    """``ddp_cases.train_step`` with every batch shard moved to the device."""
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        train_step(wrapper, opt, loss_fn, world.rank, world.world_size, step, accumulate, dtype, before_step,
                   put=cupy.asarray)


# -- DDP -------------------------------------------------------------------------------------------
def _ddp(cupy, world, dtype=np.float64, kind="sgd", accumulate=1, **ddp_args):
    model = device_model(cupy, world, dtype)
    ddp = ax.DDP(model, **ddp_args)
    opt = make_optimizer(kind, ddp.parameters())
    train(cupy, world, ddp, opt, dtype, accumulate=accumulate)
    assert_on_device(cupy, model)
    assert_matches(model.named_parameters(), train_reference(dtype, kind, accumulate=accumulate), dtype)
    return ddp


def case_ddp_overlapped_sgd_float64(world, cupy):
    ddp = _ddp(cupy, world)
    # gradients are views into the device buckets: no pack copy
    for bucket, params in zip(ddp._buckets, ddp._bucket_params):
        assert isinstance(bucket.buffer, cupy.ndarray) and bucket.copies is None
        for p in params:
            assert p.grad.data.ptr >= bucket.buffer.data.ptr


def case_ddp_adam_float32(world, cupy):
    _ddp(cupy, world, np.float32, "adam")


def case_ddp_synchronous_without_bucket_views(world, cupy):
    _ddp(cupy, world, strategy=GradSyncStrategy.SYNCHRONOUS, gradient_as_bucket_view=False)


def case_ddp_many_small_buckets(world, cupy):
    _ddp(cupy, world, bucket_size_mb=200 / 2**20)


def case_ddp_no_sync_accumulation(world, cupy):
    _ddp(cupy, world, accumulate=3)


def case_ddp_comm_hook_fp16_compression(world, cupy):
    from axonhpc.parallel import fp16_compress_hook

    model = device_model(cupy, world, np.float32)
    ddp = ax.DDP(model)
    ddp.register_comm_hook(None, fp16_compress_hook)
    opt = make_optimizer("sgd", ddp.parameters())
    train(cupy, world, ddp, opt, np.float32)
    assert_on_device(cupy, model)
    assert_matches(model.named_parameters(), train_reference(np.float32, "sgd"), np.float32, rtol=2e-2)


def case_ddp_autocast_float16_with_loss_scaler(world, cupy):
    """float32 masters on the device, float16 products (cuBLAS's on a GPU, so float16 rounding tolerance)."""
    from support.ddp_cases import train_autocast_float16

    ddp, reference = train_autocast_float16(world, put=cupy.asarray, on_device=lambda m: m.to("cuda"))
    assert_on_device(cupy, ddp.module)
    assert_matches(ddp.module.named_parameters(), reference, np.float32, rtol=2e-2)


def case_ddp_join_uneven_inputs(world, cupy):
    from support.ddp_cases import train_reference_uneven, uneven_steps

    n, r = world.world_size, world.rank
    model = device_model(cupy, world)
    ddp = ax.DDP(model)
    opt = make_optimizer("sgd", ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    with ddp.join(optimizer=opt):
        for step in range(uneven_steps(r)):
            opt.zero_grad()
            x, y = make_data(step)
            loss_fn(ddp(cupy.asarray(shard(x, r, n))), cupy.asarray(shard(y, r, n)))
            ddp.backward(loss_fn.backward())
            opt.step()
    assert_on_device(cupy, model)
    reference = train_reference_uneven(n, "sgd")
    assert_matches(model.named_parameters(), reference, np.float64)


def case_mixed_host_and_device_model_is_refused_before_any_message(world, cupy):
    model = make_model(np.float64)
    model[0].to("cuda")  # one layer on the device, the rest on the host
    for wrap in (ax.DDP, ax.FSDP):
        with pytest.raises(ax.errors.ConfigurationError, match="two kinds of memory"):
            wrap(model)


# -- ZeRO-1 ----------------------------------------------------------------------------------------
def case_zero1_under_ddp_adam_float64(world, cupy):
    model = device_model(cupy, world)
    ddp = ax.DDP(model)
    opt = ax.ZeroRedundancyOptimizer(optim.Adam, ddp.parameters(), lr=1e-2)
    train(cupy, world, ddp, opt)
    assert_on_device(cupy, model)
    for shard_ in opt._shards:
        assert isinstance(shard_.param.data, cupy.ndarray)
    assert_matches(model.named_parameters(), train_reference(np.float64, "adam"), np.float64)


# -- FSDP ------------------------------------------------------------------------------------------
def _fsdp(cupy, world, strategy, dtype=np.float64, kind="sgd", **kwargs):
    from support.fsdp_cases import hybrid_kwargs

    model = device_model(cupy, world, dtype)
    fsdp = ax.FSDP(model, sharding_strategy=strategy, **hybrid_kwargs(world, strategy), **kwargs)
    opt = make_optimizer(kind, fsdp.parameters())
    train(cupy, world, fsdp, opt, dtype)
    fsdp.optimizer_ = opt  # the trained optimizer, for the state-dict case
    return fsdp


def _fsdp_matches(cupy, fsdp, reference, dtype, rtol=None, master_on_device=True):
    for p in fsdp.parameters():
        assert isinstance(p.data, cupy.ndarray) == master_on_device, type(p.data)
    full = fsdp.full_state_dict(rank0_only=False)
    tol = TOL[dtype] if rtol is None else rtol
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(host(full[name]), value, rtol=tol, atol=tol, err_msg=name)


def _fsdp_strategy(strategy):
    def case(world, cupy):
        fsdp = _fsdp(cupy, world, strategy)
        _fsdp_matches(cupy, fsdp, train_reference(np.float64, "sgd"), np.float64)

    return case


case_fsdp_full_shard_float64 = _fsdp_strategy("full_shard")
case_fsdp_shard_grad_op_float64 = _fsdp_strategy("shard_grad_op")
case_fsdp_no_shard_float64 = _fsdp_strategy("no_shard")
case_fsdp_hybrid_shard_float64 = _fsdp_strategy("hybrid_shard")


def case_fsdp_adam_float32(world, cupy):
    fsdp = _fsdp(cupy, world, "full_shard", np.float32, "adam")
    _fsdp_matches(cupy, fsdp, train_reference(np.float32, "adam"), np.float32)


def _fsdp_offload(offload):
    def case(world, cupy):
        fsdp = _fsdp(cupy, world, "full_shard", cpu_offload=offload)
        _fsdp_matches(cupy, fsdp, train_reference(np.float64, "sgd"), np.float64, master_on_device=False)

    return case


case_fsdp_cpu_offload_params = _fsdp_offload("params")
case_fsdp_cpu_offload_optimizer_states = _fsdp_offload("optimizer_states")
case_fsdp_cpu_offload_full = _fsdp_offload("full")


def case_fsdp_mixed_precision_float16_with_loss_scaler(world, cupy):
    """float16 compute and reduction, float32 masters, the loss scaler: close to float32 host training."""
    n, r = world.world_size, world.rank
    model = device_model(cupy, world, np.float32)
    fsdp = ax.FSDP(model, mixed_precision=ax.MixedPrecision(np.float16, np.float16))
    opt = optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    scaler = ax.GradScaler(init_scale=2.0 ** 8)
    loss_fn = nn.CrossEntropyLoss()
    taken = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = device_batch(cupy, step, r, n, np.float32)
        loss_fn(fsdp(x), y)
        fsdp.backward(scaler.scale(loss_fn.backward()))
        taken.append(scaler.step(opt))
        scaler.update()
    assert taken == [True] * STEPS
    _fsdp_matches(cupy, fsdp, train_reference(np.float32, "sgd"), np.float32, rtol=2e-2)


def case_fsdp_sharded_and_full_state_dicts_load_back_onto_the_device(world, cupy):
    fsdp = _fsdp(cupy, world, "full_shard", kind="adam")
    saved = fsdp.sharded_state_dict(fsdp.optimizer_)
    fresh = ax.FSDP(device_model(cupy, world, seed_others=False))
    fresh_opt = make_optimizer("adam", fresh.parameters())
    fresh.load_state_dict(saved, fresh_opt)
    for p, q in zip(fsdp.parameters(), fresh.parameters()):
        assert isinstance(q.data, cupy.ndarray)
        np.testing.assert_array_equal(host(p.data), host(q.data))
    for slot in fresh_opt.state if isinstance(fresh_opt.state, list) else fresh_opt.state.values():
        for value in slot.values():
            assert getattr(value, "ndim", 0) == 0 or isinstance(value, cupy.ndarray)
    fresh.load_state_dict(fsdp.full_state_dict(rank0_only=False))
    for p, q in zip(fsdp.parameters(), fresh.parameters()):
        assert isinstance(q.data, cupy.ndarray)
        np.testing.assert_array_equal(host(p.data), host(q.data))


# -- tensor and pipeline parallelism -----------------------------------------------------------------
def case_tensor_parallel_mlp_training(world, cupy):
    """The TP MLP on the device against its dense equivalent on the host, both on the whole batch."""
    from support.tp_cases import FFN, HIDDEN, STEPS as TP_STEPS, batch, check_mlp_shards
    from support.tp_cases import make_optimizer as tp_optimizer

    tp = ax.TensorParallelMLP(HIDDEN, FFN, dtype=np.float64, seed=21).to("cuda")
    dense = ax.TensorParallelMLP.dense_equivalent(HIDDEN, FFN, dtype=np.float64, seed=21)
    opts = [tp_optimizer("adam", m.parameters()) for m in (tp, dense)]
    for step in range(TP_STEPS):
        x, target, _ = batch(step)
        for model, opt, xs, ts in ((tp, opts[0], cupy.asarray(x), cupy.asarray(target)), (dense, opts[1], x, target)):
            loss_fn = nn.MSELoss()
            opt.zero_grad()
            loss_fn(model(xs), ts)
            model.backward(loss_fn.backward())
            opt.step()
    assert_on_device(cupy, tp)
    for _, p in tp.named_parameters():  # the shard check reads host arrays
        p.data = host(p.data)
    check_mlp_shards(tp, dense, world, "after Adam steps on the device")


def _pipeline(world, cupy, schedule, m, v=1):
    from support.pipeline_cases import STEPS as PP_STEPS, close, make_data as pp_data, make_stages, train_reference as pp_ref

    p, r = world.world_size, world.rank
    stages = make_stages(p * v)
    for k in range(p * v):
        stages[k].to("cuda")
    pipe = ax.Pipeline.from_modules(stages, num_microbatches=m, schedule=schedule, stages_per_rank=v,
                                    loss_fn=nn.CrossEntropyLoss())
    opt = make_optimizer("sgd", pipe.parameters())
    reference, ref_losses = pp_ref(p * v, "sgd")
    for step in range(PP_STEPS):
        x, y = pp_data(step)
        opt.zero_grad()
        loss = pipe.train_step(cupy.asarray(x) if r == 0 else None, cupy.asarray(y) if r == p - 1 else None)
        if r == p - 1:
            close(float(loss), ref_losses[step], f"loss at step {step}")
        opt.step()
    for s in range(r, p * v, p):  # this rank's stages
        for (name, q), (_, q_ref) in zip(stages[s].named_parameters(), reference[s].named_parameters()):
            assert isinstance(q.data, cupy.ndarray), name
            close(host(q.data), q_ref.data, f"stage {s} {name} ({schedule})")


def case_pipeline_gpipe(world, cupy):
    _pipeline(world, cupy, ax.PipelineSchedule.GPIPE, 4)


def case_pipeline_1f1b(world, cupy):
    _pipeline(world, cupy, ax.PipelineSchedule.ONE_F_ONE_B, 3)


def case_pipeline_interleaved_1f1b(world, cupy):
    """Two stages per rank: a rank waits on the host for a shape header while its output's isend is queued."""
    _pipeline(world, cupy, ax.PipelineSchedule.INTERLEAVED_1F1B, 2 * world.world_size, v=2)


# -- a GPT on a dp x tp x pp mesh ---------------------------------------------------------------------
GPT_LAYOUTS = {1: (1, 1, 1), 2: (1, 1, 2), 3: (3, 1, 1), 4: (1, 2, 2)}


def case_parallel_gpt_on_a_mesh(world, cupy):
    """ParallelGPT with device parts and tokens: the one-process host losses, parameters left on the device."""
    from support.gpt_parallel_cases import CONFIG, GLOBAL_BATCH, LR, batches, reference

    dp, tp, pp = GPT_LAYOUTS[world.world_size]
    data, held = batches(), batches(1, seed=99)[0]
    ref_losses, ref_held, _ = reference(data, held)
    mesh = world.mesh(dp=dp, tp=tp, pp=pp)
    model = ax.ParallelGPT(mesh, **CONFIG, num_microbatches=pp, device="cuda")
    opt = optim.AdamW(model.parameters(), lr=LR)
    b, d = GLOBAL_BATCH // dp, mesh.coords.dp
    for step, (x, y) in enumerate(data):
        model.zero_grad()
        loss = model.train_step(cupy.asarray(x[d * b:(d + 1) * b]), cupy.asarray(y[d * b:(d + 1) * b]))
        np.testing.assert_allclose(loss, ref_losses[step], rtol=1e-10, err_msg=f"loss at step {step}")
        opt.step()
    model.eval()
    held_loss = model.loss(cupy.asarray(held[0][d * b:(d + 1) * b]), cupy.asarray(held[1][d * b:(d + 1) * b]))
    np.testing.assert_allclose(held_loss, ref_held, rtol=1e-10)
    for part in model.parts:
        assert_on_device(cupy, part)


# -- parameter server --------------------------------------------------------------------------------
def case_parameter_server_sync(world, cupy):
    """Device workers against the host reference; servers hold their slices in device memory too."""
    from support.ps_cases import OPTIMIZERS

    model = device_model(cupy, world)
    cls, kwargs = OPTIMIZERS["sgd"]
    ps = ax.ParameterServer(model, num_servers=1, optimizer_class=cls, **kwargs)
    loss_fn = nn.CrossEntropyLoss()
    with ps:
        if ps.is_worker:
            w, n = ps.worker_index, ps.num_workers
            ps.pull()
            for step in range(STEPS):
                ps.zero_grad()
                x, y = make_data(step)
                loss_fn(model(cupy.asarray(shard(x, w, n))), cupy.asarray(shard(y, w, n)))
                model.backward(loss_fn.backward())
                ps.step()
    if ps.is_worker:
        assert_on_device(cupy, model)
        assert_matches(model.named_parameters(), train_reference(np.float64, "sgd"), np.float64)


# -- checkpoints -------------------------------------------------------------------------------------
def case_checkpoint_of_a_device_model_round_trips_through_the_host(world, cupy):
    from axonhpc import checkpoint

    model = device_model(cupy, world, seed_others=False)
    opt = make_optimizer("adam", model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    x, y = device_batch(cupy, 0, 0, 1)
    loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"rank{world.rank}.npz")
        alone = ax.ProcessGroup.mock()  # each rank its own file
        checkpoint.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict()}, group=alone)
        state = checkpoint.load(path, group=alone)
    assert all(isinstance(v, np.ndarray) for v in state["model"].values()), "checkpoints hold host arrays"
    fresh = make_model(np.float64, seed=7).to("cuda")
    fresh.load_state_dict(state["model"])
    fresh_opt = make_optimizer("adam", fresh.parameters())
    fresh_opt.load_state_dict(state["optimizer"])
    assert_on_device(cupy, fresh)
    for (name, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters()):
        np.testing.assert_array_equal(host(p.data), host(q.data), err_msg=name)
    for slot in (fresh_opt.state.values() if isinstance(fresh_opt.state, dict) else fresh_opt.state):
        for key, value in slot.items():
            if getattr(value, "ndim", 0) > 0:
                assert isinstance(value, cupy.ndarray), key


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
# Cases that need more ranks than some runs have: the runners skip them before any rank starts.
MIN_RANKS = {"parameter_server_sync": 2}
