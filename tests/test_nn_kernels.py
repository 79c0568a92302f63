"""The layers' fused device kernels (``axonhpc.nn.kernels``) against their array code.

Without a GPU the kernels run on the strict cupy stand-in, which compiles
their bodies as C on the host (``host_kernels``). There ``exp`` and ``tanh``
are the C library's, a few ulp from numpy's, while on a GPU the fused and the
array code call the same CUDA functions. So the bit-for-bit checks here run
the array code with the stand-in's ``exp`` and ``tanh`` taken from the C
library too (``c_math``): what is left to differ is the order and dtype of
the arithmetic, which must be the same to the last bit. Against numpy the
results agree to a few ulp. ``test_fused_matches_the_array_code_on_a_gpu``
makes the bit-for-bit check with cupy on a GPU (marked ``gpu``).
"""
import importlib
import sys

import numpy as np
import pytest

from axonhpc import _kernels, nn, optim
from axonhpc.backends.devices import device_facts
from axonhpc.errors import ConfigurationError
from axonhpc.settings import settings
from strict_cupy import DeviceArray, StrictCupy


@pytest.fixture
def strict_cupy(monkeypatch):
    cupy = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


@pytest.fixture
def c_math(strict_cupy, monkeypatch):
    """The stand-in's ``exp`` and ``tanh`` from the C library, as the fused kernels' are."""
    for name in ("exp", "tanh"):
        kernel = strict_cupy.ElementwiseKernel("T x", "T y", f"y = {name}(x);", f"c_{name}")

        def ufunc(x, _kernel=kernel, _name=name):
            assert type(x) is DeviceArray and x.dtype in _kernels.KERNEL_DTYPES, (_name, type(x), x.dtype)
            return _kernel(x)

        monkeypatch.setattr(strict_cupy, name, ufunc, raising=False)
    return strict_cupy


def _inputs(dtype):
    """Every branch of the erf: |x / sqrt 2| up to 0.47, to 4, to 27 and beyond, zeros, infinities, NaN."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-12, 12, 241), rng.standard_normal(64) * 3, [0.0, -0.0, 0.6629, -0.6629, 5.657,
                                                                             40.0, -40.0, np.inf, -np.inf, np.nan]])
    return x.astype(dtype), rng.standard_normal(x.shape).astype(dtype)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    bad = np.flatnonzero((a != b)[~nan] | (np.signbit(a) != np.signbit(b))[~nan])
    assert bad.size == 0, [(a[~nan][i], b[~nan][i]) for i in bad[:5]]


def _layer_run(xp, layer, x, g):
    """Output and input gradient of ``layer`` for ``x`` and upstream gradient ``g`` (numpy arrays out)."""
    y = layer(xp.asarray(x))
    dx = layer.backward(xp.asarray(g))
    return [a if isinstance(a, np.ndarray) else a.get() for a in (y, dx)]


LAYERS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh"), "tanh": nn.Tanh}
# Launches of fused kernels in one forward and backward: ReLU's backward and Tanh's forward are one
# array operation already and keep it.
LAUNCHES = {"relu": 1, "gelu": 2, "gelu_tanh": 2, "tanh": 1}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_layer_is_its_array_code_bit_for_bit(name, dtype, c_math, monkeypatch):
    x, g = _inputs(dtype)
    before = _kernels.launches(c_math)
    fused = _layer_run(c_math, LAYERS[name](), x, g)
    assert _kernels.launches(c_math) - before == LAUNCHES[name]
    monkeypatch.setattr(settings, "fused_kernels", False)
    array_code = _layer_run(c_math, LAYERS[name](), x, g)
    assert _kernels.launches(c_math) - before == LAUNCHES[name]  # the setting off launches none
    for a, b in zip(fused, array_code):
        _same_bits(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_layer_on_the_device_matches_numpy(name, dtype, strict_cupy):
    x, g = _inputs(dtype)
    fused = _layer_run(strict_cupy, LAYERS[name](), x, g)
    on_host = _layer_run(np, LAYERS[name](), x, g)
    ulp = np.finfo(dtype).eps
    for a, b in zip(fused, on_host):
        np.testing.assert_allclose(a, b, rtol=8 * ulp, atol=8 * ulp * np.nanmax(np.abs(b[np.isfinite(b)])))
        assert np.array_equal(np.isnan(a), np.isnan(b))


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
def test_a_fused_forward_and_an_array_backward_share_what_is_saved(name, c_math, monkeypatch):
    x, g = _inputs(np.float32)
    layer = LAYERS[name]()
    y = layer(c_math.asarray(x))
    monkeypatch.setattr(settings, "fused_kernels", False)
    mixed = [y.get(), layer.backward(c_math.asarray(g)).get()]
    for a, b in zip(mixed, _layer_run(c_math, LAYERS[name](), x, g)):
        _same_bits(a, b)


ACTIVATED = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh")}


def _linear_run(xp, activation, dtype, fused_bias):
    """Output, input gradient and parameter gradients of Linear(activation=...) or Sequential(Linear, activation)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((5, 7, 6)) * 3).astype(dtype)  # (..., in): a batch of sequences
    g = rng.standard_normal((5, 7, 9)).astype(dtype)
    if fused_bias:
        model = nn.Linear(6, 9, dtype=dtype, seed=0, activation=activation)
        linear = model
    else:
        linear = nn.Linear(6, 9, dtype=dtype, seed=0)
        model = nn.Sequential(linear, ACTIVATED[activation]())
    model.to("cuda" if xp is not np else None)
    y = model(xp.asarray(x))
    dx = model.backward(xp.asarray(g))
    out = [y, dx, linear.weight.grad, linear.bias.grad]
    return [a if isinstance(a, np.ndarray) else a.get() for a in out]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("activation", sorted(ACTIVATED))
