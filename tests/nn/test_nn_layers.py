"""Layer behaviour beyond gradients: initialisation, values, modes, dtypes, errors."""
import math
import re

import numpy as np
import pytest

from axonhpc import nn
from axonhpc.errors import AxonError, ConfigurationError, ShapeError, UnsupportedDtypeError
from axonhpc.nn import kernels
from axonhpc.settings import settings
from axonhpc.nn.functional import erf, log_softmax, softmax


# ---------------------------------------------------------------- Linear

def test_linear_seeded_init_matches_pytorch_distribution():
    a, b = nn.Linear(400, 300, seed=3), nn.Linear(400, 300, seed=3)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    np.testing.assert_array_equal(a.bias.data, b.bias.data)
    assert not np.array_equal(a.weight.data, nn.Linear(400, 300, seed=4).weight.data)
    bound = 1 / math.sqrt(400)
    w = a.weight.data
    assert a.weight.shape == (300, 400) and w.dtype == np.float32
    assert np.abs(w).max() <= bound and np.abs(a.bias.data).max() <= bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.01 * bound  # U(-b, b) has std b / sqrt(3)
    assert abs(w.mean()) < 0.01 * bound
    # Weight and bias come from one generator, weight first.
    rng = np.random.default_rng(3)
    np.testing.assert_array_equal(w, rng.uniform(-bound, bound, (300, 400)).astype(np.float32))
    np.testing.assert_array_equal(a.bias.data, rng.uniform(-bound, bound, 300).astype(np.float32))


def test_linear_computes_x_wt_plus_b_on_leading_axes():
    layer = nn.Linear(3, 2, dtype=np.float64, seed=0)
    x = np.random.default_rng(0).standard_normal((4, 5, 3))
    np.testing.assert_allclose(layer(x), x @ layer.weight.data.T + layer.bias.data)
    assert nn.Linear(3, 2, bias=False).bias is None
    with pytest.raises(ShapeError, match=r"\(4, 2\).*3"):
        layer(np.ones((4, 2)))


def test_float32_model_stays_float32():
    model = nn.Sequential(nn.Linear(6, 8, seed=0), nn.GELU(), nn.LayerNorm(8), nn.Dropout(0.1),
                          nn.MultiHeadAttention(8, 2, causal=True, seed=1), nn.Tanh(), nn.Linear(8, 3, seed=2))
    x = np.random.default_rng(0).standard_normal((2, 5, 6)).astype(np.float32)
    y = model(x)
    assert y.dtype == np.float32
    dx = model.backward(np.ones_like(y))
    assert dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in model.parameters())
    ref = nn.Sequential(nn.Linear(6, 8, seed=0, dtype=np.float64), nn.GELU(), nn.LayerNorm(8, dtype=np.float64),
                        nn.Dropout(0.1), nn.MultiHeadAttention(8, 2, causal=True, seed=1, dtype=np.float64),
                        nn.Tanh(), nn.Linear(8, 3, seed=2, dtype=np.float64))
    np.testing.assert_allclose(y, ref(x.astype(np.float64)), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- activations and erf

def test_erf_matches_math_erf():
    x = np.concatenate([np.linspace(-8, 8, 20001), np.logspace(-12, 1.5, 500), [0.0, 27.0, 1e10, np.inf, -np.inf]])
    ref = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf(x), ref, rtol=2e-15, atol=1e-300)
    x32 = x.astype(np.float32)
    out32 = erf(x32)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, [math.erf(float(v)) for v in x32], rtol=5e-7, atol=1e-30)
    assert np.isnan(erf(np.array([np.nan]))[0])
    np.testing.assert_allclose(erf(np.array([1])), [math.erf(1)], rtol=1e-15)


def test_gelu_exact_and_tanh_forms():
    x = np.linspace(-6, 6, 241)
    exact = x * 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    np.testing.assert_allclose(nn.GELU()(x), exact, rtol=1e-14, atol=1e-15)
    tanh_form = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(nn.GELU(approximate="tanh")(x), tanh_form, rtol=1e-14, atol=1e-15)
    assert np.abs(tanh_form - exact).max() < 5e-4  # the documented accuracy of the approximation
    with pytest.raises(ConfigurationError):
        nn.GELU(approximate="sigmoid")


def test_relu_and_tanh_values():
    x = np.array([-2.0, 0.0, 3.0])
    np.testing.assert_array_equal(nn.ReLU()(x), [0.0, 0.0, 3.0])
    np.testing.assert_allclose(nn.Tanh()(x), np.tanh(x))


