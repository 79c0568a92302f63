"""CUDA graphs of a whole step (``axonhpc.cuda.graphs``), on the strict stand-in's stream capture.

The stand-in plays a capture as CUDA does (``strict_cupy``): nothing runs while
a stream captures, a graph's launch runs the recorded operations on the
memory as it then is, with the scalars they were given, and reads of device
values are refused. So a graphed step that froze a host value (Adam's step
count, a learning rate) or did its work during the capture differs from the
eager step here, as it would on a GPU. Whether cupy, NVRTC and the driver
capture the same kernels is for the GPU run (``scripts/gpu-check.sh``).
"""
import contextlib
import importlib
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.cuda import kernels as cuda_kernels
from axonhpc.backends.devices import device_facts
from axonhpc.errors import ArgumentTypeError, ConfigurationError, GraphCaptureError, ShapeError
from axonhpc.cuda.graphs import graph_step
from support.fake_cuda import FakeCupy

STEPS = 6
WIDTHS = (6, 16, 5)
BATCH = 8


@pytest.fixture
def cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    return fake


def _batches(dtype, steps=STEPS, classes=WIDTHS[-1], seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, WIDTHS[0])).astype(dtype), rng.integers(0, classes, BATCH))
            for _ in range(steps)]


def _model(dtype, activation=nn.ReLU, hidden=0):
    """Linear, activation, ``hidden`` more (Linear, activation) pairs, Linear."""
    layers = [nn.Linear(WIDTHS[0], WIDTHS[1], dtype=dtype, seed=1), activation()]
    for k in range(hidden):
        layers += [nn.Linear(WIDTHS[1], WIDTHS[1], dtype=dtype, seed=10 + k), activation()]
    model = nn.Sequential(*layers, nn.Linear(WIDTHS[1], WIDTHS[2], dtype=dtype, seed=2))
    return model.to("cuda")


OPTIMIZERS = {
    "sgd_momentum": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd_plain": lambda ps: optim.SGD(ps, lr=0.05),
    "adam": lambda ps: optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
}


def _step_fn(model, opt, loss_fn, clip=None):
    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward(), input_grad=False)
        if clip is not None:
            optim.clip_grad_norm(model.parameters(), *clip)
        opt.step()
        return loss

    return step


def _train(cupy, optimizer, dtype, graphed, clip=None, schedule=None, activation=nn.ReLU, hidden=0):
    """Parameters, losses and optimizer state after STEPS steps, eager or graphed (warmup 2)."""
    model = _model(dtype, activation, hidden)
    opt = OPTIMIZERS[optimizer](model.parameters())
    step = _step_fn(model, opt, nn.CrossEntropyLoss(), clip)
    run = graph_step(step, warmup=2) if graphed else step
    losses = []
    for i, (x, y) in enumerate(_batches(dtype)):
        if schedule is not None:
            opt.lr = schedule(i)
        loss = run(cupy.asarray(x), cupy.asarray(y))
        losses.append(float(loss))
    params = [p.data.get() for p in model.parameters()]
    state = opt.state_dict()
    return params, losses, state, run


