"""How often a training step on device arrays stops the host to read a device value.

On a GPU every read of a device value by the host (``.get()``, ``float()``,
``bool()``, ``.item()``, a stream or event ``synchronize``) waits for all the
kernels queued before it: the host stops running ahead of the device, and a
step of small kernels becomes a step of launch latencies. The strict stand-in
notes each such read with the line that made it (``strict_cupy.count_syncs``),
so these tests pin the number a step makes. Only the last test runs on a GPU
(``scripts/gpu-check.sh``): the scaler's unscale kernel against the array code.
"""
import contextlib
import importlib
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.backends.devices import device_facts
from axonhpc.errors import ShapeError
from axonhpc.parallel.grad_scaler import GradScaler
from support.ddp_cases import make_data, make_model, make_optimizer, shard
from support.fake_cuda import FakeNccl, install, run_device_world
from support.settings_override import override
from support.strict_cupy import count_syncs

STEPS = 3


@pytest.fixture
def cupy(monkeypatch):
    class Modules:
        def __setitem__(self, name, module):
            monkeypatch.setitem(sys.modules, name, module)

    return install(Modules())[0]


def _model(cupy):
    model = nn.Sequential(nn.Linear(8, 16, seed=1), nn.GELU(), nn.LayerNorm(16), nn.Dropout(0.1, seed=2),
                          nn.Linear(16, 16, seed=3), nn.ReLU(), nn.Tanh(), nn.Linear(16, 4, seed=4))
    return model.to("cuda")


def _batch(cupy, step):
    rng = np.random.default_rng(step)
    return (cupy.asarray(rng.standard_normal((6, 8)).astype(np.float32)), cupy.asarray(rng.integers(0, 4, 6)))


@pytest.mark.parametrize("make_opt", [lambda ps: optim.AdamW(ps, lr=1e-3),
                                      lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, fused=False)],
                         ids=["adamw_fused", "sgd_unfused"])
def test_a_plain_step_reads_one_value_the_loss(cupy, make_opt):
    model = _model(cupy)
    opt, loss_fn = make_opt(model.parameters()), nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = _batch(cupy, step)
        with count_syncs() as log:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            model.backward(loss_fn.backward(), input_grad=False)
            opt.step()
        assert isinstance(loss, float)
        assert len(log) == 1, log  # the loss (with the targets' range, in the same read)


def _deferred_steps(cupy, deferred):
    """Three AdamW steps with clipping, plain or under ``ax.defer_reads()``: losses, read logs, parameters."""
    model = _model(cupy).train()
    model[3].p = 0.0  # Dropout draws on the host; the steps compare arithmetic only
    opt, loss_fn = optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss()
    losses, logs = [], []
    for step in range(STEPS):
        x, y = _batch(cupy, step)
        with count_syncs() as log:
            with (ax.defer_reads() if deferred else contextlib.nullcontext()):
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                model.backward(loss_fn.backward(), input_grad=False)
                norm = optim.clip_grad_norm(model.parameters(), 0.5)
                opt.step()
                inside = len(log)
        logs.append((inside, len(log)))
        losses.append((loss, norm))
    return losses, logs, [p.data.get() for p in model.parameters()]


def test_defer_reads_keeps_the_step_on_the_device_until_the_block_ends(cupy):
    plain, plain_logs, plain_params = _deferred_steps(cupy, deferred=False)
    deferred, logs, params = _deferred_steps(cupy, deferred=True)
    assert plain_logs == [(2, 2)] * STEPS  # the loss, then the norm, each mid-step
    assert logs == [(0, 1)] * STEPS  # nothing inside; the targets' range as the block ends
    for (loss, norm), (device_loss, device_norm) in zip(plain, deferred):
        assert isinstance(loss, float) and not isinstance(device_loss, (float, np.ndarray))
        assert float(device_loss) == loss and float(device_norm) == float(norm)
    for a, b in zip(plain_params, params):
        np.testing.assert_array_equal(a, b)


