"""Array-module dispatch: nn, optim and data run unchanged on the strict cupy stand-in.

cupy is not needed here. ``strict_cupy`` plays cupy with an array type that
is NOT a numpy subclass and refuses what cupy refuses: implicit conversion to
numpy (``np.asarray``, numpy functions with no cupy counterpart), host arrays
mixed into arithmetic or assignment, ``flags.writeable``. So any layer that
calls a numpy-only function on data, or forgets to move a host-made array to
the device, fails here as it would on a GPU.
"""
import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.data import DataLoader
from support.strict_cupy import DeviceArray, StrictCupy


@pytest.fixture
def fake_cupy(monkeypatch):
    module = StrictCupy()
    monkeypatch.setitem(__import__("sys").modules, "cupy", module)
    return module


def _model(seed, vocab=11):
    return nn.Sequential(
        nn.Embedding(vocab, 8, seed=seed), nn.LayerNorm(8),
        nn.MultiHeadAttention(8, 2, causal=True, seed=seed + 1), nn.Dropout(0.2, seed=seed + 2),
        nn.Linear(8, 12, seed=seed + 3), nn.GELU(), nn.Tanh(), nn.ReLU(),
        nn.Linear(12, vocab, seed=seed + 4),
    )


def test_fake_device_array_rejects_numpy_calls(fake_cupy):
    x = fake_cupy.asarray(np.ones(3))
    assert isinstance(x, DeviceArray) and isinstance(x * 2, DeviceArray)
    with pytest.raises(TypeError):
        np.asarray(x)
    with pytest.raises(TypeError):
        x + np.ones(3)
    with pytest.raises(TypeError):
        x[...] = np.ones(3)


@pytest.mark.parametrize("make_opt", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: optim.AdamW(ps, lr=1e-2),
])
def test_training_step_on_device_matches_host(fake_cupy, make_opt):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 11, (3, 5))
    targets = rng.integers(0, 11, 15)
    host, device = _model(0), _model(0).to("cuda")
    assert all(isinstance(p.data, DeviceArray) for p in device.parameters())
    opts = [make_opt(host.parameters()), make_opt(device.parameters())]
    losses = []
    for model, opt, put in ((host, opts[0], np.asarray), (device, opts[1], fake_cupy.asarray)):
        loss_fn = nn.CrossEntropyLoss()
        run = []
        for _ in range(3):
            logits = model(put(tokens))
            loss = loss_fn(logits.reshape(-1, 11), put(targets))
            model.backward(loss_fn.backward().reshape(logits.shape))
            total = optim.clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            run.append((float(loss), float(total)))
        losses.append(run)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    for (name, a), b in zip(host.named_parameters(), device.parameters()):
        assert isinstance(b.data, DeviceArray) and isinstance(b.grad, DeviceArray), name
        if name.endswith("k_proj.bias") and not isinstance(opts[0], optim.SGD):
            # Softmax ignores a shift of the scores, so this bias's gradient is 0 but for rounding:
            # Adam divides that noise by its own size, and the device's fused GELU (the C library's
            # exp, a few ulp from numpy's) gives other noise. SGD moves it by ~lr * 1e-9.
            continue
        np.testing.assert_allclose(a.data, b.data.get(), rtol=1e-5, atol=1e-6, err_msg=name)
    for state in opts[1].state:
        assert all(isinstance(v, DeviceArray) for v in state.values() if hasattr(v, "shape"))


def test_state_dicts_and_mse_on_device(fake_cupy):
    device = nn.Sequential(nn.Linear(3, 2, seed=0)).to("cuda")
    host_sd = nn.Sequential(nn.Linear(3, 2, seed=5)).state_dict()
    device.load_state_dict(host_sd)  # host values into device parameters
    assert isinstance(device[0].weight.data, DeviceArray)
    np.testing.assert_array_equal(device[0].weight.data.get(), host_sd["0.weight"])
    loss_fn = nn.MSELoss()
    out = device(fake_cupy.asarray(np.ones((4, 3), dtype=np.float32)))
    loss_fn(out, fake_cupy.zeros((4, 2), dtype=np.float32))
    device.backward(loss_fn.backward())
    opt = optim.Adam(device.parameters())
    opt.step()
    sd = opt.state_dict()
    fresh = optim.Adam(device.parameters())
    fresh.load_state_dict(sd)
    assert isinstance(fresh.state[0]["exp_avg"], DeviceArray)
    back = device.to("cpu")
    assert type(back[0].weight.data) is np.ndarray


def test_data_loader_on_device_arrays(fake_cupy):
    x = fake_cupy.asarray(np.arange(12.0).reshape(6, 2))
    batches = list(DataLoader(x, 4, shuffle=True, seed=0))
    assert all(isinstance(b, DeviceArray) for b in batches)
    assert sorted(np.concatenate([b.get() for b in batches])[:, 0].tolist()) == list(range(0, 12, 2))


def test_autocast_on_device_matches_host(fake_cupy):
    """float16 products on the stand-in: every cast, sum and product stays on the device and agrees with the host's.

    Not bit for bit: a device product of float16 factors accumulates in float32 and rounds once (cuBLAS's
    ``CUBLAS_COMPUTE_32F``, played by the stand-in), numpy's float16 product rounds at every step; and a
    device weight gradient is accumulated into its float32 master inside the GEMM (``nn.gemm``), where the
    host rounds the float16 product first. So float16 rounding apart (2e-3 relative).
    """
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 11, (3, 5))
    targets = rng.integers(0, 11, 15)
    host, device = _model(3), _model(3).to("cuda")
    results = []
    for model, put in ((host, np.asarray), (device, fake_cupy.asarray)):
        loss_fn = nn.CrossEntropyLoss()
        with nn.autocast("float16"):
            logits = model(put(tokens))
            loss = loss_fn(logits.reshape(-1, 11), put(targets))
        assert logits.dtype == np.float16
        model.backward(loss_fn.backward(1024.0).reshape(logits.shape))
        results.append((loss, [p.grad for p in model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=2e-3)
    for (name, p), g_host, g_dev in zip(host.named_parameters(), results[0][1], results[1][1]):
        assert isinstance(g_dev, DeviceArray) and g_dev.dtype == np.float32, name
        scale = np.abs(g_host).max()
        np.testing.assert_allclose(g_dev.get(), g_host, rtol=0, atol=4e-3 * scale, err_msg=name)
