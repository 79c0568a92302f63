"""The layers' fused device kernels (``axonhpc.nn.kernels``) against their array code.

Without a GPU the kernels run on the strict cupy stand-in, which compiles
their bodies as C on the host (``host_kernels``). There ``exp``, ``tanh`` and ``log``
are the C library's, a few ulp from numpy's, while on a GPU the fused and the
array code call the same CUDA functions. So the bit-for-bit checks here run
the array code with the stand-in's ``exp``, ``tanh`` and ``log`` taken from the C
library too (``c_math``): what is left to differ is the order and dtype of
the arithmetic, which must be the same to the last bit. Against numpy the
results agree to a few ulp. ``test_fused_matches_the_array_code_on_a_gpu``
makes the bit-for-bit check with cupy on a GPU (marked ``gpu``).
"""
import importlib

import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.cuda import kernels as cuda_kernels
from axonhpc.nn import kernels
from axonhpc.backends.devices import device_facts
from axonhpc.errors import ConfigurationError, ShapeError
from axonhpc.settings import settings


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
    before = cuda_kernels.launches(c_math)
    fused = _layer_run(c_math, LAYERS[name](), x, g)
    assert cuda_kernels.launches(c_math) - before == LAUNCHES[name]
    monkeypatch.setattr(settings, "fused_kernels", False)
    array_code = _layer_run(c_math, LAYERS[name](), x, g)
    assert cuda_kernels.launches(c_math) - before == LAUNCHES[name]  # the setting off launches none
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_relu_kernels_give_plus_zero_for_negative_infinity_as_pytorch(dtype, c_math):
    # torch.relu: -inf and -1 give +0.0 (x * (x > 0) gives NaN and -0.0), -0.0 and NaN pass; the gradient passes
    # where the output is not <= 0 (NaN included)
    x = np.array([-np.inf, -1.0, -0.0, 0.0, np.nan, 2.0, np.inf], dtype=dtype)
    expected = np.array([0.0, 0.0, -0.0, 0.0, np.nan, 2.0, np.inf], dtype=dtype)
    mask = [False, False, False, False, True, True, True]
    y, m = kernels.relu_forward(c_math.asarray(x))
    _same_bits(y.get(), expected)
    np.testing.assert_array_equal(m.get(), mask)
    y, m = kernels.bias_relu(c_math.asarray(x - 1), c_math.asarray(np.ones_like(x)))
    _same_bits(y.get(), expected + 0.0)  # -0.0 - 1 + 1 is +0.0
    np.testing.assert_array_equal(m.get(), mask)


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


