"""The compiled host kernels (axonhpc._ext._layers, _updates) against the numpy code they replace.

The numpy code (``settings.fused_kernels`` off) is the reference. Each kernel is held to a stated bound in
units in the last place: ``ulps(got, want, floor)`` is the largest ``|got - want|`` over the spacing of
``max(|want|, floor)`` in the arrays' dtype. The floors say what a difference is relative to where a result
is a small difference of larger numbers (GELU's ``x * cdf``, the tanh form's ``1 - t * t``). Where the
order of operations allows (the optimizers' updates, the embedding's scatter-add) the results are the
same bits. NaN must land where numpy puts it, and infinities must be numpy's.
"""
import tracemalloc

import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc._ext import _layers, _updates
from axonhpc.errors import (ConfigurationError, InvalidArgumentError, NonContiguousBufferError,
                            ReadOnlyBufferError, ShapeError, UnsupportedDtypeError)
from axonhpc.nn import kernels
from axonhpc.nn.attention import attention_backward, attention_forward
from axonhpc.settings import settings

DTYPES = [np.float32, np.float64]
WIDTHS = [1, 7, 64, 130]  # one column, a tail shorter than the eight partial sums, whole blocks, blocks and a tail


def ulps(got, want, floor=0.0):
    """The largest difference in ulps of max(|want|, floor); NaN and infinities must match exactly."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert np.isfinite(got[finite]).all()
    if not finite.any():
        return 0.0
    scale = np.maximum(np.abs(want), np.broadcast_to(np.abs(np.asarray(floor)), want.shape))[finite]
    spacing = np.spacing(scale.astype(want.dtype)).astype(np.float64)
    return float(np.max(np.abs(got[finite].astype(np.float64) - want[finite].astype(np.float64)) / spacing))


class Calls:
    """The compiled layer module, counting the kernels called by name."""

    def __init__(self, module):
        self.module, self.counts = module, {}

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return getattr(self.module, name)(*args, **kwargs)

        return call


@pytest.fixture
def calls(monkeypatch):
    counter = Calls(_layers)
    monkeypatch.setattr(kernels, "_HOST", counter)
    return counter.counts


def kernels_and_array_code(fn):
    """``fn()`` with the kernels, then with the array code."""
    settings.fused_kernels = True
    fused = fn()
    settings.fused_kernels = False
    reference = fn()
    settings.fused_kernels = True
    return fused, reference


def _gelu_run(approximate, x, g):
    def run():
        layer = nn.GELU(approximate)
        y = layer(x)
        return y, layer.backward(g)
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_gelu_exact_is_the_array_code_within_2_ulps(dtype, width, calls):
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((5, width)) * 3).astype(dtype)
    g = rng.standard_normal((5, width)).astype(dtype)
    (y, dx), (y_ref, dx_ref) = kernels_and_array_code(_gelu_run("none", x, g))
    assert calls == {"gelu_forward": 1, "gelu_backward": 1}
    assert ulps(y, y_ref, x) <= 2  # y = x * cdf: the cdf within 2 ulps of 1
    assert ulps(dx, dx_ref, g) <= 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_gelu_tanh_form_is_the_array_code_within_2_ulps(dtype, width, calls):
    rng = np.random.default_rng(width + 1)
    x = (rng.standard_normal((5, width)) * 3).astype(dtype)
    g = rng.standard_normal((5, width)).astype(dtype)
    (y, dx), (y_ref, dx_ref) = kernels_and_array_code(_gelu_run("tanh", x, g))
    assert calls == {"gelu_forward": 1, "gelu_backward": 1}
    assert ulps(y, y_ref, x) <= 2
    # The gradient holds 1 - t * t: an ulp of t near +-1 is |x|^3 larger there, in numpy's code as in the kernel's.
    assert ulps(dx, dx_ref, np.abs(g) * (1 + np.abs(x) ** 3)) <= 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_erf_in_gelu_spans_its_whole_range(dtype):
    """Every branch of the erf (small, middle, tail, saturated) against numpy's Cody erf, through GELU's cdf."""
    x = np.concatenate([np.linspace(-12, 12, 20001), np.geomspace(1e-30, 1e3, 500), -np.geomspace(1e-30, 1e3, 500),
                        [0.0, -0.0, 1e-300]]).astype(dtype)
    y, aux = np.empty_like(x), np.empty_like(x)
    _layers.gelu_forward(x, None, x, y, aux, False)
    settings.fused_kernels = False
    layer = nn.GELU()
    y_ref = layer(x)
    aux_ref = layer._pop_cache()[1]
    assert ulps(aux, aux_ref, 1.0) <= 2  # the cdf, 0.5 (1 + erf): absolute error in ulps of 1
    assert ulps(y, y_ref, x) <= 2
    assert (aux >= 0).all() and (aux <= 1).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_propagates_nan_and_infinities_as_numpy(dtype, approximate):
    x = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -50.0, 50.0, 3.0]], dtype=dtype)
    g = np.array([[1.0, 1.0, 1.0, np.nan, np.inf, -np.inf, 1.0, 1.0, 0.0]], dtype=dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        (y, dx), (y_ref, dx_ref) = kernels_and_array_code(_gelu_run(approximate, x, g))
    assert ulps(y, y_ref, np.where(np.isfinite(x), x, 1)) <= 2
    assert ulps(dx, dx_ref, np.where(np.isfinite(g), g, 1)) <= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_the_bias_add_in_the_activation_is_the_separate_add_bit_for_bit(dtype, activation, calls):
    """Linear(activation=...) and Sequential(Linear, activation) add the bias in the kernel: the add's bits."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 6)).astype(dtype)
    g = rng.standard_normal((4, 3, 9)).astype(dtype)
    make = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh")}[activation]

    def run(model, linear):
        y = model(x)
        return [y, model.backward(g), linear.weight.grad, linear.bias.grad]

    fused = nn.Linear(6, 9, dtype=dtype, seed=0, activation=activation)
    out_fused = run(fused, fused)
    linear = nn.Linear(6, 9, dtype=dtype, seed=0)
    out_seq = run(nn.Sequential(linear, make()), linear)
    name = "relu_forward" if activation == "relu" else "gelu_forward"
    assert calls[name] == 2
    linear = nn.Linear(6, 9, dtype=dtype, seed=0)
    y = linear(x)  # the add, then the activation's kernel on the sum
    out_apart = [make()(y)]
    for a, b in zip(out_fused, out_seq):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(out_fused[0], out_apart[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_and_tanh_backward_are_the_array_code_bit_for_bit(dtype, calls):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 11)).astype(dtype)
    x[0, :3] = [np.nan, 0.0, -0.0]
    g = rng.standard_normal((3, 11)).astype(dtype)

    def run():
        relu, tanh = nn.ReLU(), nn.Tanh()
        a, b = relu(x), tanh(x)
        return a, relu.backward(g), b, tanh.backward(g)

    with np.errstate(invalid="ignore"):
        fused, reference = kernels_and_array_code(run)
    assert calls == {"relu_forward": 1, "tanh_backward": 1}
    for a, b in zip(fused, reference):
        np.testing.assert_array_equal(a, b)


