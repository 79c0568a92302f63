"""Module mechanics: registration, state dicts, modes, gradients, hooks, cached activations."""
import numpy as np
import pytest

from axonhpc import nn
from axonhpc.errors import AxonError, BackwardBeforeForwardError, ShapeError, StateDictError


def mlp(seed=0, dtype=np.float64):
    return nn.Sequential(nn.Linear(4, 5, dtype=dtype, seed=seed), nn.ReLU(),
                         nn.Linear(5, 3, dtype=dtype, seed=seed + 1))


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, dtype=np.float64, seed=0)
        self.register_buffer("running", np.zeros(2))
        self.register_buffer("scratch", np.ones(3), persistent=False)
        self.scale = nn.Parameter(np.ones(1))

    def forward(self, x):
        return self.lin(x) * self.scale.data


# ---------------------------------------------------------------- registration and names

def test_named_parameters_dotted_in_registration_order():
    model = nn.Sequential(nn.Linear(2, 3, seed=0), nn.Tanh(), nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 1, seed=1)))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.0.weight", "2.0.bias", "2.1.weight", "2.1.bias"]
    assert [id(p) for p in model.parameters()] == [id(p) for _, p in model.named_parameters()]
    assert model[0].weight.shape == (3, 2) and model[0].bias.shape == (3,)


def test_parameters_returns_reusable_list_and_shared_parameter_once():
    a = nn.Linear(3, 3, seed=0)
    model = nn.Sequential(a, nn.ReLU(), a)
    params = model.parameters()
    assert isinstance(params, list) and len(params) == 2
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias"]
    assert list(model.state_dict()) == ["0.weight", "0.bias"]


def test_mha_parameter_names():
    names = [n for n, _ in nn.MultiHeadAttention(4, 2, seed=0).named_parameters()]
    assert names == [f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")]


def test_buffers_and_state_dict_contents():
    m = WithBuffers()
    assert [n for n, _ in m.named_buffers()] == ["running", "scratch"]
    assert list(m.state_dict()) == ["scale", "running", "lin.weight", "lin.bias"]
    m.running = np.full(2, 7.0)  # assignment to a buffer name replaces the buffer
    assert m.state_dict()["running"].tolist() == [7.0, 7.0]
    with pytest.raises(KeyError, match="lin"):
        m.register_buffer("lin", np.zeros(1))


def test_assigning_array_to_parameter_name_is_rejected():
    layer = nn.Linear(2, 2, seed=0)
    with pytest.raises(TypeError, match="weight"):
        layer.weight = np.zeros((2, 2))


def test_missing_super_init_gives_clear_error():
    class Bad(nn.Module):
        def __init__(self):
            self.lin = nn.Linear(1, 1)

    with pytest.raises(AttributeError, match="super"):
        Bad()


def test_delattr_unregisters():
    m = WithBuffers()
    del m.scale
    assert "scale" not in m.state_dict()
    assert not hasattr(m, "scale")


def test_sequential_indexing_len_iter_and_type_check():
    model = mlp()
    assert len(model) == 3 and isinstance(model[1], nn.ReLU) and isinstance(model[-1], nn.Linear)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert len(model[1:]) == 2
    with pytest.raises(TypeError):
        nn.Sequential(nn.ReLU(), lambda x: x)
    assert "Linear(in_features=4, out_features=5, bias=True)" in repr(model)


# ---------------------------------------------------------------- state dicts

def test_state_dict_is_a_copy():
    model = mlp()
    sd = model.state_dict()
    model[0].weight.data[...] = 0
    assert np.any(sd["0.weight"] != 0)


def test_state_dict_round_trip_into_other_init_keeps_arrays():
    src, dst = mlp(seed=0), mlp(seed=10)
    x = np.random.default_rng(0).standard_normal((3, 4))
    assert not np.allclose(src(x), dst(x))
    weight_array = dst[0].weight.data
    view = weight_array[0]
    result = dst.load_state_dict(src.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(src(x), dst(x))
    assert dst[0].weight.data is weight_array  # written in place, not rebound
    np.testing.assert_array_equal(view, src[0].weight.data[0])


def test_load_state_dict_casts_dtype():
    src, dst = mlp(dtype=np.float64), mlp(seed=5, dtype=np.float32)
    dst.load_state_dict(src.state_dict())
    assert dst[0].weight.dtype == np.float32
    np.testing.assert_allclose(dst[0].weight.data, src[0].weight.data, rtol=1e-6)


def test_load_state_dict_reports_missing_and_unexpected_keys():
    model = mlp()
    sd = model.state_dict()
    del sd["2.bias"]
    sd["9.weight"] = np.zeros(1)
    before = model[0].weight.data.copy()
    sd["0.weight"] = np.zeros_like(before)
    with pytest.raises(StateDictError) as err:
        model.load_state_dict(sd)
    msg = str(err.value)
    assert "missing keys: '2.bias'" in msg and "unexpected keys: '9.weight'" in msg
    np.testing.assert_array_equal(model[0].weight.data, before)  # nothing copied
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["2.bias"] and result.unexpected_keys == ["9.weight"]
    np.testing.assert_array_equal(model[0].weight.data, 0)


def test_load_state_dict_shape_mismatch_names_key_and_shapes():
    model = mlp()
    sd = model.state_dict()
    sd["2.weight"] = np.zeros((3, 6))
    for strict in (True, False):
        with pytest.raises(StateDictError, match=r"'2\.weight'.*\(3, 6\).*\(3, 5\)"):
            model.load_state_dict(sd, strict=strict)
    assert issubclass(StateDictError, AxonError)


def test_load_state_dict_includes_buffers():
    src, dst = WithBuffers(), WithBuffers()
    src.running = np.array([1.0, 2.0])
    dst.load_state_dict(src.state_dict())
    np.testing.assert_array_equal(dst.running, [1.0, 2.0])


# ---------------------------------------------------------------- modes, dtype

def test_train_eval_recursive():
    model = nn.Sequential(nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.2)))
    assert model.eval() is model
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_to_dtype_converts_parameters_and_buffers():
    m = WithBuffers()
    m.register_buffer("count", np.zeros(1, dtype=np.int64))
    m.to(dtype=np.float32)
    assert all(p.dtype == np.float32 for p in m.parameters())
    assert m.running.dtype == np.float32 and m.count.dtype == np.int64
    with pytest.raises(ValueError, match="device"):
        m.to("tpu")