def _same_bias_sum(a, b, dtype):
    """Two bias gradients of ``_linear_run``: a column sum by GEMM (fused kernels on) against ``a.sum(axis=0)``
    (off), the same sum of its 35 rows of |g| < 4 in another order ([Note: column sums by GEMM])."""
    eps = float(np.finfo(dtype).eps)
    np.testing.assert_allclose(a, b, rtol=16 * eps, atol=16 * eps * 35 * 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("activation", sorted(ACTIVATED))
def test_a_linear_with_an_activation_is_the_linear_then_the_activation(activation, dtype, c_math, monkeypatch):
    name = {"relu": "bias_relu"}.get(activation, "bias_gelu")
    before = cuda_kernels.launches(c_math, (name,))
    fused = _linear_run(c_math, activation, dtype, fused_bias=True)
    assert cuda_kernels.launches(c_math, (name,)) - before == 1  # the bias add is in the activation's kernel
    apart = _linear_run(c_math, activation, dtype, fused_bias=False)
    assert cuda_kernels.launches(c_math, (name,)) - before == 2  # Sequential(Linear, activation) adds it there too
    monkeypatch.setattr(settings, "fused_kernels", False)
    array_code = _linear_run(c_math, activation, dtype, fused_bias=True)
    assert cuda_kernels.launches(c_math, (name,)) - before == 2  # the setting off: the array code
    for a, b in zip(fused, apart):
        _same_bits(a, b)
    for a, c in zip(fused[:3], array_code[:3]):
        _same_bits(a, c)
    _same_bias_sum(fused[3], array_code[3], dtype)
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


CE_KERNELS = ("sum_exp", "cross_entropy_rows", "cross_entropy_grad")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("target_dtype", [np.int32, np.int64])
def test_the_fused_cross_entropy_is_three_kernels_and_the_array_code_after_the_row_sums(dtype, target_dtype, c_math,
                                                                                       monkeypatch):
    # [Note: the fused cross-entropy]: only the order of the row sums may differ from the array code.
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, 5, 37)) * 4).astype(dtype)  # a language model's (B, T, V)
    targets = rng.integers(0, 37, (3, 5)).astype(target_dtype)
    loss_fn = nn.CrossEntropyLoss()
    counts = {name: cuda_kernels.launches(c_math, (name,)) for name in CE_KERNELS}
    loss = loss_fn(c_math.asarray(logits), c_math.asarray(targets))
    x, m, ls, kept_targets, _, _ = cache = loss_fn._cache
    fused = loss_fn.backward(0.25)
    assert {name: cuda_kernels.launches(c_math, (name,)) - counts[name] for name in CE_KERNELS} == dict.fromkeys(CE_KERNELS, 1)
    assert fused.shape == logits.shape and fused.dtype == dtype

    # the row sums: the fused reduction's order against cupy.sum's (numpy's on the stand-in)
    x_, m_ = x.get(), m.get()
    np.testing.assert_allclose(np.exp(ls.get()), np.sum(np.exp(x_ - m_), axis=-1, keepdims=True),
                               rtol=4 * np.finfo(dtype).eps)
    # everything computed from them is the array code bit for bit
    monkeypatch.setattr(settings, "fused_kernels", False)
    loss_fn._save_cache(cache)
    _same_bits(fused.get(), loss_fn.backward(0.25).get())
    rows = c_math.arange(x.shape[0])
    picked = (x[rows, kept_targets] - m[:, 0]) - ls[:, 0]
    assert loss == float((-picked.mean()).astype(np.float64).get())
    s = kernels.sum_exp(x, m)
    row_ls, row_picked = kernels.cross_entropy_rows(x, m, s, kept_targets)
    _same_bits(row_ls.get(), c_math.log(s)[:, 0].get())
    _same_bits(row_picked.get(), ((x[rows, kept_targets] - m[:, 0]) - c_math.log(s)[:, 0]).get())

    array_loss, array_grad = _loss_grad(c_math, logits, targets, 0.25)
    host_loss, on_host = _loss_grad(np, logits, targets, 0.25)
    eps = float(np.finfo(dtype).eps)
    assert loss == pytest.approx(array_loss, rel=8 * eps) and loss == pytest.approx(host_loss, rel=8 * eps)
    np.testing.assert_allclose(fused.get(), array_grad, rtol=8 * eps, atol=1e-7)
    np.testing.assert_allclose(fused.get(), on_host, rtol=8 * eps, atol=1e-7)


def test_the_fused_cross_entropy_checks_targets_and_leaves_strided_logits_to_the_array_code(strict_cupy):
    rng = np.random.default_rng(3)
    logits = strict_cupy.asarray(rng.standard_normal((4, 12)).astype(np.float32))
    loss_fn = nn.CrossEntropyLoss()
    for bad in ([0, 1, 12, 2], [0, -1, 3, 2]):  # read clipped on the device, refused once read
        with pytest.raises(ShapeError, match=r"targets must be in \[0, 12\)"):
            loss_fn(logits, strict_cupy.asarray(np.array(bad)))
        assert loss_fn.__dict__.get("_cache") is None
    before = cuda_kernels.launches(strict_cupy)
    strided = logits[:, ::2]  # (4, 6), not C-contiguous
    targets = np.array([0, 5, 3, 1])
    loss = loss_fn(strided, strict_cupy.asarray(targets))
    grad = loss_fn.backward()
    assert cuda_kernels.launches(strict_cupy) == before + 1  # the gradient's kernel only
    host = nn.CrossEntropyLoss()
    assert loss == pytest.approx(host(strided.get(), targets), rel=1e-6)
    np.testing.assert_allclose(grad.get(), host.backward(), rtol=1e-6, atol=1e-8)


def test_what_the_kernels_do_not_serve_keeps_the_array_code(strict_cupy):
    rng = np.random.default_rng(2)
    before = cuda_kernels.launches(strict_cupy)
    half = rng.standard_normal((4, 6)).astype(np.float16)
    for layer in (nn.ReLU(), nn.GELU(), nn.Tanh()):
        layer.backward(layer(strict_cupy.asarray(half)))
    _loss_grad(strict_cupy, half, rng.integers(0, 6, 4))  # float16 logits: float32 work, float16 gradient
    _loss_grad(strict_cupy, half.astype(np.float32), rng.integers(0, 6, 4).astype(np.uint8))
    assert cuda_kernels.launches(strict_cupy) == before
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(strict_cupy.asarray(half.astype(np.float32)), strict_cupy.asarray(rng.integers(0, 6, 4)))
    before = cuda_kernels.launches(strict_cupy)
    loss_fn.backward(np.float32(0.5))  # not a Python number: the array code scales by it as it is
    assert cuda_kernels.launches(strict_cupy) == before
    layer = nn.GELU()
    layer(strict_cupy.asarray(half.astype(np.float32)))
    layer.backward(strict_cupy.asarray(half))  # a gradient of another dtype: the backward's array code
    assert cuda_kernels.launches(strict_cupy) == before + 1
    nn.ReLU()(np.ones(3, dtype=np.float32))
    assert not cuda_kernels.kept(np)


