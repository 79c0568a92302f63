"""nn.autocast: products in float16/bfloat16, float32 master parameters, and backward wherever it runs."""
import threading

import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.errors import ConfigurationError
from axonhpc.nn.autocast import autocast_dtype
from axonhpc.parallel import GradScaler

F16 = np.dtype(np.float16)


def _bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.dtype(ml_dtypes.bfloat16)


def _mlp(dtype=np.float32):
    # Tanh, not ReLU: a pre-activation within float16 rounding of 0 flips a ReLU mask, a legitimate
    # difference of a whole gradient entry that would swamp the comparison with float32.
    return nn.Sequential(nn.Linear(12, 32, dtype=dtype, seed=0), nn.GELU(), nn.LayerNorm(32, dtype=dtype),
                         nn.Linear(32, 16, dtype=dtype, seed=1), nn.Tanh(), nn.Linear(16, 5, dtype=dtype, seed=2))


def _data(n=24, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 12)).astype(dtype), rng.integers(0, 5, n)


def _grads(model, x, y, cast=None, scale=1.0):
    """Loss and gradient copies of one forward (under ``nn.autocast(cast)`` when given) and a backward after it."""
    loss_fn = nn.CrossEntropyLoss()
    model.zero_grad(set_to_none=True)
    if cast is None:
        loss = loss_fn(model(x), y)
    else:
        with nn.autocast(cast):
            loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward(scale))
    return loss, [p.grad.copy() for p in model.parameters()]


def _assert_close_grads(got, want, rtol, atol=1e-5):
    """Each gradient within ``rtol`` of its largest float32 entry; ``atol`` for those that are zero in exact
    arithmetic (a key bias: softmax ignores a constant added to every score), where rounding leaves noise."""
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert np.abs(g - w).max() <= rtol * np.abs(w).max() + atol, (np.abs(g - w).max(), np.abs(w).max())


def test_products_run_in_the_low_dtype_while_the_parameters_stay_float32():
    model = _mlp()
    before = [p.data.copy() for p in model.parameters()]
    x, _ = _data()
    with nn.autocast("float16"):
        assert autocast_dtype() == F16
        out = model(x)
    assert autocast_dtype() is None
    assert out.dtype == F16
    assert model(x).dtype == np.float32  # full precision again after the block
    for p, b in zip(model.parameters(), before):
        assert p.data.dtype == np.float32
        np.testing.assert_array_equal(p.data, b)


def test_linear_casts_at_the_points_pytorch_does():
    """One layer, written out by hand: operands cast, product and bias in float16, gradients back in float32."""
    rng = np.random.default_rng(1)
    layer = nn.Linear(7, 3, seed=4)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    g = rng.standard_normal((5, 3)).astype(np.float32)
    with nn.autocast():
        y = layer(x)
    dx = layer.backward(g)
    x16, w16, g16 = x.astype(F16), layer.weight.data.astype(F16), g.astype(F16)
    want = x16 @ w16.T
    want += layer.bias.data
    np.testing.assert_array_equal(y, want)
    assert dx.dtype == np.float32 and layer.weight.grad.dtype == np.float32 and layer.bias.grad.dtype == np.float32
    np.testing.assert_array_equal(dx, (g16 @ w16).astype(np.float32))
    np.testing.assert_array_equal(layer.weight.grad, (g16.T @ x16).astype(np.float32))
    np.testing.assert_array_equal(layer.bias.grad, g16.sum(axis=0, dtype=np.float32))


@pytest.mark.parametrize("cast", ["float16", "bfloat16"])
def test_mlp_gradients_are_the_float32_ones_to_the_low_precision(cast):
    if cast == "bfloat16":
        _bf16()
    model = _mlp()
    x, y = _data()
    loss32, want = _grads(model, x, y)
    loss16, got = _grads(model, x, y, cast)
    assert abs(loss16 - loss32) < 2e-2 * abs(loss32)
    _assert_close_grads(got, want, 2e-2 if cast == "float16" else 8e-2)