# ---------------------------------------------------------------- gradients

def test_backward_fills_grads_and_accumulates_until_zero_grad():
    model = mlp()
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 3))
    model(x)
    model.backward(g)
    first = {n: p.grad.copy() for n, p in model.named_parameters()}
    grad_arrays = {n: p.grad for n, p in model.named_parameters()}
    model(x)
    model.backward(g)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * first[n])
        assert p.grad is grad_arrays[n]  # accumulated in place
    model.zero_grad()
    for n, p in model.named_parameters():
        assert p.grad is grad_arrays[n] and not np.any(p.grad)
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_gradient_written_into_preinstalled_bucket_views():
    model = mlp()
    params = model.parameters()
    flat = np.zeros(sum(p.size for p in params))
    offset = 0
    for p in params:  # what a DDP wrapper with gradient_as_bucket_view does
        p.grad = flat[offset: offset + p.size].reshape(p.shape)
        offset += p.size
    reference = mlp()
    x, g = np.ones((2, 4)), np.ones((2, 3))
    model(x)
    model.backward(g)
    reference(x)
    reference.backward(g)
    expected = np.concatenate([p.grad.ravel() for p in reference.parameters()])
    np.testing.assert_allclose(flat, expected)


def test_first_gradient_is_a_private_copy():
    p = nn.Parameter(np.zeros(3))
    g = np.ones(3)
    p.accumulate_grad(g)
    g[...] = 5
    np.testing.assert_array_equal(p.grad, 1)
    with pytest.raises(ShapeError, match=r"\(2,\).*\(3,\)"):
        p.accumulate_grad(np.ones(2))


def test_gradients_cast_to_parameter_dtype():
    layer = nn.Linear(3, 2, dtype=np.float32, seed=0)
    layer(np.ones((2, 3), dtype=np.float64))
    layer.backward(np.ones((2, 2), dtype=np.float64))
    assert layer.weight.grad.dtype == np.float32 and layer.bias.grad.dtype == np.float32


def test_backward_without_forward_raises():
    model = mlp()
    with pytest.raises(BackwardBeforeForwardError, match="Linear"):
        model.backward(np.ones((2, 3)))
    model(np.ones((2, 4)))
    model.backward(np.ones((2, 3)))
    with pytest.raises(BackwardBeforeForwardError):
        model.backward(np.ones((2, 3)))  # the cache is consumed by the first backward


