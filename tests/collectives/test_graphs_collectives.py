"""Collectives inside a graphed step (``axonhpc.collectives.graphed``): DDP's all-reduce captured and replayed.

Threads play ranks over the fake NCCL and the strict stand-in, which plays
stream capture as CUDA does: while a stream captures nothing runs, NCCL
calls are recorded only on a stream that joined the capture (through an
event), an event recorded in a capture cannot be queried, and a joined
stream must be joined back before the capture ends. A graph's launch runs
the recorded NCCL calls again, and the ranks meet in them. So a graphed
step that all-reduced at the capture only, or queried a captured event,
fails here as it would on a GPU; whether NCCL and the driver capture the
same calls is for the GPU run (``scripts/gpu-check.sh``, which needs two
GPUs for NCCL across ranks).
"""
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn
from axonhpc.bucketing import GradSyncStrategy
from axonhpc.errors import CollectiveMismatchError, GraphCaptureError
from support.ddp_cases import STEPS, TOL, make_data, make_model, make_optimizer, shard, step_fn, train_reference
from support.fake_cuda import FakeNccl, install, run_device_world


@pytest.fixture
def cupy(monkeypatch):
    class Modules:
        def __setitem__(self, name, module):
            monkeypatch.setitem(sys.modules, name, module)

    fake, _ = install(Modules())
    return fake


def _train(cupy, world, graphed, dtype=np.float64, kind="adam", steps=STEPS, **ddp_args):
    """DDP on this rank's shards: parameters, losses, the step (graphed or eager) and the DDP."""
    n, r = world.world_size, world.rank
    model = make_model(dtype, seed=0 if r == 0 else 1000 + r).to("cuda")
    ddp = ax.DDP(model, **ddp_args)
    opt = make_optimizer(kind, ddp.parameters())
    step = step_fn(ddp, opt, nn.CrossEntropyLoss())
    run = ax.graph_step(step, warmup=2) if graphed else step
    losses = []
    for s in range(steps):
        x, y = make_data(s, dtype)
        loss = run(cupy.asarray(shard(x, r, n)), cupy.asarray(shard(y, r, n)))
        losses.append(float(loss))
    return [p.data.get() for p in model.parameters()], losses, run, ddp