def _attention_run(q, k, v, g, causal):
    def run():
        ctx, cache = attention_forward(q, k, v, causal)
        attn = cache[3].copy()
        return (ctx, attn) + attention_backward(g, cache)
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 64, 130])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_softmax_is_the_array_code_within_8_ulps(dtype, n, causal, calls):
    rng = np.random.default_rng(n)
    q, k, v, g = (rng.standard_normal((2, 3, n, 8)).astype(dtype) for _ in range(4))
    fused, reference = kernels_and_array_code(_attention_run(q, k, v, g, causal))
    assert calls == {"softmax_forward": 1, "softmax_backward": 1}
    ctx, attn, dq, dk, dv = fused
    assert ulps(attn, reference[1]) <= 8  # exp's ulp and the row sum's order
    if causal:
        assert (np.triu(np.ones((n, n), bool), 1) <= (attn == 0)).all()  # the future is exactly 0
    for got, want in zip((ctx, dq, dk, dv), (reference[0],) + reference[2:]):
        assert ulps(got, want, np.abs(want).max()) <= 8  # products of those weights: relative to the largest


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_softmax_propagates_nan_as_numpy(dtype):
    rng = np.random.default_rng(8)
    q, k, v, g = (rng.standard_normal((1, 2, 6, 4)).astype(dtype) for _ in range(4))
    q[0, 0, 3, 1] = np.nan  # row 3 of head 0: NaN everywhere in it (and its gradients)
    g[0, 1, 2, 0] = np.inf
    with np.errstate(invalid="ignore"):
        fused, reference = kernels_and_array_code(_attention_run(q, k, v, g, True))
    for got, want in zip(fused, reference):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def _layer_norm_run(x, g, affine, seed=9):
    def run():
        rng = np.random.default_rng(seed)
        layer = nn.LayerNorm(x.shape[-1], elementwise_affine=affine, dtype=x.dtype)
        if affine:
            layer.weight.data[...] = rng.standard_normal(x.shape[-1])
            layer.bias.data[...] = rng.standard_normal(x.shape[-1])
        y = layer(x)
        dx = layer.backward(g)
        return (y, dx) + ((layer.weight.grad, layer.bias.grad) if affine else ())
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_the_array_code_within_4_ulps(dtype, width, affine, calls):
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((5, 3, width)) * 2 + 1).astype(dtype)
    g = rng.standard_normal((5, 3, width)).astype(dtype)
    fused, reference = kernels_and_array_code(_layer_norm_run(x, g, affine))
    assert calls == {"layernorm_forward": 1, "layernorm_backward": 1}
    for got, want in zip(fused, reference):
        # the row's mean and variance are sums in another order: relative to the row's largest value
        assert ulps(got, want, np.abs(want).max()) <= 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_propagates_nan_and_infinities_as_numpy(dtype):
    x = np.arange(24, dtype=dtype).reshape(4, 6)
    x[1, 2], x[2, 0] = np.nan, np.inf
    g = np.ones_like(x)
    with np.errstate(invalid="ignore"):
        fused, reference = kernels_and_array_code(_layer_norm_run(x, g, True))
    for got, want in zip(fused, reference):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)  # the rows without NaN are unaffected