@pytest.mark.parametrize("tie_weights", [True, False])
def test_gpt_gradients_under_autocast(tie_weights):
    """Attention (softmax in float32), LayerNorm, GELU, the tied output weight: close to float32, dtypes kept."""
    model = nn.GPT(vocab_size=13, context=8, width=16, heads=2, layers=2, mlp_ratio=2,
                   tie_weights=tie_weights, seed=2)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 13, (3, 8))
    targets = rng.integers(0, 13, (3, 8))
    loss_fn = nn.CrossEntropyLoss()

    def run(cast):
        model.zero_grad(set_to_none=True)
        with nn.autocast("float16", enabled=cast is not None):
            logits = model(tokens)
            loss = loss_fn(logits, targets)
        model.backward(loss_fn.backward())
        return logits.dtype, loss, [p.grad.copy() for p in model.parameters()]

    dtype32, loss32, want = run(None)
    dtype16, loss16, got = run("float16")
    assert dtype32 == np.float32 and dtype16 == F16
    assert abs(loss16 - loss32) < 1e-2 * abs(loss32)
    _assert_close_grads(got, want, 3e-2)


def test_backward_inside_and_after_the_block_are_the_same():
    model = _mlp()
    x, y = _data()
    _, after = _grads(model, x, y, "float16")
    loss_fn = nn.CrossEntropyLoss()
    model.zero_grad(set_to_none=True)
    with nn.autocast("float16"):
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
    for a, p in zip(after, model.parameters()):
        np.testing.assert_array_equal(a, p.grad)


def test_enabled_false_and_nesting_restore_the_outer_state():
    model = _mlp()
    x, _ = _data()
    with nn.autocast("float16"):
        with nn.autocast(enabled=False):
            assert autocast_dtype() is None
            assert model(x).dtype == np.float32
        assert model(x).dtype == F16
    assert autocast_dtype() is None


def test_float64_parameters_are_not_lowered():
    model = _mlp(np.float64)
    x, y = _data(dtype=np.float64)
    _, want = _grads(model, x, y)
    with nn.autocast("float16"):
        assert model(x).dtype == np.float64
    _, got = _grads(model, x, y, "float16")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_checkpoint_recomputes_under_the_forward_autocast_state():
    block = nn.Sequential(nn.Linear(12, 24, seed=5), nn.GELU(), nn.Linear(24, 12, seed=6))
    wrapped = nn.Sequential(nn.Checkpoint(block), nn.Linear(12, 5, seed=7))
    plain = nn.Sequential(block, wrapped[1])
    x, y = _data()
    _, want = _grads(plain, x, y, "float16")
    _, got = _grads(wrapped, x, y, "float16")  # backward after the block: recomputed in float16 all the same
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # and a forward outside autocast is recomputed in float32 even when backward runs inside one
    _, want32 = _grads(plain, x, y)
    loss_fn = nn.CrossEntropyLoss()
    wrapped.zero_grad(set_to_none=True)
    loss_fn(wrapped(x), y)
    with nn.autocast("float16"):
        wrapped.backward(loss_fn.backward())
    for w, p in zip(want32, wrapped.parameters()):
        np.testing.assert_array_equal(p.grad, w)


def test_the_state_is_per_thread():
    seen = []
    inside = threading.Event()
    done = threading.Event()

    def other():
        inside.wait(10)
        seen.append(autocast_dtype())
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with nn.autocast("float16"):
        inside.set()
        done.wait(10)
    t.join(10)
    assert seen == [None]


@pytest.mark.parametrize("bad", ["float32", "float64", "int8", np.int32, "nonsense"])
def test_only_16_bit_floats(bad):
    with pytest.raises(ConfigurationError, match="float16 or bfloat16"):
        nn.autocast(bad)


def test_float16_training_with_the_scaler_follows_float32_training():
    """Masters in float32, products in float16, the scale passed to the loss: the run tracks the float32 one."""
    x, y = _data(96, seed=5)

    def train(cast):
        model = _mlp()
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = GradScaler(init_scale=2.0 ** 12, growth_interval=3, enabled=cast is not None)
        losses = []
        for step in range(12):
            xb, yb = x[step % 4 * 24:(step % 4 + 1) * 24], y[step % 4 * 24:(step % 4 + 1) * 24]
            opt.zero_grad()
            loss, _ = _grads(model, xb, yb, cast, scale=scaler.scale(1.0))
            assert scaler.step(opt)
            scaler.update()
            losses.append(loss)
        assert all(p.data.dtype == np.float32 for p in model.parameters())
        return losses, model, scaler

    losses32, model32, _ = train(None)
    losses16, model16, scaler = train("float16")
    assert scaler.scale_value == 2.0 ** 16  # grew at steps 3, 6, 9 and 12: no overflow on the way
    assert losses16[-1] < 0.8 * losses16[0]
    np.testing.assert_allclose(losses16, losses32, rtol=2e-2)
    for p, q in zip(model16.parameters(), model32.parameters()):
        assert np.abs(p.data - q.data).max() <= 2e-2 * np.abs(q.data).max()