# PyTorch's relu and its backward on these (torch.relu, y.backward(RELU_G)): -inf and -1 give +0.0, not NaN
# and -0.0 as x * (x > 0) gives; -0.0 and NaN pass; the gradient is +0.0 wherever x <= 0, an inf or NaN there too.
RELU_X = [-np.inf, -1.0, -0.0, 0.0, np.nan, 2.0, np.inf]
RELU_Y = [0.0, 0.0, -0.0, 0.0, np.nan, 2.0, np.inf]
RELU_G = [-1.0, np.inf, np.nan, -2.0, 3.0, -1.0, 5.0]
RELU_DX = [0.0, 0.0, 0.0, 0.0, 3.0, -1.0, 5.0]


def _assert_same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b)), (a, b)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_relu_gives_plus_zero_for_negative_infinity_as_pytorch(dtype, fused, monkeypatch):
    monkeypatch.setattr(settings, "fused_kernels", fused)
    layer = nn.ReLU()
    _assert_same_bits(layer(np.array(RELU_X, dtype=dtype)), np.array(RELU_Y, dtype=dtype))
    _assert_same_bits(layer.backward(np.array(RELU_G, dtype=dtype)), np.array(RELU_DX, dtype=dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_host_kernel_with_a_bias_gives_plus_zero_for_negative_infinity(dtype):
    pre = np.array([RELU_X, RELU_X], dtype=dtype)
    y, mask = kernels.bias_relu(pre, np.zeros(len(RELU_X), dtype=dtype))
    _assert_same_bits(y, np.array([RELU_Y, RELU_Y], dtype=dtype) + 0.0)  # -0.0 + 0.0 is +0.0
    np.testing.assert_array_equal(mask[0], [False, False, False, False, True, True, True])


def test_softmax_helpers_are_stable():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1000.0]])
    s = softmax(x)
    np.testing.assert_allclose(s.sum(axis=-1), 1.0)
    np.testing.assert_allclose(s[1], 1 / 3)
    np.testing.assert_allclose(np.exp(log_softmax(x)), s)


# ---------------------------------------------------------------- Dropout

def test_dropout_reproducible_and_rescaled():
    x = np.ones((200, 50))
    a, b = nn.Dropout(0.3, seed=11), nn.Dropout(0.3, seed=11)
    ya1, ya2 = a(x), a(x)
    np.testing.assert_array_equal(ya1, b(x))
    np.testing.assert_array_equal(ya2, b(x))
    assert not np.array_equal(ya1, ya2)  # a new mask every forward
    assert not np.array_equal(ya1, nn.Dropout(0.3, seed=12)(x))
    assert set(np.unique(ya1)) <= {0.0, 1 / 0.7}
    assert abs((ya1 == 0).mean() - 0.3) < 0.02
    a.manual_seed(11)
    np.testing.assert_array_equal(a(x), ya1)
    assert nn.Dropout(0.5)(x).dtype == x.dtype


def test_dropout_default_seed_is_reproducible():
    x = np.ones((10, 10), dtype=np.float32)
    np.testing.assert_array_equal(nn.Dropout(0.5)(x), nn.Dropout(0.5)(x))


def test_dropout_identity_in_eval_and_edge_probabilities():
    x = np.random.default_rng(0).standard_normal((5, 5))
    layer = nn.Dropout(0.9, seed=0).eval()
    assert layer(x) is x
    np.testing.assert_array_equal(layer.backward(np.ones_like(x)), 1.0)
    np.testing.assert_array_equal(nn.Dropout(0.0)(x), x)
    full = nn.Dropout(1.0)
    np.testing.assert_array_equal(full(x), 0.0)
    np.testing.assert_array_equal(full.backward(np.ones_like(x)), 0.0)
    for p in (-0.1, 1.5):
        with pytest.raises(ConfigurationError, match=str(p)):
            nn.Dropout(p)


def test_dropout_keyed_by_sample_ignores_how_the_rows_are_split():
    x = np.ones((12, 4, 6))
    whole, split = nn.Dropout(0.4, seed=5), nn.Dropout(0.4, seed=5)
    whole.key_by_sample(7)
    split.key_by_sample(7, first_row=0)
    parts = [split(x[:5]), split(x[5:9]), split(x[9:])]  # micro-batches, in order
    np.testing.assert_array_equal(whole(x), np.concatenate(parts))
    other = nn.Dropout(0.4, seed=5)
    other.key_by_sample(7, first_row=9)  # another rank holding rows 9..11
    np.testing.assert_array_equal(other(x[9:]), parts[2])
    whole.key_by_sample(8)
    assert not np.array_equal(whole(x), np.concatenate(parts))  # another step, other masks
    assert abs((parts[0] == 0).mean() - 0.4) < 0.1
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigurationError, match="non-negative int"):
            whole.key_by_sample(bad)
    whole.manual_seed(5)  # back to the plain sequence of masks
    np.testing.assert_array_equal(whole(x), nn.Dropout(0.4, seed=5)(x))