def _loss_run(logits, targets, scale=0.5):
    def run():
        loss_fn = nn.CrossEntropyLoss()
        loss = loss_fn(logits, targets)
        return np.array(loss, dtype=logits.dtype), loss_fn.backward(scale)
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_cross_entropy_is_the_array_code_within_4_ulps(dtype, width, calls):
    rng = np.random.default_rng(width)
    logits = (rng.standard_normal((6, 5, width)) * 4).astype(dtype)  # a language model's (B, T, V)
    targets = rng.integers(0, width, (6, 5)).astype(np.int32)
    (loss, grad), (loss_ref, grad_ref) = kernels_and_array_code(_loss_run(logits, targets))
    assert calls == {"cross_entropy_forward": 1, "cross_entropy_backward": 1}
    assert ulps(loss, loss_ref) <= 4
    assert ulps(grad, grad_ref, np.abs(grad_ref).max()) <= 4
    assert grad.shape == logits.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_propagates_nan_and_refuses_targets_out_of_range(dtype):
    logits = np.zeros((3, 4), dtype=dtype)
    logits[1, 2] = np.nan
    (loss, grad), (loss_ref, grad_ref) = kernels_and_array_code(_loss_run(logits, np.array([0, 1, 3])))
    assert np.isnan(loss) and np.isnan(loss_ref)
    np.testing.assert_array_equal(np.isnan(grad), np.isnan(grad_ref))
    with pytest.raises(ShapeError, match=r"targets must be in \[0, 4\), got values in \[-1, 3\]"):
        nn.CrossEntropyLoss()(np.zeros((3, 4), dtype=dtype), np.array([0, -1, 3]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_is_add_at_bit_for_bit(dtype, calls):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 7, (5, 9))  # repeated indices: their rows add in order
    g = rng.standard_normal((5, 9, 3)).astype(dtype)

    def run():
        emb = nn.Embedding(7, 3, dtype=dtype, seed=0)
        emb(tokens)
        emb.backward(g)
        return emb.weight.grad
    fused, reference = kernels_and_array_code(run)
    assert calls == {"scatter_add_rows": 1}
    np.testing.assert_array_equal(fused, reference)


def test_empty_batches_run_through_the_kernels(calls):
    x = np.zeros((0, 7), np.float32)
    layer = nn.GELU()
    assert layer(x).shape == (0, 7) and layer.backward(x).shape == (0, 7)
    norm = nn.LayerNorm(7)
    assert norm(x).shape == (0, 7) and norm.backward(x).shape == (0, 7)
    np.testing.assert_array_equal(norm.weight.grad, np.zeros(7, np.float32))
    q = np.zeros((0, 2, 4, 3), np.float32)
    ctx, cache = attention_forward(q, q, q, True)
    assert ctx.shape == q.shape and all(a.shape == q.shape for a in attention_backward(q, cache))
    assert calls["gelu_forward"] == 1 and calls["layernorm_backward"] == 1 and calls["softmax_forward"] == 1


def test_what_the_host_kernels_do_not_take_keeps_the_array_code(calls):
    rng = np.random.default_rng(4)
    wide = rng.standard_normal((6, 10)).astype(np.float32)
    strided = wide[:, ::2]  # not C-contiguous
    layer = nn.GELU()
    layer.backward(layer(strided))
    layer.backward(layer(rng.standard_normal(5).astype(np.float16)))  # 16-bit: the kernel in float32 ...
    assert calls == {"gelu_forward": 1, "gelu_backward": 1}  # ... and the strided array by the array code
    norm = nn.LayerNorm((2, 5))  # two normalised axes: the array code
    norm.backward(norm(wide.reshape(6, 2, 5)))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(strided, np.zeros(6, np.int64))
    loss_fn.backward()
    nn.ReLU()(np.arange(4))  # integers
    assert calls == {"gelu_forward": 1, "gelu_backward": 1}
    settings.fused_kernels = False
    layer.backward(layer(wide))
    assert calls == {"gelu_forward": 1, "gelu_backward": 1}


def test_the_kernels_check_their_arguments_before_touching_memory():
    x = np.ones((3, 4), np.float32)
    y = np.zeros((3, 4), np.float32)
    with pytest.raises(UnsupportedDtypeError, match="GELU input has dtype float16; the host kernels take float32"):
        _layers.gelu_forward(x.astype(np.float16), None, x, y, y, False)
    with pytest.raises(UnsupportedDtypeError, match="GELU output has dtype float64, the kernel's arrays are float32"):
        _layers.gelu_forward(x, None, x, np.zeros((3, 4)), y, False)
    with pytest.raises(NonContiguousBufferError, match="GELU saved"):
        _layers.gelu_forward(x, None, x, y, np.zeros((3, 8), np.float32)[:, ::2], False)
    with pytest.raises(ShapeError, match=r"bias has shape \(3,\) \(3 elements\), the kernel needs 4 elements"):
        _layers.gelu_forward(x, np.ones(3, np.float32), x, y, y.copy(), False)
    frozen = np.zeros((3, 4), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ReadOnlyBufferError, match="ReLU output"):
        _layers.relu_forward(x, None, frozen, np.zeros((3, 4), bool))
    with pytest.raises(InvalidArgumentError, match="without a bias takes x=pre"):
        _layers.gelu_forward(x, None, y, y.copy(), y.copy(), False)
    with pytest.raises(ShapeError, match=r"causal attention scores must be \(\.\.\., n, n\), got shape \(3, 4\)"):
        _layers.softmax_forward(x, 1.0, True)
    with pytest.raises(ShapeError, match=r"scatter-add indices must be in \[0, 3\), got values in \[0, 3\]"):
        _layers.scatter_add_rows(np.array([0, 3]), np.ones((2, 4), np.float32), np.zeros((3, 4), np.float32))
    with pytest.raises(UnsupportedDtypeError, match="targets has dtype int32"):
        _layers.cross_entropy_forward(x, np.zeros(3, np.int32), *(np.zeros(3, np.float32) for _ in range(3)))
    np.testing.assert_array_equal(y, 0)  # nothing was written by a refused call


OPTIMIZERS = {
    "sgd": lambda ps, fused: optim.SGD(ps, lr=0.1, fused=fused),
    "sgd-momentum-l2": lambda ps, fused: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=fused),
    "sgd-dampened": lambda ps, fused: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, fused=fused),
    "sgd-nesterov": lambda ps, fused: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=fused),
    "adam": lambda ps, fused: optim.Adam(ps, lr=1e-2, fused=fused),
    "adam-l2": lambda ps, fused: optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=fused),
    "adamw": lambda ps, fused: optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=fused),
}
SHAPES = [(3, 5), (7,), (1,), (0,), (4, 4)]


