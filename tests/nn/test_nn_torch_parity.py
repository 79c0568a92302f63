"""Layers and losses against PyTorch with the same weights (skipped without torch)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from axonhpc import nn  # noqa: E402

RTOL, ATOL = 1e-10, 1e-12


def t(a, grad=True):
    return torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=grad)


def compare(ours, theirs, x, param_pairs, rng, integer_input=False):
    """Same forward, same input gradient, same parameter gradients."""
    y = ours(x)
    g = rng.standard_normal(y.shape)
    dx = ours.backward(g)
    tx = torch.tensor(x) if integer_input else t(x)
    ty = theirs(tx)
    ty.backward(torch.tensor(g))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=RTOL, atol=ATOL)
    if not integer_input:
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=RTOL, atol=ATOL)
    for ours_p, torch_p in param_pairs:
        np.testing.assert_allclose(ours_p.grad, torch_p.grad.numpy(), rtol=RTOL, atol=ATOL)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_linear(rng):
    ours = nn.Linear(5, 4, dtype=np.float64, seed=0)
    theirs = torch.nn.Linear(5, 4, dtype=torch.float64)
    theirs.load_state_dict({k: torch.tensor(v) for k, v in ours.state_dict().items()})  # same layout
    compare(ours, theirs, rng.standard_normal((2, 3, 5)), [(ours.weight, theirs.weight), (ours.bias, theirs.bias)],
            rng)


@pytest.mark.parametrize("ours,theirs", [
    (nn.ReLU(), torch.nn.ReLU()), (nn.Tanh(), torch.nn.Tanh()), (nn.GELU(), torch.nn.GELU()),
    (nn.GELU(approximate="tanh"), torch.nn.GELU(approximate="tanh")),
])
def test_activations(rng, ours, theirs):
    compare(ours, theirs, rng.standard_normal((4, 7)) * 3, [], rng)


def test_layernorm(rng):
    ours = nn.LayerNorm((3, 4), dtype=np.float64)
    for p in ours.parameters():
        p.data[...] = rng.standard_normal(p.shape)
    theirs = torch.nn.LayerNorm((3, 4), dtype=torch.float64)
    theirs.load_state_dict({k: torch.tensor(v) for k, v in ours.state_dict().items()})
    compare(ours, theirs, rng.standard_normal((2, 3, 4)) * 5 + 1,
            [(ours.weight, theirs.weight), (ours.bias, theirs.bias)], rng)


def test_embedding(rng):
    ours = nn.Embedding(7, 3, dtype=np.float64, seed=0)
    theirs = torch.nn.Embedding(7, 3, dtype=torch.float64)
    theirs.load_state_dict({k: torch.tensor(v) for k, v in ours.state_dict().items()})
    compare(ours, theirs, np.array([[1, 2, 1], [6, 0, 1]]), [(ours.weight, theirs.weight)], rng, integer_input=True)


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention(rng, causal):
    e, h, n = 8, 2, 5
    ours = nn.MultiHeadAttention(e, h, causal=causal, dtype=np.float64, seed=1)
    for p in ours.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.3
    theirs = torch.nn.MultiheadAttention(e, h, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.tensor(np.concatenate(
            [ours.q_proj.weight.data, ours.k_proj.weight.data, ours.v_proj.weight.data])))
        theirs.in_proj_bias.copy_(torch.tensor(np.concatenate(
            [ours.q_proj.bias.data, ours.k_proj.bias.data, ours.v_proj.bias.data])))
        theirs.out_proj.weight.copy_(torch.tensor(ours.out_proj.weight.data))
        theirs.out_proj.bias.copy_(torch.tensor(ours.out_proj.bias.data))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64) if causal else None

    def torch_self_attention(x):
        return theirs(x, x, x, attn_mask=mask, need_weights=False)[0]

    x = rng.standard_normal((3, n, e))
    y = ours(x)
    g = rng.standard_normal(y.shape)
    dx = ours.backward(g)
    tx = t(x)
    ty = torch_self_attention(tx)
    ty.backward(torch.tensor(g))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    w_grad = np.concatenate([ours.q_proj.weight.grad, ours.k_proj.weight.grad, ours.v_proj.weight.grad])
    b_grad = np.concatenate([ours.q_proj.bias.grad, ours.k_proj.bias.grad, ours.v_proj.bias.grad])
    np.testing.assert_allclose(w_grad, theirs.in_proj_weight.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(b_grad, theirs.in_proj_bias.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(ours.out_proj.weight.grad, theirs.out_proj.weight.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_cross_entropy(rng):
    logits, targets = rng.standard_normal((6, 5)) * 4, rng.integers(0, 5, 6)
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(logits, targets)
    tl = t(logits)
    tloss = torch.nn.functional.cross_entropy(tl, torch.tensor(targets))
    tloss.backward()
    assert loss == pytest.approx(tloss.item(), rel=1e-13)
    np.testing.assert_allclose(loss_fn.backward(), tl.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_mse(rng):
    pred, target = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    loss_fn = nn.MSELoss()
    loss = loss_fn(pred, target)
    tp = t(pred)
    tloss = torch.nn.functional.mse_loss(tp, torch.tensor(target))
    tloss.backward()
    assert loss == pytest.approx(tloss.item(), rel=1e-13)
    np.testing.assert_allclose(loss_fn.backward(), tp.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_linear_init_bounds_match_torch_defaults():
    ours = nn.Linear(50, 20, seed=0)
    theirs = torch.nn.Linear(50, 20)
    # Different generators, same distribution: U(-1/sqrt(50), 1/sqrt(50)) for both.
    bound = 1 / np.sqrt(50)
    assert np.abs(ours.weight.data).max() <= bound and theirs.weight.abs().max().item() <= bound
    assert np.abs(ours.bias.data).max() <= bound and theirs.bias.abs().max().item() <= bound
