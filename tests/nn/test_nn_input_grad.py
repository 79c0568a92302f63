"""backward(grad, input_grad=False): the first layer skips d loss / d input; parameter gradients unchanged."""
import functools
import importlib

import numpy as np
import pytest

from axonhpc import nn

autocast_module = importlib.import_module("axonhpc.nn.autocast")  # the module, not the nn.autocast class


def mlp(dtype=np.float64, bias=True):
    return nn.Sequential(nn.Linear(7, 12, dtype=dtype, seed=0, bias=bias), nn.ReLU(),
                         nn.Linear(12, 9, dtype=dtype, seed=1), nn.Tanh(), nn.Linear(9, 4, dtype=dtype, seed=2))


def grads_after(model, x, input_grad, cast=None):
    for p in model.parameters():
        p.grad = None
    if cast is None:
        out = model(x)
    else:
        with nn.autocast(cast):
            out = model(x)
    g = np.random.default_rng(5).standard_normal(out.shape).astype(out.dtype)
    grad_in = model.backward(g) if input_grad else model.backward(g, input_grad=False)
    return grad_in, [p.grad.copy() for p in model.parameters()]


@pytest.fixture
def counted_input_grads(monkeypatch):
    """How many times a Linear computed d loss / d x (nn.autocast.linear_input_grad)."""
    calls = []
    real = autocast_module.linear_input_grad

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(autocast_module, "linear_input_grad", counting)
    return calls


@pytest.mark.parametrize("cast", [None, "float16"])
@pytest.mark.parametrize("bias", [True, False])
def test_sequential_skips_only_the_first_input_grad_and_fills_identical_grads(counted_input_grads, cast, bias):
    dtype = np.float32 if cast else np.float64
    model = mlp(dtype, bias)
    x = np.random.default_rng(0).standard_normal((6, 7)).astype(dtype)
    full_in, full = grads_after(model, x, True, cast)
    assert full_in.shape == x.shape and full_in.dtype == x.dtype and len(counted_input_grads) == 3
    del counted_input_grads[:]
    skipped_in, skipped = grads_after(model, x, False, cast)
    assert skipped_in is None
    assert len(counted_input_grads) == 2  # the second and third Linear: their inputs come from layers
    for a, b in zip(full, skipped):
        np.testing.assert_array_equal(a, b)


def test_linear_alone_returns_none_and_the_same_grads():
    layer = nn.Linear(5, 3, seed=0)
    x = np.random.default_rng(1).standard_normal((4, 5))
    full_in, full = grads_after(layer, x, True)
    skipped_in, skipped = grads_after(layer, x, False)
    assert skipped_in is None and full_in.shape == (4, 5)
    for a, b in zip(full, skipped):
        np.testing.assert_array_equal(a, b)


class Scale(nn.Module):
    """A layer of a user's own whose backward has no input_grad parameter."""

    def forward(self, x):
        return 2 * x

    def backward(self, grad_out):
        return 2 * grad_out


class Listening(Scale):
    """One whose backward takes input_grad: it must receive the caller's value."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def backward(self, grad_out, input_grad=True):
        self.seen.append(input_grad)
        return 2 * grad_out if input_grad else None


def test_a_first_layer_without_the_parameter_runs_as_before(counted_input_grads):
    model = nn.Sequential(Scale(), nn.Linear(3, 2, seed=0))
    x = np.ones((4, 3))
    model(x)
    grad_in = model.backward(np.ones((4, 2)), input_grad=False)
    np.testing.assert_allclose(grad_in, 2 * np.ones((4, 2)) @ model[1].weight.data)
    assert len(counted_input_grads) == 1  # the Linear is not first: its input gradient is needed


def test_a_first_layer_with_the_parameter_receives_it():
    first = Listening()
    model = nn.Sequential(first, nn.Linear(3, 2, seed=0))
    model(np.ones((4, 3)))
    assert model.backward(np.ones((4, 2)), input_grad=False) is None
    model(np.ones((4, 3)))
    assert model.backward(np.ones((4, 2))).shape == (4, 3)
    assert first.seen == [False, True]


def test_nested_containers_and_checkpoint_pass_it_to_the_innermost_first_layer(counted_input_grads):
    inner = mlp()
    model = nn.Sequential(nn.checkpoint(nn.Sequential(inner, nn.ReLU())), nn.Linear(4, 2, seed=3))
    x = np.random.default_rng(2).standard_normal((5, 7))
    full_in, full = grads_after(model, x, True)
    assert full_in.shape == x.shape
    del counted_input_grads[:]
    skipped_in, skipped = grads_after(model, x, False)
    assert skipped_in is None and len(counted_input_grads) == 3  # of four Linears
    for a, b in zip(full, skipped):
        np.testing.assert_array_equal(a, b)


def test_call_backward_gives_the_flag_only_where_the_signature_has_it():
    seen = []

    def takes(g, input_grad=True):
        seen.append(input_grad)
        return None if not input_grad else g

    def plain(g):
        seen.append("plain")
        return g

    assert nn.call_backward(takes, 1.0, input_grad=False) is None
    assert nn.call_backward(takes, 1.0) == 1.0
    assert nn.call_backward(plain, 1.0, input_grad=False) == 1.0
    assert nn.call_backward(functools.partial(takes), 1.0, input_grad=False) == 1.0  # no signature read: plain
    assert seen == [False, True, "plain", True]