def _same_state(a, b):
    assert a["hyperparameters"] == b["hyperparameters"]
    for sa, sb in zip(a["state"], b["state"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            va, vb = sa[k], sb[k]
            if hasattr(va, "shape"):
                np.testing.assert_array_equal(va.get(), vb.get())
            else:
                assert va == vb, k


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_graphed_training_is_the_eager_training_bit_for_bit(cupy, optimizer, dtype):
    eager, eager_losses, eager_state, _ = _train(cupy, optimizer, dtype, graphed=False)
    graphed, graphed_losses, graphed_state, step = _train(cupy, optimizer, dtype, graphed=True)
    assert step.captured and step.calls == STEPS
    for a, b in zip(eager, graphed):
        np.testing.assert_array_equal(a, b)
    assert eager_losses == graphed_losses
    _same_state(eager_state, graphed_state)  # Adam's step counts advanced by the replays


def test_a_learning_rate_schedule_reaches_the_replays(cupy):
    schedule = lambda i: 0.05 / (1 + i)  # noqa: E731
    for optimizer in ("sgd_momentum", "adam"):
        eager, _, _, _ = _train(cupy, optimizer, np.float64, graphed=False, schedule=schedule)
        graphed, _, _, _ = _train(cupy, optimizer, np.float64, graphed=True, schedule=schedule)
        for a, b in zip(eager, graphed):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("clip", [(0.5, 2.0), (0.5, float("inf")), (1e6, 2.0)])
@pytest.mark.parametrize("hidden", [0, 4])
def test_clipping_inside_a_graphed_step(cupy, clip, hidden):
    # hidden=4: 12 gradients. Their parts were joined by cupy.stack, which joins more than 8 arrays through an
    # address table copied from the host: the capture failed on a GPU (the stand-in now refuses it too).
    kwargs = dict(clip=clip, activation=nn.GELU, hidden=hidden)
    eager, eager_losses, _, _ = _train(cupy, "adam", np.float32, graphed=False, **kwargs)
    graphed, graphed_losses, _, _ = _train(cupy, "adam", np.float32, graphed=True, **kwargs)
    for a, b in zip(eager, graphed):
        np.testing.assert_array_equal(a, b)
    assert eager_losses == graphed_losses


def test_each_call_after_the_capture_is_one_graph_launch(cupy):
    model = _model(np.float32)
    opt = optim.Adam(model.parameters(), lr=1e-3)
    step = graph_step(_step_fn(model, opt, nn.CrossEntropyLoss()), warmup=1)
    (x, y), = _batches(np.float32, steps=1)
    x, y = cupy.asarray(x), cupy.asarray(y)
    step(x, y)  # the warm-up call
    first = step(x, y)  # the capture, and the first launch
    assert step.captured
    fills = cuda_kernels.launches(cupy, ("fill",))
    updates = cuda_kernels.launches(cupy, ("adam_multi_dev",))
    seen = [p.data.get() for p in model.parameters()]
    for _ in range(3):
        out = step(x, y)
        assert out is first  # the capture's output array, overwritten by each replay
        now = [p.data.get() for p in model.parameters()]
        assert all(not np.array_equal(a, b) for a, b in zip(seen, now))
        seen = now
    assert step._graph.launches == 4
    assert cuda_kernels.launches(cupy, ("fill",)) - fills == 3  # Adam's scalars, one launch per replay
    assert cuda_kernels.launches(cupy, ("adam_multi_dev",)) - updates == 3  # one update kernel per replay


def test_the_capture_runs_nothing_and_the_replay_runs_it_once(cupy):
    """The step's work runs once per call: not during the capture, once in the launch that follows."""
    model = _model(np.float64)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []
    inner = _step_fn(model, opt, nn.CrossEntropyLoss())

    def step(x, y):
        calls.append(1)
        return inner(x, y)

    run = graph_step(step, warmup=1)
    batches = _batches(np.float64, steps=3)
    run(*(cupy.asarray(a) for a in batches[0]))
    before = [p.data.get() for p in model.parameters()]
    run(*(cupy.asarray(a) for a in batches[1]))  # capture + one launch
    after_one = [p.data.get() for p in model.parameters()]
    assert len(calls) == 2  # the capture called the Python step once; replays never do
    run(*(cupy.asarray(a) for a in batches[2]))
    assert len(calls) == 2
    # one step between `before` and `after_one`: the same as one eager step from `before`
    ref = _model(np.float64)
    ref_opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_step = _step_fn(ref, ref_opt, nn.CrossEntropyLoss())
    for x, y in batches[:2]:
        ref_step(cupy.asarray(x), cupy.asarray(y))
    for a, b, c in zip(after_one, [p.data.get() for p in ref.parameters()], before):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


# -- refusals -------------------------------------------------------------------------------------


def _graphed(cupy, body, warmup=1, dtype=np.float32, calls=0):
    """A graphed step of ``body(model, opt, loss_fn, x, y)``, called ``calls`` times, and its batch."""
    model = _model(dtype)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step = graph_step(lambda x, y: body(model, opt, loss_fn, x, y), warmup=warmup)
    (x, y), = _batches(dtype, steps=1)
    x, y = cupy.asarray(x), cupy.asarray(y)
    for _ in range(calls):
        step(x, y)
    return step, x, y, model, opt


def _plain_body(model, opt, loss_fn, x, y):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    return loss


def test_reading_a_device_value_in_the_step_is_refused_at_the_capture(cupy):
    def body(model, opt, loss_fn, x, y):
        loss = _plain_body(model, opt, loss_fn, x, y)
        return float(loss)  # a read: fine eagerly, impossible in a graph

    step, x, y, model, _ = _graphed(cupy, body)
    step(x, y)
    before = [p.data.get() for p in model.parameters()]
    with pytest.raises(GraphCaptureError, match="cannot hold.*read of a device value"):
        step(x, y)
    assert not step.captured
    for a, p in zip(before, model.parameters()):  # the failed capture changed nothing
        np.testing.assert_array_equal(a, p.data.get())


def test_a_product_through_cupy_itself_is_refused_with_the_way_out(cupy):
    """cupy refuses cuBLAS in a capture (the first GPU run met it); the layers' products go around it, '@' cannot."""
    def body(model, opt, loss_fn, x, y):
        loss = _plain_body(model, opt, loss_fn, x, y)
        return loss, x @ model.parameters()[0].data.T

    step, x, y, _, _ = _graphed(cupy, body)
    step(x, y)
    with pytest.raises(GraphCaptureError, match="multiplied through cupy.*cuBLAS.*product_2d"):
        step(x, y)
    assert not step.captured


def test_what_the_host_writes_between_launches_lives_outside_the_graphs_pool(cupy):
    """The first captured optimizer step on an H100 read its learning rate from a block of the graph's pool that
    the backward's temporaries had written (within one launch a graph reuses freed blocks). The stand-in refuses a
    write between launches into memory allocated from the pool during the capture; ``host_written`` goes around it."""
    from axonhpc.cuda import capture

    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    record = capture.Recording(capturing=True, xp=cupy, host_allocator=cupy.cuda.get_allocator())
    with cupy.cuda.using_allocator(pool.malloc), stream, capture.recording(record):
        stream.begin_capture()
        inside = cupy.empty(4, np.float64)
        outside = capture.host_written(cupy, 4, np.float64)
        stream.end_capture()
    cuda_kernels.fill(cupy, outside, [1.0, 2.0, 3.0, 4.0])
    assert outside.get().tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(RuntimeError, match="into memory allocated from the graph's own pool"):
        cuda_kernels.fill(cupy, inside, [1.0, 2.0, 3.0, 4.0])
    assert capture.host_written(cupy, 2, np.float32).shape == (2,)  # outside a capture: a plain empty


def test_dropout_in_training_is_refused(cupy):
    model = nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[-1], seed=1), nn.Dropout(0.2, seed=0)).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    step = graph_step(_step_fn(model, opt, loss_fn), warmup=1)
    (x, y), = _batches(np.float32, steps=1)
    step(cupy.asarray(x), cupy.asarray(y))
    with pytest.raises(GraphCaptureError, match=r"Dropout in training mode cannot be captured.*p=0.2"):
        step(cupy.asarray(x), cupy.asarray(y))
    model.eval()
    step(cupy.asarray(x), cupy.asarray(y))  # eval-mode dropout is the identity: captured
    assert step.captured