def test_activation_checkpointing_replays_keyed_dropout_masks():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((6, 8)), rng.standard_normal((6, 8))

    def run(wrap):
        block = nn.Sequential(nn.Linear(8, 8, dtype=np.float64, seed=1), nn.Dropout(0.5, seed=2))
        model = nn.checkpoint(block) if wrap else block
        nn.key_dropout_by_sample(model, 3, 10)
        out = model(x)
        return out, model.backward(g)

    (y0, g0), (y1, g1) = run(False), run(True)
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(g0, g1)


# ---------------------------------------------------------------- LayerNorm, Embedding

def test_layernorm_normalises_trailing_axes():
    x = np.random.default_rng(0).standard_normal((3, 4, 5)) * 7 + 2
    y = nn.LayerNorm((4, 5), dtype=np.float64)(x)
    np.testing.assert_allclose(y.mean(axis=(1, 2)), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(1, 2)), 1, rtol=1e-5)
    with pytest.raises(ShapeError, match=r"\(4, 5\)"):
        nn.LayerNorm((4, 5))(np.ones((5, 4)))
    with pytest.raises(ShapeError):
        nn.LayerNorm((4, 5))(np.ones(5))


@pytest.mark.parametrize("eps", [float("nan"), -1e-5, "small", None])
def test_layernorm_refuses_an_eps_that_is_not_a_number_at_least_zero(eps):
    # NaN passed ``eps < 0`` and made every output NaN
    with pytest.raises(ConfigurationError, match=re.escape(f"LayerNorm eps must be a number >= 0, got {eps!r}")):
        nn.LayerNorm(3, eps=eps)


def test_embedding_lookup_and_errors():
    emb = nn.Embedding(10, 3, seed=0)
    idx = np.array([[1, 9], [0, 1]])
    out = emb(idx)
    assert out.shape == (2, 2, 3)
    np.testing.assert_array_equal(out[0, 0], emb.weight.data[1])
    np.testing.assert_array_equal(emb.weight.data, nn.Embedding(10, 3, seed=0).weight.data)
    with pytest.raises(ShapeError, match=r"\[0, 10\)"):
        emb(np.array([10]))
    with pytest.raises(ShapeError):
        emb(np.array([-1]))
    with pytest.raises(TypeError, match="integers"):
        emb(np.array([0.5]))


# ---------------------------------------------------------------- MultiHeadAttention

def test_causal_attention_ignores_the_future():
    rng = np.random.default_rng(0)
    layer = nn.MultiHeadAttention(8, 4, causal=True, dtype=np.float64, seed=0)
    x = rng.standard_normal((2, 6, 8))
    y = layer(x)
    x2 = x.copy()
    x2[:, 4:] = rng.standard_normal((2, 2, 8))
    y2 = layer(x2)
    np.testing.assert_allclose(y2[:, :4], y[:, :4], rtol=1e-13)
    assert not np.allclose(y2[:, 4:], y[:, 4:])
    # Without the mask the first positions do see the change.
    full = nn.MultiHeadAttention(8, 4, causal=False, dtype=np.float64, seed=0)
    assert not np.allclose(full(x2)[:, :4], full(x)[:, :4])


def test_attention_matches_a_direct_formula():
    rng = np.random.default_rng(1)
    e, h = 6, 3
    layer = nn.MultiHeadAttention(e, h, dtype=np.float64, seed=2)
    for p in layer.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.4
    x = rng.standard_normal((2, 4, e))
    q, k, v = (x @ m.weight.data.T + m.bias.data for m in (layer.q_proj, layer.k_proj, layer.v_proj))
    heads = []
    for i in range(h):
        s = slice(i * 2, (i + 1) * 2)
        scores = q[..., s] @ np.swapaxes(k[..., s], 1, 2) / math.sqrt(2)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        heads.append(w @ v[..., s])
    expected = np.concatenate(heads, -1) @ layer.out_proj.weight.data.T + layer.out_proj.bias.data
    np.testing.assert_allclose(layer(x), expected, rtol=1e-12)


def test_attention_init_and_errors():
    layer = nn.MultiHeadAttention(16, 4, seed=0)
    bound = math.sqrt(6 / (16 + 48))
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
        assert np.abs(proj.weight.data).max() <= bound
        np.testing.assert_array_equal(proj.bias.data, 0)
    np.testing.assert_array_equal(layer.out_proj.bias.data, 0)
    assert not np.array_equal(layer.q_proj.weight.data, layer.k_proj.weight.data)
    np.testing.assert_array_equal(layer.q_proj.weight.data, nn.MultiHeadAttention(16, 4, seed=0).q_proj.weight.data)
    with pytest.raises(ConfigurationError, match="embed_dim=10, num_heads=4"):
        nn.MultiHeadAttention(10, 4)
    with pytest.raises(ShapeError, match=r"\(3, 16\)"):
        layer(np.ones((3, 16)))