def test_the_scale_given_to_the_loss_keeps_float16_gradients_from_flushing_to_zero():
    """A loss gradient below float16's range: scaled after the cast it is lost, scaled in the loss it is kept."""
    logits = np.zeros((4096, 2), dtype=F16)  # |p - onehot| / N ~ 6e-6 / 4096 ~ 1.5e-9: below float16's 6e-8
    logits[:, 0] = 12.0
    targets = np.zeros(4096, dtype=np.int64)
    loss_fn = nn.CrossEntropyLoss()
    scaler = GradScaler(init_scale=2.0 ** 16)
    loss_fn(logits, targets)
    late = scaler.scale(loss_fn.backward())
    loss_fn(logits, targets)
    early = loss_fn.backward(scaler.scale(1.0))
    assert not late.any()
    assert early.dtype == F16 and (early[:, 0] < 0).all()
    assert scaler.scale(2.0) == 2.0 ** 17 and GradScaler(enabled=False).scale(2.0) == 2.0


def test_bfloat16_is_widened_for_the_loss_and_erf_as_float16_is():
    """Regression: bfloat16 (ml_dtypes, dtype kind 'V') was not recognised as 16-bit: the loss reduced in
    bfloat16 (1% off on a 5-class problem) and GELU's erf returned float64."""
    bf16 = _bf16()
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((32, 7)).astype(np.float32).astype(bf16)
    targets = rng.integers(0, 7, 32)
    loss_fn = nn.CrossEntropyLoss()
    want = loss_fn(logits.astype(np.float32), targets)
    want_grad = loss_fn.backward()
    assert loss_fn(logits, targets) == want
    grad = loss_fn.backward()
    assert grad.dtype == bf16
    np.testing.assert_array_equal(grad, want_grad.astype(bf16))
    x = rng.standard_normal(50).astype(np.float32).astype(bf16)
    np.testing.assert_array_equal(nn.functional.erf(x), nn.functional.erf(x.astype(np.float32)).astype(bf16))


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_on_16_bit_floats_computes_in_float32_and_rounds_once(low, approximate):
    """Regression: bfloat16 times a Python float is float32 in ml_dtypes, so GELU returned float32 (and
    its gradient too) for bfloat16 input; float16 rounded at every step. Both now follow PyTorch:
    float32 arithmetic, the result rounded to the input's dtype, forward and backward."""
    dtype = F16 if low == "float16" else _bf16()
    rng = np.random.default_rng(7)
    x = (3 * rng.standard_normal(64)).astype(np.float32).astype(dtype)
    g = rng.standard_normal(64).astype(np.float32)
    ours, ref = nn.GELU(approximate), nn.GELU(approximate)
    y, want = ours(x), ref(x.astype(np.float32))
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, want.astype(dtype))
    dx, want_dx = ours.backward(g), ref.backward(g)
    assert dx.dtype == dtype
    np.testing.assert_array_equal(dx, want_dx.astype(dtype))


def test_relu_keeps_bfloat16_on_the_device_where_cupys_where_has_no_bfloat16_loop(monkeypatch):
    # On an H200 a bfloat16 MLP's ReLU came back float32 (cupy's where selects in float32), so each next layer
    # cast it back and the backward carried float32 gradients. The strict stand-in plays that where.
    import sys

    from support.strict_cupy import StrictCupy, device, host

    bf16 = _bf16()
    cupy = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert cupy.where(device(np.ones(2, bf16)) > 0, device(np.ones(2, bf16)), 0).dtype == np.float32
    x = np.array([-2.0, -0.0, 0.0, 1.5, np.inf, -np.inf, np.nan], bf16)
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], bf16)
    relu = nn.ReLU()
    y = relu(device(x))
    assert y.dtype == bf16
    want = np.where(x < 0, 0, x)
    assert host(y).view(np.uint16).tolist() == want.view(np.uint16).tolist()  # -0.0 stays -0.0, NaN passes
    dx = relu.backward(device(g))
    assert dx.dtype == bf16
    assert host(dx).astype(np.float32).tolist() == [0.0, 0.0, 0.0, 4.0, 5.0, 0.0, 7.0]