def test_gradients_dropped_by_zero_grad_are_refused(cupy):
    def body(model, opt, loss_fn, x, y):
        opt.zero_grad(set_to_none=True)  # new gradient arrays: their address table would be uploaded
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        return loss

    step, x, y, _, _ = _graphed(cupy, body)
    step(x, y)
    with pytest.raises(GraphCaptureError, match="set_to_none=False"):
        step(x, y)


def test_unfused_parameters_and_missing_state_are_refused(cupy):
    model = _model(np.float32)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=False)
    step = graph_step(_step_fn(model, opt, nn.CrossEntropyLoss()), warmup=1)
    (x, y), = _batches(np.float32, steps=1)
    x, y = cupy.asarray(x), cupy.asarray(y)
    step(x, y)
    with pytest.raises(GraphCaptureError, match=r"parameter 0 of shape \(16, 6\) is updated by the array code"):
        step(x, y)

    model = _model(np.float32)
    opt = optim.Adam(model.parameters(), lr=0.1)
    state_less = graph_step(_step_fn(model, opt, nn.CrossEntropyLoss()), warmup=1)
    state_less.calls = 1  # as if warmed up, but the optimizer never stepped
    with pytest.raises(GraphCaptureError, match="no optimizer state yet"):
        state_less(x, y)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_a_model_of_one_parameter_is_captured(cupy, optimizer):
    # Eagerly one array takes the one-array kernel; the capture takes the multi-tensor one, whose
    # address table the warm-up must have made (a capture cannot copy it to the device).
    def train(graphed):
        model = nn.Linear(WIDTHS[0], WIDTHS[2], bias=False, dtype=np.float64, seed=1).to("cuda")
        opt = OPTIMIZERS[optimizer](model.parameters())
        step = _step_fn(model, opt, nn.CrossEntropyLoss())
        run = graph_step(step) if graphed else step
        for x, y in _batches(np.float64):
            run(cupy.asarray(x), cupy.asarray(y))
        return model.weight.data.get()

    np.testing.assert_array_equal(train(False), train(True))