def _train(make, dtype, fused, steps=4):
    rng = np.random.default_rng(1)
    params = [nn.Parameter(rng.standard_normal(s).astype(dtype)) for s in SHAPES]
    opt = make(params, fused)
    for _ in range(steps):
        for p in params:
            p.grad = rng.standard_normal(p.shape).astype(dtype)
        opt.step()
    return [p.data for p in params], opt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_host_updates_are_the_array_code_bit_for_bit(dtype, name, monkeypatch):
    seen = []
    real = _updates.adam_many if name.startswith("adam") else _updates.sgd_many
    monkeypatch.setattr(_updates, real.__name__, lambda *a: (seen.append(len(a[0])), real(*a)))
    fused, _ = _train(OPTIMIZERS[name], dtype, None)
    assert seen == [len(SHAPES)] * 4  # every parameter of the dtype in one call a step
    reference, _ = _train(OPTIMIZERS[name], dtype, False)
    for a, b in zip(fused, reference):
        np.testing.assert_array_equal(a, b)


def test_host_updates_leave_strided_parameters_to_the_array_code_and_refuse_them_with_fused_true():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((4, 6)).astype(np.float32)
    p = nn.Parameter(base[:, ::2])
    opt = optim.Adam([p], lr=0.1)
    p.grad = np.ones(p.shape, np.float32)
    opt.step()  # the array code: no error
    assert optim.SGD([nn.Parameter(np.zeros(3, np.float32))], lr=0.1, fused=True).fused is True
    q = nn.Parameter(np.zeros(6, np.float32))
    sgd = optim.SGD([q], lr=0.1, fused=True)
    q.grad = np.ones(12, np.float32)[::2]
    with pytest.raises(ConfigurationError, match="not C-contiguous"):
        sgd.step()