def test_defer_reads_raises_a_bad_target_as_the_block_ends_after_the_step_ran(cupy):
    model = _model(cupy)
    loss_fn = nn.CrossEntropyLoss()
    x, _ = _batch(cupy, 0)
    y = cupy.asarray(np.array([0, 1, 2, 3, 4, 1]))
    ran = []
    with pytest.raises(ShapeError, match=r"targets must be in \[0, 4\), got values in \[0, 4\]"):
        with ax.defer_reads():
            loss_fn(model(x), y)
            ran.append(True)
    assert ran == [True]
    with count_syncs() as log, ax.defer_reads():  # host arrays are unaffected: a float, read at once
        host_loss = nn.CrossEntropyLoss()(np.zeros((2, 3), np.float32), np.array([0, 2]))
    assert isinstance(host_loss, float) and log == []


def test_loss_scaling_and_clipping_read_one_value_each_whatever_the_number_of_parameters(cupy):
    model = _model(cupy)
    assert len(model.parameters()) == 8
    opt, loss_fn, scaler = optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss(), GradScaler()
    for step in range(STEPS):
        x, y = _batch(cupy, step)
        with count_syncs() as log:
            opt.zero_grad()
            loss_fn(model(x), y)
            model.backward(loss_fn.backward(scaler.scale(1.0)), input_grad=False)
            scaler.unscale(opt)
            optim.clip_grad_norm(model.parameters(), 1.0)
            assert scaler.step(opt)
            scaler.update()
        assert len(log) == 3, log  # the loss, the scaler's overflow verdict, the norm


def test_an_overflow_is_still_seen_through_the_one_read(cupy):
    model = _model(cupy)
    opt, scaler = optim.SGD(model.parameters(), lr=0.1), GradScaler(init_scale=4.0)
    for p in model.parameters():
        p.grad = cupy.ones(p.data.shape, dtype=p.data.dtype)
    model.parameters()[5].grad[0] = np.inf
    before = [p.data.get() for p in model.parameters()]
    with count_syncs() as log:
        assert not scaler.step(opt)
    assert len(log) == 1 and scaler.found_inf
    assert all(np.array_equal(b, p.data.get()) for b, p in zip(before, model.parameters()))


def _unscaled(cupy, bad, fused):
    """Gradients of three dtypes, one non-contiguous, ``bad`` (or nothing) in one: unscaled by a scaler of 8."""
    from types import SimpleNamespace

    from axonhpc.cuda import kernels as cuda_kernels

    rng = np.random.default_rng(4)
    grads = [cupy.asarray(rng.standard_normal(shape).astype(dtype) * 1e3) for shape, dtype in [
        ((5, 3), np.float32), ((7,), np.float64), ((4, 4), np.float32), ((3,), np.float16), ((2, 6), np.float64)]]
    grads.append(cupy.asarray(rng.standard_normal((6, 4)).astype(np.float32)).T)  # not C-contiguous
    if bad is not None:
        grads[2][1, 3] = bad
    opt = SimpleNamespace(params=[SimpleNamespace(grad=g) for g in grads])
    before = cuda_kernels.launches(cupy, ["unscale_multi"])
    with override(fused_kernels=fused), count_syncs() as log:
        found = GradScaler(init_scale=8.0).unscale(opt)
    return [g.get() for g in grads], found, len(log), cuda_kernels.launches(cupy, ["unscale_multi"]) - before


@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_unscaling_is_one_launch_per_dtype_and_the_array_codes_result(cupy, bad):
    grads, found, reads, launches = _unscaled(cupy, bad, fused=True)
    array_grads, array_found, array_reads, array_launches = _unscaled(cupy, bad, fused=False)
    assert (launches, array_launches) == (2, 0)  # float32 and float64 together; float16 and the view alone
    assert reads == array_reads == 1
    assert found == array_found == (bad is not None)
    for a, b in zip(grads, array_grads):
        np.testing.assert_array_equal(a, b)


def _wrapped_step_sites(cupy, n, wrap):
    """The read sites of rank 0's last step of a wrapped model on n thread ranks."""
    sites = {}

    def run(world):
        model = make_model(np.float32, seed=0).to("cuda")
        wrapper = wrap(model)
        opt, loss_fn = make_optimizer("adam", wrapper.parameters()), nn.CrossEntropyLoss()
        for step in range(STEPS):
            x, y = make_data(step, np.float32)
            x, y = cupy.asarray(shard(x, world.rank, n)), cupy.asarray(shard(y, world.rank, n))
            with count_syncs() as log:
                opt.zero_grad()
                loss_fn(wrapper(x), y)
                wrapper.backward(loss_fn.backward(), input_grad=False)
                opt.step()
            if world.rank == 0:
                sites[step] = log

    run_device_world(run, n, FakeNccl(), cupy)
    return sites[STEPS - 1]


