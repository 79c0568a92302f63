"""``nn.Linear`` with a zero width (``Linear(3, 0)``, ``Linear(0, 2)``), as PyTorch allows: forward and backward
give what numpy's products give (zero-size outputs and gradients; an empty sum is zero), at any leading shape,
with or without bias, a fused activation or autocast."""
import numpy as np
import pytest

from axonhpc import nn, optim

LEADING = [(4,), (2, 4), (0,), (2, 0, 3), ()]


def _numpy(x, weight, bias, grad_out):
    """y, d x, d weight and d bias of ``x @ weight.T + bias`` written out with numpy."""
    rows_x = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])
    rows_g = grad_out.reshape(int(np.prod(grad_out.shape[:-1])), grad_out.shape[-1])
    y = x @ weight.T + (0 if bias is None else bias)
    return y, grad_out @ weight, rows_g.T @ rows_x, rows_g.sum(axis=0)


@pytest.mark.parametrize("lead", LEADING, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", [(3, 0), (0, 2), (0, 0)], ids=str)
def test_a_zero_width_gives_what_numpy_gives(widths, bias, lead):
    i, o = widths
    lin = nn.Linear(i, o, bias=bias, dtype=np.float64, seed=0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(lead + (i,))
    y = lin(x)
    grad_out = rng.standard_normal(y.shape)
    dx = lin.backward(grad_out)
    want_y, want_dx, want_dw, want_db = _numpy(x, lin.weight.data, None if lin.bias is None else lin.bias.data,
                                               grad_out)
    assert y.shape == lead + (o,) and dx.shape == x.shape and y.dtype == dx.dtype == np.float64
    np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)
    assert lin.weight.grad.shape == (o, i)
    np.testing.assert_allclose(lin.weight.grad, want_dw, rtol=1e-12, atol=1e-12)
    if bias:
        assert lin.bias.grad.shape == (o,)
        np.testing.assert_allclose(lin.bias.grad, want_db, rtol=1e-12, atol=1e-12)
    lin(x)  # a second backward adds into the gradients
    lin.backward(grad_out)
    np.testing.assert_allclose(lin.weight.grad, 2 * want_dw, rtol=1e-12, atol=1e-12)


def test_a_zero_input_width_gives_the_bias_and_a_zero_input_gradient():
    """Linear(0, 2): an empty sum, so y is the bias (0 at init, as PyTorch's bound 0 for fan_in 0), dx (…, 0)."""
    lin = nn.Linear(0, 2, dtype=np.float64, seed=0)
    assert np.array_equal(lin.bias.data, np.zeros(2))
    lin.bias.data[...] = [1.5, -2.0]
    y = lin(np.ones((2, 3, 0)))
    np.testing.assert_array_equal(y, np.broadcast_to([1.5, -2.0], (2, 3, 2)))
    dx = lin.backward(np.ones((2, 3, 2)))
    assert dx.shape == (2, 3, 0)
    assert lin.weight.grad.shape == (2, 0)
    np.testing.assert_array_equal(lin.bias.grad, [6.0, 6.0])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_a_zero_width_layer_inside_a_model_trains(activation):
    """A zero-width hidden layer: the model's output is the last bias, its input gradient zeros; the optimizer and
    clipping step the zero-size parameters as any other."""
    model = nn.Sequential(nn.Linear(3, 0, dtype=np.float64, seed=0, activation=activation),
                          nn.Linear(0, 2, dtype=np.float64, seed=1), nn.Tanh())
    loss_fn = nn.MSELoss()
    x, target = np.ones((5, 3)), np.ones((5, 2))
    opt = optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(model(x), target)
        dx = model.backward(loss_fn.backward())
        np.testing.assert_array_equal(dx, np.zeros((5, 3)))
        assert [p.grad.shape for p in model.parameters()] == [(0, 3), (0,), (2, 0), (2,)]
        optim.clip_grad_norm(model.parameters(), 1.0)
        opt.step()
    assert np.all(model[1].bias.data > 0)  # moved toward tanh(b) = 1


@pytest.mark.parametrize("widths", [(3, 0), (0, 2)], ids=str)
def test_a_zero_width_under_autocast(widths):
    i, o = widths
    lin = nn.Linear(i, o, seed=0)
    x = np.ones((2, 4, i), dtype=np.float32)
    with nn.autocast("float16"):
        y = lin(x)
        dx = lin.backward(np.ones_like(y))
    assert (y.shape, y.dtype) == ((2, 4, o), np.float16)
    assert (dx.shape, dx.dtype) == ((2, 4, i), np.float32)
    assert (lin.weight.grad.shape, lin.weight.grad.dtype) == ((o, i), np.float32)
    np.testing.assert_array_equal(lin.bias.grad, np.full(o, 8.0))


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("widths", [(3, 0), (0, 2), (0, 0)], ids=str)
def test_a_zero_width_on_device_arrays_matches_the_host(widths, activation, strict_cupy):
    """The device path (the GEMM, the fused bias-activation kernel) on the strict cupy stand-in: the host's
    numbers and shapes."""
    i, o = widths
    x, g = np.ones((5, 7, i), np.float32), np.ones((5, 7, o), np.float32)
    results = []
    for device in (False, True):
        lin = nn.Linear(i, o, dtype=np.float32, seed=0, activation=activation)
        if device:
            lin.to("cuda")
        xp = strict_cupy if device else np
        y = lin(xp.asarray(x))
        dx = lin.backward(xp.asarray(g))
        out = [y, dx, lin.weight.grad, lin.bias.grad]
        results.append([a if isinstance(a, np.ndarray) else a.get() for a in out])
    for host, device in zip(*results):
        assert host.shape == device.shape
        np.testing.assert_array_equal(host, device)