def test_an_optimizer_step_allocates_nothing_on_the_host():
    params, opt = _train(OPTIMIZERS["adamw"], np.float32, None, steps=2)
    tracemalloc.start()
    try:
        opt.step()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096, peak  # Python's own bookkeeping only: no array, no temporary


@pytest.mark.parametrize("case", ["gelu", "layer_norm", "softmax", "loss_grad"])
def test_a_kernel_allocates_only_what_it_returns_and_keeps(case):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    nbytes = x.nbytes
    if case == "gelu":
        layer = nn.GELU()
        run, keeps = (lambda: layer(x)), 2 * nbytes  # y, and the cdf for the backward
    elif case == "layer_norm":
        layer = nn.LayerNorm(512)
        run, keeps = (lambda: layer(x)), 2 * nbytes + 256 * 4  # y, xhat, rstd
    elif case == "softmax":
        scores = x.reshape(2, 2, 128, 256).copy()
        run, keeps = (lambda: kernels.softmax_forward(scores[:, :, :, :128].copy(), 0.5, True)), nbytes // 2
    else:
        loss_fn = nn.CrossEntropyLoss()
        targets = rng.integers(0, 512, 256)
        run, keeps = (lambda: (loss_fn(x, targets), loss_fn.backward())), nbytes  # the gradient
    run()  # warm: first-call costs are not the step's
    tracemalloc.start()
    try:
        run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= keeps + 64 * 1024, (peak, keeps)  # the array code needs several times this in temporaries