@pytest.mark.parametrize("n", [1, 2])
def test_a_ddp_step_reads_one_value_the_loss(cupy, n):
    log = _wrapped_step_sites(cupy, n, ax.DDP)
    assert len(log) == 1, log


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_an_fsdp_step_reads_no_device_value_but_the_loss(cupy, strategy):
    log = _wrapped_step_sites(cupy, 2, lambda m: ax.FSDP(m, sharding_strategy=strategy))
    assert len(log) == 1, log  # the loss: waits on NCCL order the stream, not the host (see docs/gpu.md)


def test_the_trainers_nonfinite_check_reads_once_a_step(cupy):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    logs = {}

    def run(world):
        model = nn.Sequential(nn.Linear(8, 16, seed=0), nn.ReLU(), nn.Linear(16, 2, seed=1)).to("cuda")
        trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                                        verbose=False, progress=False, skip_nonfinite_steps=True)
        with count_syncs() as log:
            trainer.fit((cupy.asarray(x), cupy.asarray(y)), 1, batch_size=8)
        logs[world.rank] = log

    run_device_world(run, 2, FakeNccl(), cupy)
    steps = 96 // (8 * 2)
    values = [e for e in logs[0] if not e.startswith(("event.synchronize", "stream.synchronize"))]
    assert len(values) == 2 * steps, logs[0]  # each step's loss and its gradients' finiteness, 4 gradients


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clipping_reads_the_norm_once_whatever_the_number_of_gradients(cupy, norm_type):
    model = _model(cupy)
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(p.data.shape).astype(np.float32) for p in model.parameters()]
    for p, g in zip(model.parameters(), host):
        p.grad = cupy.asarray(g)
    with count_syncs() as log:
        total = optim.clip_grad_norm(model.parameters(), 0.5, norm_type)
    assert len(log) == 1, log
    flat = np.concatenate([g.ravel() for g in host]).astype(np.float64)
    expected = np.abs(flat).max() if norm_type == float("inf") else np.linalg.norm(flat)
    assert total == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_fsdp_clipping_reads_its_shards_part_once(cupy, norm_type):
    logs, totals = {}, {}

    def run(world):
        model = make_model(np.float32, seed=0).to("cuda")
        fsdp = ax.FSDP(model)
        loss_fn = nn.CrossEntropyLoss()
        x, y = make_data(0, np.float32)
        loss_fn(fsdp(cupy.asarray(shard(x, world.rank, 2))), cupy.asarray(shard(y, world.rank, 2)))
        fsdp.backward(loss_fn.backward(), input_grad=False)
        with count_syncs() as log:
            totals[world.rank] = fsdp.clip_grad_norm(1e-3, norm_type)
        logs[world.rank] = log

    run_device_world(run, 2, FakeNccl(), cupy)
    assert [len(logs[r]) for r in range(2)] == [1, 1], logs
    assert totals[0] == totals[1] > 1e-3


_cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("bad", [None, np.inf, np.nan])
def test_the_unscale_kernel_is_the_array_codes_result_on_a_gpu(bad):
    grads, found, _, _ = _unscaled(_cupy, bad, fused=True)
    array_grads, array_found, _, _ = _unscaled(_cupy, bad, fused=False)
    assert found == array_found == (bad is not None)
    for a, b in zip(grads, array_grads):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
def test_a_deferred_step_is_the_plain_step_on_a_gpu():
    plain, _, plain_params = _deferred_steps(_cupy, deferred=False)
    deferred, _, params = _deferred_steps(_cupy, deferred=True)
    for (loss, norm), (device_loss, device_norm) in zip(plain, deferred):
        assert isinstance(device_loss, _cupy.ndarray) and float(device_loss) == loss
        assert float(device_norm) == float(norm)
    for a, b in zip(plain_params, params):
        np.testing.assert_array_equal(a, b)
