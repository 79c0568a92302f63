"""LayerNorm and the attention's softmax as fused device kernels, against their array code.

[Note: fused LayerNorm and softmax on the device] in ``axonhpc.nn.kernels``: every element-wise kernel is its
array code bit for bit, and a row sum may be folded in another order. Without a GPU the kernels run on the
strict cupy stand-in (their bodies compiled as C on the host), with ``exp`` from the C library on both sides
(``c_math``), so the bit-for-bit checks compare the order and dtype of the arithmetic. On a GPU,
``test_fused_norm_and_softmax_match_the_array_code_on_a_gpu`` (marked ``gpu``) compares with real cupy.
"""
import importlib
import math

import numpy as np
import pytest

from axonhpc import nn
from axonhpc.backends.devices import device_facts
from axonhpc.cuda import kernels as cuda_kernels
from axonhpc.nn import kernels
from axonhpc.nn.attention import attention_backward, attention_forward
from axonhpc.settings import settings
from test_nn_kernels import _same_bits

DTYPES = [np.float32, np.float64]
LN_KERNELS = ("layer_norm_rstd", "layer_norm", "sum_product", "mean_product", "layer_norm_dx")
SOFTMAX_KERNELS = ("scale_mask", "sum_exp", "softmax_rows", "sum_product", "softmax_grad")


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _close(a, b, dtype, ulps=16):
    eps = float(np.finfo(dtype).eps)
    np.testing.assert_allclose(a, b, rtol=ulps * eps, atol=ulps * eps * float(np.max(np.abs(b))))


def _launches(xp, names):
    return {name: cuda_kernels.launches(xp, (name,)) for name in names}


def _counted(xp, names, run):
    """``run()``'s result, and the launches of each kernel of ``names`` it made."""
    before = _launches(xp, names)
    result = run()
    return result, {k: v - before[k] for k, v in _launches(xp, names).items()}


def _ln_data(dtype):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 6, 33)) * 3 + 1.5).astype(dtype)  # (batch, tokens, width), off-centre
    g = rng.standard_normal(x.shape).astype(dtype)
    w = (1 + 0.2 * rng.standard_normal(33)).astype(dtype)
    b = (0.3 * rng.standard_normal(33)).astype(dtype)
    return x, g, w, b