# -- float16 with the loss scaler: the forward and backward graphed, the scaler's step after ---------


def _scaled_training(cupy, optimizer, cast, graphed, steps=10):
    """float32 masters, the forward in ``cast`` (or float32), a scaler whose scale overflows at first and then
    grows: parameters, losses, the steps taken and the scales after each update."""
    model = _model(np.float32)
    opt = OPTIMIZERS[optimizer](model.parameters())
    init = 2.0 ** (20 if cast else 132)  # overflows float16 (float32) gradients for the first steps
    loss_fn, scaler = nn.CrossEntropyLoss(), ax.GradScaler(init_scale=init, growth_interval=2)

    def forward_backward(x, y):
        opt.zero_grad()
        with nn.autocast(cast) if cast else contextlib.nullcontext():
            logits = model(x)
        loss = loss_fn(logits, y)
        model.backward(loss_fn.backward(scaler.scale(1.0)), input_grad=False)
        return loss

    run = graph_step(forward_backward, warmup=2) if graphed else forward_backward
    losses, taken, scales = [], [], []
    for x, y in _batches(np.float32, steps=steps):
        losses.append(float(run(cupy.asarray(x), cupy.asarray(y))))
        taken.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.scale_value)
    return [p.data.get() for p in model.parameters()], losses, taken, scales, run


@pytest.mark.parametrize("cast", ["float16", None])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_a_graphed_forward_and_backward_with_the_loss_scaler_is_the_eager_step(cupy, optimizer, cast):
    """The replays multiply by the scale of the moment (it halves after overflows, then doubles), so skips,
    scales and parameters are the eager run's bit for bit. None: float32 logits (the fused loss-gradient
    kernel, reading the scale from device memory); float16: the loss's array code."""
    eager = _scaled_training(cupy, optimizer, cast, graphed=False)
    graphed = _scaled_training(cupy, optimizer, cast, graphed=True)
    assert graphed[-1].captured
    taken, scales = eager[2], eager[3]
    assert not all(taken) and any(taken[3:]), taken  # overflows skipped, then steps taken
    assert max(scales[-4:]) > min(scales), scales  # the scale fell, then grew again
    assert graphed[2] == taken and graphed[3] == scales
    assert graphed[1] == eager[1]
    for a, b in zip(eager[0], graphed[0]):
        np.testing.assert_array_equal(a, b)