def test_a_linear_with_an_activation_is_the_linear_then_the_activation(activation, dtype, c_math, monkeypatch):
    name = {"relu": "bias_relu"}.get(activation, "bias_gelu")
    before = _kernels.launches(c_math, (name,))
    fused = _linear_run(c_math, activation, dtype, fused_bias=True)
    assert _kernels.launches(c_math, (name,)) - before == 1  # the bias add is in the activation's kernel
    apart = _linear_run(c_math, activation, dtype, fused_bias=False)
    monkeypatch.setattr(settings, "fused_kernels", False)
    array_code = _linear_run(c_math, activation, dtype, fused_bias=True)
    assert _kernels.launches(c_math, (name,)) - before == 1  # the setting off: the array code
    for a, b, c in zip(fused, apart, array_code):
        _same_bits(a, b)
        _same_bits(a, c)
    for a, b in zip(_linear_run(np, activation, dtype, True), _linear_run(np, activation, dtype, False)):
        _same_bits(a, b)  # the host: Sequential(Linear, activation)'s code, so its bits


def test_a_linear_activation_is_checked_and_kept_out_of_the_state_dict():
    with pytest.raises(ConfigurationError, match=r"activation must be None or one of \['gelu', 'gelu_tanh', 'relu'\]"):
        nn.Linear(2, 3, activation="swish")
    layer = nn.Linear(2, 3, activation="gelu_tanh")
    assert isinstance(layer.activation, nn.GELU) and layer.activation.approximate == "tanh"
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert nn.Linear(2, 3, bias=False, activation="relu")(np.ones((1, 2), np.float32)).min() >= 0


def _loss_grad(xp, logits, targets, scale=1.0):
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(xp.asarray(logits), xp.asarray(targets))
    grad = loss_fn.backward(scale)
    return loss, grad if isinstance(grad, np.ndarray) else grad.get()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("target_dtype", [np.int32, np.int64])
def test_the_cross_entropy_gradient_is_one_kernel_and_its_array_code(dtype, target_dtype, c_math, monkeypatch):
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, 5, 7)) * 4).astype(dtype)  # a language model's (B, T, V)
    targets = rng.integers(0, 7, (3, 5)).astype(target_dtype)
    before = _kernels.launches(c_math, ("cross_entropy_grad",))
    loss, fused = _loss_grad(c_math, logits, targets, 0.25)
    assert _kernels.launches(c_math, ("cross_entropy_grad",)) - before == 1
    monkeypatch.setattr(settings, "fused_kernels", False)
    loss_array, array_code = _loss_grad(c_math, logits, targets, 0.25)
    assert loss == loss_array and fused.shape == logits.shape
    _same_bits(fused, array_code)
    host_loss, on_host = _loss_grad(np, logits, targets, 0.25)
    np.testing.assert_allclose(fused, on_host, rtol=8 * np.finfo(dtype).eps, atol=1e-7)