def test_one_activation_at_two_places_says_it_was_called_twice_before_a_backward():
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 4, seed=0), act, nn.Linear(4, 4, seed=1), act)
    y = model(np.ones((2, 4), dtype=np.float32))
    with pytest.raises(BackwardBeforeForwardError, match=r"Tanh.backward was called again without a forward, and "
                                                         r"this module was called 2 times before its last backward"
                                                         r".*an instance for each place"):
        model.backward(np.ones_like(y))
    # the plain message again once that is reported, and after a forward and a backward each
    with pytest.raises(BackwardBeforeForwardError, match="without a forward since the last backward"):
        act.backward(np.ones((2, 4), dtype=np.float32))
    act(np.ones((2, 4), dtype=np.float32))
    act.backward(np.ones((2, 4), dtype=np.float32))
    with pytest.raises(BackwardBeforeForwardError, match="without a forward since the last backward"):
        act.backward(np.ones((2, 4), dtype=np.float32))


def test_stash_and_restore_activations_for_interleaved_microbatches():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((2, 4)) for _ in range(2)]
    gs = [rng.standard_normal((2, 3)) for _ in range(2)]
    separate = mlp()
    for x, g in zip(xs, gs):
        separate(x)
        separate.backward(g)
    interleaved = mlp()
    saved = []
    for x in xs:  # both forwards first, as a pipeline schedule does
        interleaved(x)
        saved.append(interleaved.stash_activations())
    dxs = []
    for s, g in zip(saved, gs):
        interleaved.restore_activations(s)
        dxs.append(interleaved.backward(g))
    for a, b in zip(separate.parameters(), interleaved.parameters()):
        np.testing.assert_allclose(a.grad, b.grad)
    with pytest.raises(ShapeError):
        interleaved.restore_activations([None])


# ---------------------------------------------------------------- grad hooks

def _record_hooks(model):
    fired = []
    names = {id(p): n for n, p in model.named_parameters()}
    handles = [p.register_grad_hook(lambda param: fired.append((names[id(param)], param.grad.copy())))
               for p in model.parameters()]
    return fired, handles


@pytest.mark.parametrize("make_model,x", [
    (lambda: mlp(), np.ones((2, 4))),
    (lambda: nn.Sequential(nn.Linear(4, 4, seed=0), nn.LayerNorm(4), nn.MultiHeadAttention(4, 2, seed=1),
                           nn.GELU(), nn.Linear(4, 2, seed=2)), np.ones((2, 3, 4))),
    (lambda: nn.Sequential(nn.Embedding(5, 4, seed=0), nn.MultiHeadAttention(4, 1, causal=True, seed=1),
                           nn.LayerNorm(4, elementwise_affine=False), nn.Linear(4, 2, seed=2)),
     np.array([[1, 2, 3]])),
])
def test_hooks_fire_once_per_parameter_in_reverse_order_with_final_grad(make_model, x):
    model = make_model()
    fired, _ = _record_hooks(model)
    out = model(x)
    model.backward(np.ones(out.shape))
    names = [n for n, _ in model.named_parameters()]
    assert [n for n, _ in fired] == names[::-1]
    final = dict(model.named_parameters())
    for name, grad_at_hook in fired:  # the gradient was complete when the hook ran
        np.testing.assert_array_equal(grad_at_hook, final[name].grad)
    out = model(x)
    model.backward(np.ones(out.shape))
    assert [n for n, _ in fired] == (names[::-1]) * 2  # once per backward


def test_hooks_fire_during_backward_before_earlier_layers_run():
    model = mlp()
    first_layer_grad_when_last_fired = []
    model[2].bias.register_grad_hook(lambda p: first_layer_grad_when_last_fired.append(model[0].weight.grad))
    model(np.ones((1, 4)))
    model.backward(np.ones((1, 3)))
    assert first_layer_grad_when_last_fired == [None]  # layer 0 had not run its backward yet


def test_hook_handle_remove():
    model = mlp()
    fired, handles = _record_hooks(model)
    for h in handles:
        h.remove()
        h.remove()
    model(np.ones((1, 4)))
    model.backward(np.ones((1, 3)))
    assert fired == []
    with pytest.raises(TypeError):
        model[0].weight.register_grad_hook("not callable")