def test_optimizers_built_with_fused_none_follow_the_setting(strict_cupy, monkeypatch):
    p = nn.Parameter(strict_cupy.ones(4, dtype=np.float32))
    opts = [optim.SGD([p], lr=0.1), optim.Adam([p], lr=0.1), optim.SGD([p], lr=0.1, fused=True)]
    monkeypatch.setattr(settings, "fused_kernels", False)
    before = cuda_kernels.launches(strict_cupy)
    for opt in opts[:2]:
        p.grad = strict_cupy.ones(4, dtype=np.float32)
        opt.step()
    assert cuda_kernels.launches(strict_cupy) == before
    p.grad = strict_cupy.ones(4, dtype=np.float32)
    opts[2].step()  # fused=True is the caller's explicit choice
    assert cuda_kernels.launches(strict_cupy) == before + 1


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


def test_the_stand_in_reduction_broadcasts_reduces_and_refuses_as_cupy_does(strict_cupy):
    kernel = strict_cupy.ReductionKernel("T x, T w", "T y", "x * w", "a + b", "y = a + (T)1", "0", "k")
    x = np.arange(24.0).reshape(2, 3, 4)
    w = np.array([[1.0], [2.0], [3.0]])  # (3, 1) broadcast against (2, 3, 4)
    d = strict_cupy.asarray
    np.testing.assert_array_equal(kernel(d(x), d(w), axis=-1).get(), (x * w).sum(-1) + 1)
    np.testing.assert_array_equal(kernel(d(x), d(w), axis=(0, 2), keepdims=True).get(),
                                  (x * w).sum((0, 2), keepdims=True) + 1)
    assert kernel(d(x), d(w)).shape == () and kernel(d(x), d(w)).get() == (x * w).sum() + 1
    out = strict_cupy.zeros(3)
    assert kernel(d(x), d(w), axis=(0, 2), out=out) is out and out.get()[0] == (x * w)[:, 0].sum() + 1
    with pytest.raises(np.exceptions.AxisError, match="axis 3 is out of bounds"):
        kernel(d(x), d(w), axis=3)
    with pytest.raises(ValueError, match="duplicate value in 'axis'"):
        kernel(d(x), d(w), axis=(1, -2))
    with pytest.raises(TypeError, match="Wrong number of arguments"):
        kernel(d(x))
    with pytest.raises(TypeError):
        kernel(d(x), w)  # a host array
    with pytest.raises(TypeError, match="Type is mismatched"):
        kernel(d(x), d(w.astype(np.float32)))


def test_every_kernel_is_compiled_without_multiply_add_contraction(strict_cupy):
    x = strict_cupy.asarray(np.linspace(-3, 3, 8))
    for layer in LAYERS.values():
        m = layer()
        m.backward(m(x))
    _loss_grad(strict_cupy, np.ones((2, 4)), np.array([0, 3]))
    names = {name for name, _ in cuda_kernels.kept(strict_cupy)}
    assert names == {"relu", "gelu_forward", "gelu_backward", "tanh_backward", *CE_KERNELS}
    assert all(k.options == cuda_kernels.OPTIONS == ("--fmad=false",) for k in cuda_kernels.kept(strict_cupy).values())


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
                runs.append(list(_loss_grad(_cupy, logits, rng.integers(0, 33, 64), 0.5)))
            else:
                runs.append(_layer_run(_cupy, LAYERS[name](), *_inputs(dtype)))
    finally:
        settings.fused_kernels = saved
    if name == "cross_entropy":  # [Note: the fused cross-entropy]: the row sums may be folded in another order
        eps = float(np.finfo(dtype).eps)
        assert runs[0][0] == pytest.approx(runs[1][0], rel=8 * eps)
        np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=8 * eps, atol=1e-7)
        return
    if name.startswith("linear_"):
        _same_bias_sum(runs[0][3], runs[1][3], dtype)
        runs = [run[:3] for run in runs]
    for a, b in zip(*runs):
        _same_bits(a, b)

