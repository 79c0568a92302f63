"""Every layer's backward against central finite differences, in float64.

For a module f and a fixed random cotangent G, backward(G) must equal the
numerical gradient of sum(f(x) * G) with respect to the input and to every
parameter.
"""
import numpy as np
import pytest

from axonhpc import nn

EPS = 1e-6
RTOL = 1e-6
ATOL = 1e-8


def numeric_grad(f, arr):
    """Central differences of the scalar f() with respect to each entry of arr (changed in place)."""
    grad = np.zeros(arr.shape, dtype=np.float64)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + EPS
        plus = f()
        arr[idx] = old - EPS
        minus = f()
        arr[idx] = old
        grad[idx] = (plus - minus) / (2 * EPS)
    return grad


def randomize_parameters(module, rng, scale=0.5):
    for p in module.parameters():
        p.data[...] = rng.standard_normal(p.shape) * scale


def gradcheck(module, x, rng, *, check_input=True, before_forward=lambda: None):
    """Compare module.backward with finite differences for x and every parameter."""
    before_forward()
    y = module(x)
    cotangent = rng.standard_normal(y.shape)
    module.zero_grad(set_to_none=True)
    dx = module.backward(cotangent)

    def f():
        before_forward()
        return float(np.sum(module(x) * cotangent))

    if check_input:
        np.testing.assert_allclose(dx, numeric_grad(f, x), rtol=RTOL, atol=ATOL, err_msg="input gradient")
    params = module.named_parameters()
    assert params or not list(module.parameters())
    for name, p in params:
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.dtype == np.float64
        np.testing.assert_allclose(p.grad, numeric_grad(f, p.data), rtol=RTOL, atol=ATOL,
                                   err_msg=f"gradient of {name}")
    return dx


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (4,)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(rng, shape, bias):
    layer = nn.Linear(4, 3, bias=bias, dtype=np.float64, seed=0)
    gradcheck(layer, rng.standard_normal(shape), rng)


def test_relu(rng):
    x = rng.standard_normal((4, 5))
    x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from the kink
    gradcheck(nn.ReLU(), x, rng)


def test_tanh(rng):
    gradcheck(nn.Tanh(), rng.standard_normal((3, 6)) * 2, rng)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(rng, approximate):
    x = np.concatenate([rng.standard_normal(20) * 3, [-6.0, -0.3, 0.0, 0.47, 4.2, 7.0]]).reshape(2, 13)
    gradcheck(nn.GELU(approximate=approximate), x, rng)


def test_dropout_training(rng):
    layer = nn.Dropout(0.4, seed=7)
    # Same mask for every forward of the check: restart the generator each time.
    gradcheck(layer, rng.standard_normal((4, 6)), rng, before_forward=lambda: layer.manual_seed(7))


def test_dropout_eval(rng):
    layer = nn.Dropout(0.4, seed=7).eval()
    gradcheck(layer, rng.standard_normal((4, 6)), rng)


@pytest.mark.parametrize("normalized_shape,x_shape", [(5, (3, 5)), ((2, 3), (4, 2, 3)), (6, (2, 2, 6))])
def test_layernorm(rng, normalized_shape, x_shape):
    layer = nn.LayerNorm(normalized_shape, dtype=np.float64)
    randomize_parameters(layer, rng)
    gradcheck(layer, rng.standard_normal(x_shape), rng)


def test_layernorm_without_affine(rng):
    gradcheck(nn.LayerNorm(4, elementwise_affine=False, dtype=np.float64), rng.standard_normal((3, 4)), rng)


def test_embedding_parameter_gradient_sums_repeated_rows(rng):
    layer = nn.Embedding(6, 3, dtype=np.float64, seed=0)
    indices = np.array([[0, 2, 2], [5, 2, 0]])
    assert gradcheck(layer, indices, rng, check_input=False) is None
    # Row 1, 3 and 4 never appear: zero gradient.
    assert np.all(layer.weight.grad[[1, 3, 4]] == 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_multi_head_attention(rng, causal, bias):
    layer = nn.MultiHeadAttention(6, 2, bias=bias, causal=causal, dtype=np.float64, seed=3)
    randomize_parameters(layer, rng)
    gradcheck(layer, rng.standard_normal((2, 4, 6)), rng)


def test_multi_head_attention_single_head(rng):
    layer = nn.MultiHeadAttention(4, 1, causal=True, dtype=np.float64, seed=3)
    randomize_parameters(layer, rng)
    gradcheck(layer, rng.standard_normal((1, 3, 4)), rng)


def test_sequential_mlp(rng):
    model = nn.Sequential(
        nn.Linear(4, 6, dtype=np.float64, seed=0), nn.GELU(), nn.LayerNorm(6, dtype=np.float64),
        nn.Linear(6, 5, dtype=np.float64, seed=1), nn.Tanh(), nn.Linear(5, 3, dtype=np.float64, seed=2),
    )
    randomize_parameters(model, rng)
    gradcheck(model, rng.standard_normal((3, 4)), rng)


class _Residual(nn.Module):
    """x + f(x): checks that backward through a custom composite module adds both paths."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)

    def backward(self, grad_out):
        return grad_out + self.inner.backward(grad_out)


def test_transformer_block_stack(rng):
    e = 8
    model = nn.Sequential(
        _Residual(nn.Sequential(nn.LayerNorm(e, dtype=np.float64),
                                nn.MultiHeadAttention(e, 2, causal=True, dtype=np.float64, seed=1))),
        _Residual(nn.Sequential(nn.LayerNorm(e, dtype=np.float64), nn.Linear(e, 12, dtype=np.float64, seed=2),
                                nn.GELU(), nn.Linear(12, e, dtype=np.float64, seed=3))),
        nn.LayerNorm(e, dtype=np.float64),
    )
    randomize_parameters(model, rng, scale=0.3)
    gradcheck(model, rng.standard_normal((2, 3, e)), rng)


def test_embedding_into_attention_stack(rng):
    model = nn.Sequential(nn.Embedding(7, 4, dtype=np.float64, seed=0),
                          nn.MultiHeadAttention(4, 2, dtype=np.float64, seed=1),
                          nn.Linear(4, 7, dtype=np.float64, seed=2))
    randomize_parameters(model, rng)
    gradcheck(model, np.array([[1, 6, 3], [0, 0, 5]]), rng, check_input=False)


def test_cross_entropy_gradient(rng):
    logits = rng.standard_normal((5, 4)) * 3
    targets = np.array([0, 3, 1, 1, 2])
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(logits, targets)
    grad = loss_fn.backward()
    np.testing.assert_allclose(grad, numeric_grad(lambda: loss_fn(logits, targets), logits), rtol=RTOL, atol=ATOL)


def test_mse_gradient(rng):
    pred, target = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    loss_fn = nn.MSELoss()
    loss_fn(pred, target)
    grad = loss_fn.backward()
    np.testing.assert_allclose(grad, numeric_grad(lambda: loss_fn(pred, target), pred), rtol=RTOL, atol=ATOL)


def test_full_model_through_loss(rng):
    model = nn.Sequential(nn.Linear(3, 5, dtype=np.float64, seed=0), nn.ReLU(),
                          nn.Linear(5, 4, dtype=np.float64, seed=1))
    x, y = rng.standard_normal((6, 3)), np.array([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x), y)
    model.zero_grad(set_to_none=True)
    model.backward(loss_fn.backward())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, numeric_grad(lambda: loss_fn(model(x), y), p.data),
                                   rtol=RTOL, atol=ATOL, err_msg=name)