VARIANTS = {
    "overlapped": {},
    "synchronous": {"strategy": GradSyncStrategy.SYNCHRONOUS},
    "without_bucket_views": {"gradient_as_bucket_view": False},
    "many_small_buckets": {"bucket_size_mb": 300 / 2**20},
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_graphed_ddp_is_eager_ddp_bit_for_bit_and_matches_one_process(cupy, variant, world_size):
    args = VARIANTS[variant]
    eager = run_device_world(lambda w: _train(cupy, w, False, **args), world_size, FakeNccl(), cupy)
    nccl = FakeNccl()
    graphed = run_device_world(lambda w: _train(cupy, w, True, **args), world_size, nccl, cupy)
    reference = train_reference(np.float64, "adam")
    for r in range(world_size):
        e_params, e_losses, _, _ = eager[r]
        g_params, g_losses, run, ddp = graphed[r]
        assert run.captured and run.calls == STEPS
        for a, b in zip(e_params, g_params):
            np.testing.assert_array_equal(a, b)
        assert e_losses == g_losses
        for a, q in zip(g_params, reference.parameters()):
            np.testing.assert_allclose(a, q.data, rtol=TOL[np.float64], atol=TOL[np.float64])
    if world_size > 1:  # every step all-reduced each bucket once: the replays did, not only the capture
        buckets = len(graphed[0][3].bucket_plan)
        reduced = [c for c in nccl.calls if c[0] == 0 and c[1] == "allReduce"]
        assert len(reduced) == buckets * STEPS


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_graphed_ddp_float32_with_a_timeout_set(cupy, kind, monkeypatch):
    # A timeout makes eager device calls wait on the host; in a capture they wait on the stream.
    monkeypatch.setattr(ax.settings, "timeout", 30.0)
    eager = run_device_world(lambda w: _train(cupy, w, False, np.float32, kind), 3, FakeNccl(), cupy)
    graphed = run_device_world(lambda w: _train(cupy, w, True, np.float32, kind), 3, FakeNccl(), cupy)
    for e, g in zip(eager, graphed):
        for a, b in zip(e[0], g[0]):
            np.testing.assert_array_equal(a, b)


def test_a_compression_hook_is_refused_in_a_capture(cupy):
    from axonhpc.parallel import fp16_compress_hook

    def train(world):
        n, r = world.world_size, world.rank
        ddp = ax.DDP(make_model(np.float64, seed=0).to("cuda"))
        ddp.register_comm_hook(None, fp16_compress_hook)
        opt = make_optimizer("sgd", ddp.parameters())
        run = ax.graph_step(step_fn(ddp, opt, nn.CrossEntropyLoss()), warmup=1)
        x, y = make_data(0)
        x, y = cupy.asarray(shard(x, r, n)), cupy.asarray(shard(y, r, n))
        run(x, y)
        with pytest.raises(GraphCaptureError, match="compressed_all_reduce .* 16-bit ring"):
            run(x, y)

    run_device_world(train, 2, FakeNccl(), cupy)


# -- what a graph cannot hold is refused at the capture, on every rank ----------------------------------
def _capture_refused(cupy, world, body):
    """Capture a step that runs ``body(world, x)`` after warm-up; return the GraphCaptureError's text."""
    x = cupy.ones(4)
    run = ax.graph_step(lambda a: (body(world, a), a * 2)[1], warmup=1)
    run(x)
    with pytest.raises(GraphCaptureError) as info:
        run(x)
    return str(info.value)


@pytest.mark.parametrize("what, body, words", [
    ("host array", lambda w, a: ax.all_reduce(np.ones(3)), "host memory"),
    ("barrier", lambda w, a: ax.barrier(), "barrier waits on the host"),
    ("gather", lambda w, a: ax.gather(a), "NCCL has no gather"),
    ("send", lambda w, a: ax.isend(a, (w.rank + 1) % w.world_size), "point-to-point"),
    ("ring", lambda w, a: ax.all_reduce(a, algorithm="ring"), "'ring' algorithm"),
])
def test_collectives_a_graph_cannot_hold_are_refused(cupy, what, body, words):
    texts = run_device_world(lambda w: _capture_refused(cupy, w, body), 2, FakeNccl(), cupy)
    for text in texts:
        assert words in text and "cannot be captured in a CUDA graph" in text, text


def test_deterministic_mode_is_refused_in_a_capture(cupy, monkeypatch):
    monkeypatch.setattr(ax.settings, "deterministic", True)
    texts = run_device_world(lambda w: _capture_refused(cupy, w, lambda w, a: ax.all_reduce(a)), 2,
                             FakeNccl(), cupy)
    assert all("deterministic mode" in t for t in texts)


def test_device_arrays_over_a_host_backend_are_refused(cupy):
    # Threads without NCCL: the in-process backend moves device arrays with host calls.
    texts = ax.run_local(lambda w: _capture_refused(cupy, w, lambda w, a: ax.all_reduce(a)), 2)
    assert all("moves device arrays with host calls" in t for t in texts)


def test_one_rank_captures_collectives_that_send_nothing(cupy):
    def body(world):
        x = cupy.arange(4.0)
        run = ax.graph_step(lambda a: (ax.all_reduce(a), ax.barrier(), a * 2)[2], warmup=1)
        return [run(x).get() for _ in range(3)], run.captured

    (outs, captured), = run_device_world(body, 1, FakeNccl(), cupy)
    assert captured and all(np.array_equal(o, [0, 2, 4, 6]) for o in outs)


# -- every replay is compared across the ranks ---------------------------------------------------------
def _reducing(op="sum"):
    """A graphed step that all-reduces its input and returns a copy: one collective in the graph."""
    return ax.graph_step(lambda x: (ax.all_reduce(x, op=op), x * 1)[1], warmup=1)


def test_a_replay_meeting_an_eager_collective_raises_on_every_rank(cupy):
    def body(world):
        a = cupy.arange(4.0)
        run = _reducing()
        for _ in range(3):
            run(a)
        with pytest.raises(CollectiveMismatchError) as info:
            if world.rank == 0:
                run(a)
            else:
                ax.all_reduce(cupy.arange(4.0))
        return str(info.value)

    texts = run_device_world(body, 2, FakeNccl(), cupy)
    for text in texts:
        assert "graph_replay of 1 collectives" in text and "all_reduce float64 on device (4,)" in text, text


def test_ranks_replaying_different_graphs_raise_on_every_rank(cupy):
    def body(world):
        small, large = cupy.arange(4.0), cupy.arange(6.0)
        first, second = _reducing(), _reducing("max")
        first(small), first(small), second(large), second(large)
        with pytest.raises(CollectiveMismatchError) as info:
            (first(small) if world.rank == 0 else second(large))
        return str(info.value)

    texts = run_device_world(body, 2, FakeNccl(), cupy)
    assert all("rank 0 called graph_replay" in t and "rank 1 called graph_replay" in t for t in texts), texts


def test_replays_take_a_sequence_number_and_a_flight_record(cupy):
    from axonhpc.collectives import flight

    def body(world):
        a = cupy.arange(4.0)
        run = _reducing()
        for _ in range(4):
            run(a)
        ax.all_reduce(cupy.ones(2))  # eager again after the replays: the ranks still agree
        return [r["op"] for r in flight.records(world.rank)]

    for ops in run_device_world(body, 2, FakeNccl(), cupy):
        assert ops[-4:] == ["graph_replay", "graph_replay", "graph_replay", "all_reduce"]


# -- ZeRO-1 and FSDP: their all-gathers and reduce-scatters are captured too ------------------------------
def _sharded(cupy, world, kind, graphed):
    from support.fsdp_cases import hybrid_kwargs

    n, r = world.world_size, world.rank
    model = make_model(np.float64, seed=0 if r == 0 else 1000 + r).to("cuda")
    if kind == "zero1":
        wrapper = ax.DDP(model)
        opt = ax.ZeroRedundancyOptimizer(ax.optim.Adam, wrapper.parameters(), lr=1e-2)
    else:
        wrapper = ax.FSDP(model, sharding_strategy=kind, **hybrid_kwargs(world, kind))
        opt = make_optimizer("sgd", wrapper.parameters())
    step = step_fn(wrapper, opt, nn.CrossEntropyLoss())
    run = ax.graph_step(step) if graphed else step
    for s in range(STEPS):
        x, y = make_data(s)
        run(cupy.asarray(shard(x, r, n)), cupy.asarray(shard(y, r, n)))
    assert not graphed or run.captured
    return [p.data.get() for p in wrapper.parameters()]


@pytest.mark.parametrize("kind, world_size", [("zero1", 2), ("zero1", 3), ("full_shard", 2), ("full_shard", 3),
                                              ("shard_grad_op", 3), ("no_shard", 2), ("hybrid_shard", 4)])
def test_graphed_zero1_and_fsdp_are_their_eager_steps_bit_for_bit(cupy, kind, world_size):
    eager = run_device_world(lambda w: _sharded(cupy, w, kind, False), world_size, FakeNccl(), cupy)
    graphed = run_device_world(lambda w: _sharded(cupy, w, kind, True), world_size, FakeNccl(), cupy)
    for e, g in zip(eager, graphed):
        for a, b in zip(e, g):
            np.testing.assert_array_equal(a, b)


def _float16_scaled(cupy, world, kind, graphed):
    """float32 masters, float16 compute (DDP under autocast, FSDP's MixedPrecision), the forward and backward
    graphed or not, the scaler's step and update after: parameters, steps taken and scales."""
    n, r = world.world_size, world.rank
    model = make_model(np.float32, seed=0 if r == 0 else 1000 + r).to("cuda")
    if kind == "ddp":
        wrapper, cast = ax.DDP(model), nn.autocast("float16")
    else:
        wrapper, cast = ax.FSDP(model, sharding_strategy=kind, mixed_precision=ax.MixedPrecision(np.float16)), None
    opt = make_optimizer("adam", wrapper.parameters())
    loss_fn, scaler = nn.CrossEntropyLoss(), ax.GradScaler(init_scale=2.0 ** 22, growth_interval=2)

    def forward_backward(x, y):
        opt.zero_grad()
        with cast or nn.autocast(enabled=False):
            loss = loss_fn(wrapper(x), y)
        wrapper.backward(scaler.scale(loss_fn.backward()))  # the scaled array (FSDP's usage)
        return loss

    run = ax.graph_step(forward_backward) if graphed else forward_backward
    taken, scales = [], []
    for s in range(8):
        x, y = make_data(s, np.float32)
        run(cupy.asarray(shard(x, r, n)), cupy.asarray(shard(y, r, n)))
        taken.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.scale_value)
    assert not graphed or run.captured
    return [p.data.get() for p in wrapper.parameters()], taken, scales


