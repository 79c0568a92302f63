"""Array-module dispatch: nn, optim and data run unchanged on a stand-in for cupy.

cupy is not needed here. A fake ``cupy`` module wraps numpy and returns a
distinct ndarray subclass (the "device array"). That subclass refuses numpy's
function API (``np.where(device_array)`` and friends) and arithmetic mixing
device and host arrays, which real cupy also refuses. So any layer that calls
``np.*`` on data, or forgets to move a host-made array to the device, fails.
"""
import contextlib
import threading
import types

import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.data import DataLoader

_state = threading.local()


@contextlib.contextmanager
def _inside_fake():
    old = getattr(_state, "inside", False)
    _state.inside = True
    try:
        yield
    finally:
        _state.inside = old


class DeviceArray(np.ndarray):
    def __array_function__(self, func, types_, args, kwargs):
        if not getattr(_state, "inside", False):
            raise AssertionError(f"numpy.{func.__name__} called on a device array (use the array module)")
        return super().__array_function__(func, types_, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(type(i) is np.ndarray and i.ndim > 0 for i in inputs):
            raise TypeError(f"{ufunc.__name__}: mixing device and host arrays")
        inputs = tuple(i.view(np.ndarray) if isinstance(i, DeviceArray) else i for i in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, DeviceArray) else o for o in kwargs["out"])
        result = getattr(ufunc, method)(*inputs, **kwargs)
        return _to_device(result)

    def get(self):
        return np.array(self.view(np.ndarray))


def _to_device(result):
    if isinstance(result, np.ndarray) and not isinstance(result, DeviceArray):
        return result.view(DeviceArray)
    if isinstance(result, tuple):
        return tuple(_to_device(r) for r in result)
    return result


def _wrap(func):
    def wrapped(*args, **kwargs):
        with _inside_fake():
            return _to_device(func(*args, **kwargs))
    return wrapped


class _Ufunc:
    def __init__(self, ufunc):
        self._ufunc = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args, **kwargs):
        return _wrap(self._ufunc)(*args, **kwargs)

    def at(self, *args):
        with _inside_fake():
            self._ufunc.at(*(a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in args))


class _Namespace(types.ModuleType):
    def __init__(self, name, source):
        super().__init__(name)
        self._source = source

    def __getattr__(self, name):
        obj = getattr(self._source, name)
        if isinstance(obj, types.ModuleType):
            return _Namespace(f"{self.__name__}.{name}", obj)
        if isinstance(obj, np.ufunc):
            return _Ufunc(obj)
        if callable(obj) and not isinstance(obj, type):
            return _wrap(obj)
        return obj


@pytest.fixture
def fake_cupy(monkeypatch):
    module = _Namespace("cupy", np)
    module.ndarray = DeviceArray
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
    with pytest.raises(AssertionError):
        np.where(x > 0, x, 0)
    with pytest.raises(TypeError):
        x + np.ones(3)


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
            run.append((loss, total))
        losses.append(run)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    for (name, a), b in zip(host.named_parameters(), device.parameters()):
        assert isinstance(b.data, DeviceArray) and isinstance(b.grad, DeviceArray), name
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