def test_a_loss_gradient_scaled_by_a_device_value_is_the_host_one(cupy):
    rng = np.random.default_rng(8)
    y = cupy.asarray(rng.integers(0, 5, 8))
    for dtype in (np.float32, np.float64, np.float16):  # the fused kernel, and the array code
        logits = cupy.asarray(rng.standard_normal((8, 5)).astype(dtype))
        loss_fn = nn.CrossEntropyLoss()
        loss_fn(logits, y)
        host = loss_fn.backward(1536.75)
        loss_fn(logits, y)
        device = loss_fn.backward(cupy.asarray(np.array([1536.75])))
        assert device.dtype == host.dtype == dtype
        np.testing.assert_array_equal(device.get(), host.get())
    mse, prediction = nn.MSELoss(), cupy.asarray(rng.standard_normal((4, 3)).astype(np.float32))
    mse(prediction, prediction * 0.5)
    host = mse.backward(3.1)
    mse(prediction, prediction * 0.5)
    np.testing.assert_array_equal(mse.backward(cupy.asarray(np.array(3.1))).get(), host.get())
    mse(prediction, prediction)
    with pytest.raises(ShapeError, match=r"one-element device array, got shape \(2,\)"):
        mse.backward(cupy.asarray(np.ones(2)))


def test_the_scalers_step_inside_a_graph_is_refused_with_the_way_out(cupy):
    model = _model(np.float32)
    opt = optim.SGD(model.parameters(), lr=0.05)
    loss_fn, scaler = nn.CrossEntropyLoss(), ax.GradScaler(init_scale=8.0)

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward(scaler.scale(1.0)))
        scaler.step(opt)
        scaler.update()
        return loss

    run = graph_step(step, warmup=1)
    (x, y), = _batches(np.float32, steps=1)
    run(cupy.asarray(x), cupy.asarray(y))
    with pytest.raises(GraphCaptureError, match=r"GradScaler.unscale cannot be captured.*call "
                                                r"scaler.step\(opt\) and scaler.update\(\) after"):
        run(cupy.asarray(x), cupy.asarray(y))


def test_a_scaler_first_used_in_the_capture_is_refused(cupy):
    model = _model(np.float32)
    loss_fn, scalers = nn.CrossEntropyLoss(), [ax.GradScaler(), ax.GradScaler()]

    def step(x, y):
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward(scalers[min(run.calls, 1)].scale(1.0)))  # another scaler once captured
        return loss

    run = graph_step(step, warmup=1)
    (x, y), = _batches(np.float32, steps=1)
    run(cupy.asarray(x), cupy.asarray(y))
    with pytest.raises(GraphCaptureError, match="GradScaler.scale cannot be captured.*warm-up"):
        run(cupy.asarray(x), cupy.asarray(y))


def test_a_hyperparameter_that_changes_the_kernel_is_refused_at_the_replay(cupy):
    step, x, y, _, opt = _graphed(cupy, _plain_body, calls=2)
    opt.lr = 0.01  # a scalar: fine
    step(x, y)
    opt.weight_decay = 0.1  # selects the L2 kernel, which the graph does not hold
    with pytest.raises(GraphCaptureError, match="'weight_decay': 0.1.*another update kernel"):
        step(x, y)


def test_inputs_must_keep_the_captured_shapes_and_be_device_arrays(cupy):
    step, x, y, _, _ = _graphed(cupy, _plain_body, calls=2)
    with pytest.raises(GraphCaptureError, match=r"captured for inputs \(\(8, 6\) float32, \(8,\) int64\)"):
        step(x[:4], y[:4])
    with pytest.raises(ArgumentTypeError, match="input 0 is a ndarray"):
        step(x.get(), y)


def test_outputs_must_be_device_arrays(cupy):
    def body(model, opt, loss_fn, x, y):
        _plain_body(model, opt, loss_fn, x, y)
        return 1.0

    step, x, y, _, _ = _graphed(cupy, body)
    step(x, y)
    with pytest.raises(GraphCaptureError, match="returned float"):
        step(x, y)


def test_arguments_are_checked(cupy):
    with pytest.raises(ConfigurationError, match="warmup must be an int >= 1"):
        graph_step(lambda x: x, warmup=0)
    with pytest.raises(ArgumentTypeError, match="callable"):
        graph_step(3)
    assert ax.graph_step is graph_step


# -- deferred checks ------------------------------------------------------------------------------