# ---------------------------------------------------------------- losses

def test_cross_entropy_value_and_gradient():
    logits = np.array([[2.0, 1.0, 0.1], [0.5, 2.5, 0.3]])
    targets = np.array([0, 2])
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(logits, targets)
    assert isinstance(loss, float)
    expected = np.mean([-math.log(math.exp(r[t]) / sum(math.exp(v) for v in r)) for r, t in zip(logits, targets)])
    assert loss == pytest.approx(expected, rel=1e-14)
    grad = loss_fn.backward()
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    p[[0, 1], targets] -= 1
    np.testing.assert_allclose(grad, p / 2, rtol=1e-14)
    loss_fn(logits, targets)
    np.testing.assert_allclose(loss_fn.backward(0.25), p / 8, rtol=1e-14)


def test_cross_entropy_is_stable_for_large_logits():
    loss_fn = nn.CrossEntropyLoss()
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss = loss_fn(np.array([[1e4, 0.0], [0.0, 1e4]], dtype=np.float32), np.array([0, 0]))
    assert loss == pytest.approx(5e3)
    assert np.all(np.isfinite(loss_fn.backward()))


def test_cross_entropy_errors():
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ShapeError, match=r"\(2, 3\).*\(3,\)"):
        loss_fn(np.zeros((2, 3)), np.array([0, 1, 2]))
    with pytest.raises(ShapeError, match=r"\[0, 3\).*\[0, 3\]"):
        loss_fn(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ShapeError, match=r"\[0, 3\).*\[-1, 1\]"):
        loss_fn(np.zeros((2, 3)), np.array([-1, 1]))
    with pytest.raises(TypeError):
        loss_fn(np.zeros((2, 3)), np.array([0.0, 1.0]))
    assert issubclass(ShapeError, AxonError)


@pytest.mark.parametrize("make", [nn.CrossEntropyLoss, nn.MSELoss])
def test_loss_backward_takes_a_one_element_host_array_and_refuses_others(make):
    logits, targets = np.array([[2.0, 1.0, 0.1], [0.5, 2.5, 0.3], [0.0, 0.2, 0.1]]), np.array([0, 2, 1])
    other = np.zeros((3, 3)) if make is nn.MSELoss else targets
    loss_fn = make()
    loss_fn(logits, other)
    expected = loss_fn.backward(0.5)
    for one in (np.array([0.5]), np.array([[0.5]]), np.array(0.5)):
        loss_fn(logits, other)
        got = loss_fn.backward(one)
        assert got.shape == logits.shape  # a (1, 1) array does not add an axis
        np.testing.assert_array_equal(got, expected)
    loss_fn(logits, other)
    for bad in (np.array([1.0, 0.0, 0.0]), np.ones(5), np.ones((3, 1)), np.zeros(0)):
        # per-sample weights of the batch's length would have scaled the class axis instead
        with pytest.raises(ShapeError, match=r"a number or a one-element host array, got shape " + re.escape(
                str(bad.shape))):
            loss_fn.backward(bad)
    np.testing.assert_array_equal(loss_fn.backward(0.5), expected)  # a refused call leaves the forward's cache


def test_cross_entropy_refuses_integer_logits():
    with pytest.raises(UnsupportedDtypeError, match="logits must be floating point, got dtype int64"):
        nn.CrossEntropyLoss()(np.zeros((2, 3), np.int64), np.array([0, 1]))


def test_mse_value_gradient_and_errors():
    pred, target = np.array([[1.0, 2.0], [3.0, 5.0]]), np.array([[0.0, 2.0], [1.0, 1.0]])
    loss_fn = nn.MSELoss()
    assert loss_fn(pred, target) == pytest.approx((1 + 0 + 4 + 16) / 4)
    np.testing.assert_allclose(loss_fn.backward(), 2 * (pred - target) / 4)
    with pytest.raises(ShapeError, match=r"\(2, 2\).*\(2,\)"):
        loss_fn(pred, np.zeros(2))


def test_training_a_float32_mlp_lowers_the_loss():
    from axonhpc import optim

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    model = nn.Sequential(nn.Linear(5, 16, seed=0), nn.ReLU(), nn.Linear(16, 2, seed=1))
    loss_fn = nn.CrossEntropyLoss()
    opt = optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = loss_fn(model(x), y)
        first = loss if first is None else first
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    assert loss < 0.5 * first
    assert all(p.data.dtype == np.float32 for p in model.parameters())