def _ln_run(xp, dtype, affine):
    """LayerNorm's output, input gradient and parameter gradients (numpy arrays out)."""
    x, g, w, b = _ln_data(dtype)
    layer = nn.LayerNorm(33, elementwise_affine=affine, dtype=dtype)
    if affine:
        layer.weight.data, layer.bias.data = w, b
    layer.to("cuda" if xp is not np else None)
    y = layer(xp.asarray(x))
    dx = layer.backward(xp.asarray(g))
    return [_host(a) for a in [y, dx] + ([layer.weight.grad, layer.bias.grad] if affine else [])]


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_on_the_device_is_its_fused_kernels_and_matches_the_array_code(dtype, affine, c_math,
                                                                                  monkeypatch):
    fused, counts = _counted(c_math, LN_KERNELS, lambda: _ln_run(c_math, dtype, affine))
    # the weight's and bias's column sums are GEMMs with a row of ones ([Note: column sums by GEMM]), not kernels
    assert counts == {"layer_norm_rstd": 1, "layer_norm": 1, "sum_product": 0,
                      "mean_product": 2 if affine else 1, "layer_norm_dx": 1}
    monkeypatch.setattr(settings, "fused_kernels", False)
    array_code, off = _counted(c_math, LN_KERNELS, lambda: _ln_run(c_math, dtype, affine))
    assert off == dict.fromkeys(LN_KERNELS, 0)
    on_host = _ln_run(np, dtype, affine)
    for a, b, c in zip(fused, array_code, on_host):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        _close(a, b, dtype)  # only the order of the row sums differs
        _close(a, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_element_wise_kernels_are_the_array_code_bit_for_bit(dtype, c_math):
    x, g, w, b = (c_math.asarray(a) for a in _ln_data(dtype))
    y, xhat, rstd = kernels.layer_norm_forward(x, w, b, 1e-5)
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    array_rstd = 1.0 / c_math.sqrt((centred * centred).mean(axis=-1, keepdims=True) + 1e-5)
    _close(rstd.get(), array_rstd.get(), dtype, ulps=4)  # the squared deviations summed in another order
    _same_bits(xhat.get(), (centred * rstd).get())  # from the same rstd: the array code's bits
    _same_bits(y.get(), (centred * rstd * w + b).get())
    plain_y, plain_xhat, plain_rstd = kernels.layer_norm_forward(x, None, None, 1e-5)
    assert plain_y is None
    _same_bits(plain_xhat.get(), xhat.get())
    _same_bits(plain_rstd.get(), rstd.get())

    dx, dweight, dbias = kernels.layer_norm_backward(g, xhat, rstd, w)
    dxhat = g * w
    m1, m2 = dxhat.mean(axis=-1, keepdims=True), (dxhat * xhat).mean(axis=-1, keepdims=True)
    _close(dbias.get(), g.sum(axis=(0, 1)).get(), dtype, ulps=4)  # column sums by GEMM: another order
    _close(dweight.get(), (g * xhat).sum(axis=(0, 1)).get(), dtype)
    _close(dx.get(), (rstd * (dxhat - m1 - xhat * m2)).get(), dtype)
    # the dx kernel on any row means is the array code's arithmetic on them, bit for bit
    for affine, args, array in ((True, (g, w, xhat, rstd, m1, m2), rstd * (dxhat - m1 - xhat * m2)),
                                (False, (g, xhat, rstd, m1, m2), rstd * (g - m1 - xhat * m2))):
        kernel = cuda_kernels.elementwise(c_math, "layer_norm_dx", (affine,), kernels._layer_norm_dx_source)
        _same_bits(kernel(*args).get(), array.get())


def _attention_data(dtype):
    rng = np.random.default_rng(6)
    q, k, v, dctx = (rng.standard_normal((2, 3, 7, 5)).astype(dtype) for _ in range(4))  # (B, H, T, D)
    return q, k, v, dctx


def _attention_run(xp, dtype, causal):
    q, k, v, dctx = (xp.asarray(a) for a in _attention_data(dtype))
    ctx, cache = attention_forward(q, k, v, causal)
    return [_host(a) for a in (ctx, cache[3], *attention_backward(dctx, cache))]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_softmax_on_the_device_is_four_and_two_kernels_and_matches_the_array_code(dtype, causal, c_math,
                                                                                    monkeypatch):
    fused, counts = _counted(c_math, SOFTMAX_KERNELS, lambda: _attention_run(c_math, dtype, causal))
    assert counts == dict.fromkeys(SOFTMAX_KERNELS, 1)
    if causal:  # the future of each query has no weight
        future = np.triu(np.ones(fused[1].shape[-2:], dtype=bool), 1)
        assert np.all(fused[1][..., future] == 0) and np.all(fused[1][..., ~future] > 0)
    monkeypatch.setattr(settings, "fused_kernels", False)
    array_code, off = _counted(c_math, SOFTMAX_KERNELS, lambda: _attention_run(c_math, dtype, causal))
    assert off == dict.fromkeys(SOFTMAX_KERNELS, 0)
    on_host = _attention_run(np, dtype, causal)
    for a, b, c in zip(fused, array_code, on_host):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        _close(a, b, dtype)
        _close(a, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_element_wise_kernels_are_the_array_code_bit_for_bit(dtype, c_math):
    q, k, _, dctx = (c_math.asarray(a) for a in _attention_data(dtype))
    scores = q @ k.transpose(0, 1, 3, 2)
    n, scale = scores.shape[-1], 1.0 / math.sqrt(q.shape[-1])  # a Python float, as the layer has it
    future = c_math.triu(c_math.ones((n, n), dtype=bool), 1)
    masked = c_math.where(future, c_math.asarray(-np.inf, dtype=scores.dtype), scores * scale)
    mask = cuda_kernels.elementwise(c_math, "scale_mask", (True,), kernels._scale_mask_source)
    _same_bits(mask(scores, dtype(scale), dtype(-np.inf), n).get(), masked.get())
    attn = kernels.softmax_forward(scores, scale, True)
    m = masked.max(axis=-1, keepdims=True)
    s = kernels.sum_exp(masked, m)
    _close(s.get(), c_math.exp(masked - m).sum(axis=-1, keepdims=True).get(), dtype, ulps=4)
    _same_bits(attn.get(), (c_math.exp(masked - m) / s).get())  # from the same sums: the array code's bits

    dattn = c_math.asarray(np.random.default_rng(7).standard_normal(attn.shape).astype(dtype))
    r = (dattn * attn).sum(axis=-1, keepdims=True)
    dscores = kernels.softmax_backward(attn, dattn, scale)
    _close(dscores.get(), (attn * (dattn - r) * scale).get(), dtype)
    grad = cuda_kernels.elementwise(c_math, "softmax_grad", (), kernels._softmax_grad_source)
    _same_bits(grad(attn, dattn, r, dtype(scale)).get(), (attn * (dattn - r) * scale).get())


_cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["layer_norm", "layer_norm_plain", "attention_causal", "attention_full"])
def test_fused_norm_and_softmax_match_the_array_code_on_a_gpu(name, dtype):
    saved = settings.fused_kernels
    runs = []
    try:
        for fused in (True, False):
            settings.fused_kernels = fused
            if name.startswith("layer_norm"):
                runs.append(_ln_run(_cupy, dtype, affine=name == "layer_norm"))
            else:
                runs.append(_attention_run(_cupy, dtype, causal=name == "attention_causal"))
    finally:
        settings.fused_kernels = saved
    for a, b in zip(*runs):
        _close(a, b, dtype)  # the row sums may be folded in another order