def test_out_of_range_targets_are_reported(cupy):
    step, x, y, _, _ = _graphed(cupy, _plain_body, warmup=1)
    bad = y.copy()
    bad[0] = WIDTHS[-1]
    with pytest.raises(ShapeError, match=r"targets must be in \[0, 5\), got values in \[\d, 5\]"):
        step(x, bad)  # an eager call: checked at its end
    step(x, y)  # the capture
    step(x, bad)  # a replay: its check is read by the next call
    with pytest.raises(ShapeError, match=r"got values in \[\d, 5\]"):
        step(x, y)
    step(x, y)
    step.check()  # good targets: nothing to report


def test_losses_are_device_arrays_in_every_call(cupy):
    step, x, y, _, _ = _graphed(cupy, _plain_body, warmup=1)
    eager = step(x, y)
    captured = step(x, y)
    assert type(eager) is cupy.ndarray and eager.shape == () and eager.dtype == np.float64
    assert type(captured) is cupy.ndarray and captured.shape == ()


# -- the stand-in's capture -----------------------------------------------------------------------


def test_standin_capture_records_and_replays(cupy):
    a = cupy.asarray(np.arange(4.0))
    b = cupy.asarray(np.ones(4))
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.begin_capture()
    c = a * 2.0 + b  # fresh: no values during the capture
    a += 1.0  # in place: not run during the capture
    d = c[1:3]  # a view of c
    with pytest.raises(RuntimeError, match="capturing"):
        float(c[0])
    with pytest.raises(RuntimeError, match="H2D"):
        cupy.asarray(np.zeros(2))
    graph = stream.end_capture()
    assert np.isnan(c.get()).all()
    np.testing.assert_array_equal(a.get(), np.arange(4.0))
    graph.launch()
    np.testing.assert_array_equal(c.get(), np.arange(4.0) * 2 + 1)
    np.testing.assert_array_equal(a.get(), np.arange(4.0) + 1)
    np.testing.assert_array_equal(d.get(), (np.arange(4.0) * 2 + 1)[1:3])
    graph.launch()  # on the memory as it is now: a was incremented by the first launch
    np.testing.assert_array_equal(c.get(), (np.arange(4.0) + 1) * 2 + 1)
    np.testing.assert_array_equal(a.get(), np.arange(4.0) + 2)


def test_standin_refuses_what_a_capture_refuses(cupy):
    x = cupy.asarray(np.arange(6.0))
    stream = cupy.cuda.Stream(non_blocking=True)
    with pytest.raises(RuntimeError, match="legacy"):
        cupy.cuda.Stream(null=True).begin_capture()
    stream.begin_capture()
    for read in (lambda: x.get(), lambda: x.sum().item(), lambda: bool(x[0] > 1), lambda: x[x > 2],
                 lambda: cupy.nonzero(x), lambda: stream.synchronize(), lambda: x.set(np.zeros(6))):
        with pytest.raises(RuntimeError, match="capturing"):
            read()
    stream.end_capture()


# -- on a GPU (bash scripts/gpu-check.sh) -------------------------------------------------------------

_cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_graphed_training_on_a_gpu(optimizer, dtype):
    """cupy's stream capture, NVRTC's device-scalar kernels and a replayed step: the eager steps bit for bit."""
    eager, eager_losses, eager_state, _ = _train(_cupy, optimizer, dtype, graphed=False, clip=(0.5, 2.0))
    graphed, graphed_losses, graphed_state, step = _train(_cupy, optimizer, dtype, graphed=True, clip=(0.5, 2.0))
    assert step.captured
    for a, b in zip(eager, graphed):
        np.testing.assert_array_equal(a, b)
    assert eager_losses == graphed_losses
    _same_state(eager_state, graphed_state)


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("cast", ["float16", None])
def test_graphed_forward_and_backward_with_the_loss_scaler_on_a_gpu(cast):
    """The device copy of the scale read by the replays: skips, scales and parameters of the eager run."""
    eager = _scaled_training(_cupy, "adam", cast, graphed=False)
    graphed = _scaled_training(_cupy, "adam", cast, graphed=True)
    assert graphed[-1].captured and not all(eager[2])
    assert graphed[2] == eager[2] and graphed[3] == eager[3]
    for a, b in zip(eager[0], graphed[0]):
        np.testing.assert_array_equal(a, b)