@pytest.mark.parametrize("kind, world_size", [("ddp", 2), ("ddp", 3), ("full_shard", 2), ("shard_grad_op", 3)])
def test_float16_forward_and_backward_graphed_with_the_loss_scaler_after(cupy, kind, world_size):
    """The replays scale by the scale of the moment, on every rank: skips, scales and parameters are the
    eager run's bit for bit."""
    eager = run_device_world(lambda w: _float16_scaled(cupy, w, kind, False), world_size, FakeNccl(), cupy)
    graphed = run_device_world(lambda w: _float16_scaled(cupy, w, kind, True), world_size, FakeNccl(), cupy)
    taken, scales = eager[0][1], eager[0][2]
    assert not all(taken) and any(taken), taken
    for e, g in zip(eager, graphed):
        assert g[1] == taken and g[2] == scales
        for a, b in zip(e[0], g[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_graphed_tensor_parallel_layers_are_their_eager_steps_bit_for_bit(cupy, world_size):
    from support.tp_cases import FFN, HIDDEN, batch, make_optimizer as tp_optimizer

    def train(world, graphed):
        tp = ax.TensorParallelMLP(HIDDEN, FFN, dtype=np.float64, seed=21).to("cuda")
        opt = tp_optimizer("adam", tp.parameters())
        step = step_fn(tp, opt, nn.MSELoss())
        run = ax.graph_step(step) if graphed else step
        for s in range(5):
            x, target, _ = batch(s)
            run(cupy.asarray(x), cupy.asarray(target))
        return [p.data.get() for p in tp.parameters()]

    eager = run_device_world(lambda w: train(w, False), world_size, FakeNccl(), cupy)
    graphed = run_device_world(lambda w: train(w, True), world_size, FakeNccl(), cupy)
    for e, g in zip(eager, graphed):
        for a, b in zip(e, g):
            np.testing.assert_array_equal(a, b)


def test_a_pipeline_step_is_refused(cupy):
    from support.pipeline_cases import make_data as pp_data, make_stages

    def body(world):
        p, r = world.world_size, world.rank
        stages = make_stages(p)
        stages[r].to("cuda")
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=2, loss_fn=nn.CrossEntropyLoss())
        opt = make_optimizer("sgd", pipe.parameters())

        def step(x, y):
            opt.zero_grad()
            loss = pipe.train_step(x if r == 0 else None, y if r == p - 1 else None)
            opt.step()
            return loss

        x, y = pp_data(0)
        run = ax.graph_step(step, warmup=1)
        run(cupy.asarray(x), cupy.asarray(y))
        with pytest.raises(GraphCaptureError, match="cannot be captured") as info:
            run(cupy.asarray(x), cupy.asarray(y))
        return str(info.value)

    # The stages first exchange a header of host integers (shapes), point to point.
    sent, received = run_device_world(body, 2, FakeNccl(), cupy)
    assert sent.startswith("isend") and received.startswith("recv") and "host memory" in received