def test_what_the_kernels_do_not_serve_keeps_the_array_code(strict_cupy):
    rng = np.random.default_rng(2)
    before = _kernels.launches(strict_cupy)
    half = rng.standard_normal((4, 6)).astype(np.float16)
    for layer in (nn.ReLU(), nn.GELU(), nn.Tanh()):
        layer.backward(layer(strict_cupy.asarray(half)))
    _loss_grad(strict_cupy, half, rng.integers(0, 6, 4))  # float16 logits: float32 work, float16 gradient
    _loss_grad(strict_cupy, half.astype(np.float32), rng.integers(0, 6, 4).astype(np.uint8))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(strict_cupy.asarray(half.astype(np.float32)), strict_cupy.asarray(rng.integers(0, 6, 4)))
    loss_fn.backward(np.float32(0.5))  # not a Python number: the array code scales by it as it is
    assert _kernels.launches(strict_cupy) == before
    layer = nn.GELU()
    layer(strict_cupy.asarray(half.astype(np.float32)))
    layer.backward(strict_cupy.asarray(half))  # a gradient of another dtype: the backward's array code
    assert _kernels.launches(strict_cupy) == before + 1
    nn.ReLU()(np.ones(3, dtype=np.float32))
    assert not _kernels.kept(np)


def test_optimizers_built_with_fused_none_follow_the_setting(strict_cupy, monkeypatch):
    p = nn.Parameter(strict_cupy.ones(4, dtype=np.float32))
    opts = [optim.SGD([p], lr=0.1), optim.Adam([p], lr=0.1), optim.SGD([p], lr=0.1, fused=True)]
    monkeypatch.setattr(settings, "fused_kernels", False)
    before = _kernels.launches(strict_cupy)
    for opt in opts[:2]:
        p.grad = strict_cupy.ones(4, dtype=np.float32)
        opt.step()
    assert _kernels.launches(strict_cupy) == before
    p.grad = strict_cupy.ones(4, dtype=np.float32)
    opts[2].step()  # fused=True is the caller's explicit choice
    assert _kernels.launches(strict_cupy) == before + 1


def test_the_stand_in_kernel_broadcasts_indexes_and_refuses_as_cupy_does(strict_cupy):
    kernel = strict_cupy.ElementwiseKernel("T x, L col", "T y", "y = x * (T)(i % 3 == col) + twice(x);", "k",
                                           preamble="static __device__ T twice(T v) { return v + v; }")
    x = strict_cupy.asarray(np.arange(6.0).reshape(2, 3))
    y = kernel(x, strict_cupy.asarray(np.array([[2], [0]])))  # (2, 3) with (2, 1)
    np.testing.assert_array_equal(y.get(), [[0, 2, 6], [9, 8, 10]])
    with pytest.raises(ValueError, match=r"could not be broadcast"):
        kernel(x, strict_cupy.asarray(np.zeros(2, dtype=np.int64)))
    with pytest.raises(ValueError, match=r"output 'y' .* has shape \(3,\), the arguments broadcast to \(2, 3\)"):
        kernel(x, strict_cupy.asarray(np.zeros((2, 1), dtype=np.int64)), strict_cupy.zeros(3))
    with pytest.raises(TypeError):
        kernel(x, np.zeros((2, 1), dtype=np.int64))  # a host array


def test_every_kernel_is_compiled_without_multiply_add_contraction(strict_cupy):
    x = strict_cupy.asarray(np.linspace(-3, 3, 8))
    for layer in LAYERS.values():
        m = layer()
        m.backward(m(x))
    _loss_grad(strict_cupy, np.ones((2, 4)), np.array([0, 3]))
    names = {name for name, _ in _kernels.kept(strict_cupy)}
    assert names == {"relu", "gelu_forward", "gelu_backward", "tanh_backward", "cross_entropy_grad"}
    assert all(k.options == _kernels.OPTIONS == ("--fmad=false",) for k in _kernels.kept(strict_cupy).values())


_cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(LAYERS) + ["cross_entropy"] + [f"linear_{a}" for a in sorted(ACTIVATED)])
def test_fused_matches_the_array_code_on_a_gpu(name, dtype):
    saved = settings.fused_kernels
    runs = []
    try:
        for fused in (True, False):
            settings.fused_kernels = fused
            if name.startswith("linear_"):
                runs.append(_linear_run(_cupy, name[len("linear_"):], dtype, fused_bias=True))
            elif name == "cross_entropy":
                rng = np.random.default_rng(1)
                logits = (rng.standard_normal((64, 33)) * 4).astype(dtype)
                runs.append([_loss_grad(_cupy, logits, rng.integers(0, 33, 64), 0.5)[1]])
            else:
                runs.append(_layer_run(_cupy, LAYERS[name](), *_inputs(dtype)))
    finally:
        settings.fused_kernels = saved
    for a, b in zip(*runs):
        _same_bits(a, b)

