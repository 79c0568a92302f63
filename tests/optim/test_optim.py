"""Optimizers against hand-written reference updates, state dicts, clipping, in-place semantics."""
import json
import math

import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.errors import ConfigurationError, InvalidArgumentError, StateDictError

STEPS = 6


def make_params(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [nn.Parameter(rng.standard_normal((3, 4)).astype(dtype)),
            nn.Parameter(rng.standard_normal(5).astype(dtype))]


def grad_sequence(params, steps=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(p.shape).astype(p.dtype) for p in params] for _ in range(steps)]


def run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.copy()
        opt.step()


# ---------------------------------------------------------------- references (textbook formulas, plain loops)

def ref_sgd(p0, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    p, buf = p0.copy(), None
    for g in grads:
        d = g + weight_decay * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p


def ref_adam(p0, grads, lr, betas, eps, weight_decay, decoupled):
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat = m / (1 - betas[0] ** t)
        v_hat = v / (1 - betas[1] ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.8, nesterov=True),
    dict(lr=0.1, momentum=0.5, weight_decay=0.01),
    dict(lr=0.1, weight_decay=0.1, momentum=0.9, nesterov=True),
]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_matches_reference(kwargs):
    params = make_params()
    start = [p.data.copy() for p in params]
    grads = grad_sequence(params)
    run(optim.SGD(params, **kwargs), params, grads)
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.data, ref_sgd(start[i], [g[i] for g in grads], **kwargs), rtol=1e-13, atol=1e-14)


def test_sgd_momentum_by_hand():
    p = nn.Parameter(np.array([1.0]))
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = np.array([2.0])
    opt.step()  # buf = 2, p = 1 - 0.2
    assert p.data[0] == pytest.approx(0.8, abs=1e-15)
    p.grad = np.array([1.0])
    opt.step()  # buf = 0.9 * 2 + 1 = 2.8, p = 0.8 - 0.28
    assert p.data[0] == pytest.approx(0.52, abs=1e-15)


ADAM_CASES = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    dict(lr=0.1, betas=(0.0, 0.5), eps=1e-3, weight_decay=0.0),
]


@pytest.mark.parametrize("kwargs", ADAM_CASES)
@pytest.mark.parametrize("cls,decoupled", [(optim.Adam, False), (optim.AdamW, True)])
def test_adam_family_matches_reference(kwargs, cls, decoupled):
    params = make_params()
    start = [p.data.copy() for p in params]
    grads = grad_sequence(params)
    run(cls(params, **kwargs), params, grads)
    for i, p in enumerate(params):
        expected = ref_adam(start[i], [g[i] for g in grads], decoupled=decoupled, **kwargs)
        np.testing.assert_allclose(p.data, expected, rtol=1e-12, atol=1e-14)


def test_adam_first_step_by_hand():
    # m_hat = g, v_hat = g^2, so the first step is lr * g / (|g| + eps).
    p = nn.Parameter(np.array([1.0, -2.0]))
    opt = optim.Adam([p], lr=0.1, eps=1e-8)
    p.grad = np.array([0.5, -4.0])
    opt.step()
    np.testing.assert_allclose(p.data, [1.0 - 0.1 * 0.5 / (0.5 + 1e-8), -2.0 + 0.1 * 4.0 / (4.0 + 1e-8)], rtol=1e-15)
    assert opt.state[0]["step"] == 1


def torch_adam(p0, grads, lr, betas, eps, weight_decay, decoupled):
    """torch's _single_tensor_adam, operation for operation in the parameters' dtype (its scalar CPU code):
    ``exp_avg.lerp_(g, 1 - beta1)``, two-sided; ``exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)``;
    ``param.addcdiv_(exp_avg, denom, value=-step_size)``. Returns the parameter and the first moment."""
    t = p0.dtype.type
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    for step, g in enumerate(grads, start=1):
        if decoupled:
            p = p * t(1 - lr * weight_decay)
        elif weight_decay:
            g = g + t(weight_decay) * p
        w = t(1 - betas[0])
        m = m + w * (g - m) if abs(w) < 0.5 else g - (g - m) * (t(1) - w)
        v = v * t(betas[1]) + (t(1 - betas[1]) * g) * g
        denom = np.sqrt(v) / t(math.sqrt(1 - betas[1] ** step)) + t(eps)
        p = p + (t(-(lr / (1 - betas[0] ** step))) * m) / denom
    return p, m


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("betas,decoupled,weight_decay", [((0.9, 0.999), False, 0.0), ((0.5, 0.9), True, 0.1),
                                                          ((0.3, 0.99), False, 0.05), ((0.0, 0.999), True, 0.0)])
def test_adam_is_torchs_update_operation_for_operation(betas, decoupled, weight_decay, dtype, fused):
    params = make_params(dtype=dtype)
    grads = grad_sequence(params, steps=4)
    for g in grads:
        g[1][:2] *= 1e4  # a large gradient that the first moment then forgets (beta1 = 0: entirely)
    cls = optim.AdamW if decoupled else optim.Adam
    opt = cls(params, lr=0.01, betas=betas, eps=1e-6, weight_decay=weight_decay, fused=fused)
    start = [p.data.copy() for p in params]
    run(opt, params, grads)
    for i, (p, p0) in enumerate(zip(params, start)):
        expected, exp_avg = torch_adam(p0, [step[i] for step in grads], 0.01, betas, 1e-6, weight_decay, decoupled)
        np.testing.assert_array_equal(p.data, expected)
        np.testing.assert_array_equal(opt.state[i]["exp_avg"], exp_avg)


@pytest.mark.parametrize("fused", [None, False])
def test_adam_first_moment_is_the_gradient_with_beta1_zero(fused):
    # torch's lerp with weight 1 gives g exactly; m + 1 * (g - m) loses g's low bits after a large m
    p = nn.Parameter(np.zeros(1, np.float32))
    opt = optim.Adam([p], lr=1.0, betas=(0.0, 0.999), fused=fused)
    for g in (100.0, 1e-3):
        p.grad = np.array([g], np.float32)
        opt.step()
    assert opt.state[0]["exp_avg"][0] == np.float32(1e-3)


def test_sgd_defaults_are_pytorchs():
    # PyTorch 2.2 gave SGD's lr a default of 1e-3 (pytorch/pytorch#114467), like the other optimizers.
    p = nn.Parameter(np.ones(3))
    p.grad = np.array([1.0, 2.0, -4.0])
    opt = optim.SGD([p])
    assert (opt.lr, opt.momentum, opt.dampening, opt.weight_decay, opt.nesterov) == (1e-3, 0.0, 0.0, 0.0, False)
    opt.step()
    np.testing.assert_array_equal(p.data, np.ones(3) - 1e-3 * np.array([1.0, 2.0, -4.0]))


def test_adamw_defaults_and_decay_by_hand():
    p = nn.Parameter(np.array([2.0]))
    opt = optim.AdamW([p], lr=0.1)
    assert opt.weight_decay == 1e-2 and opt.betas == (0.9, 0.999) and opt.eps == 1e-8
    p.grad = np.array([0.0])
    opt.step()  # zero gradient: only the decay acts
    assert p.data[0] == pytest.approx(2.0 * (1 - 0.1 * 1e-2), rel=1e-15)
    assert optim.Adam([nn.Parameter(np.zeros(1))]).lr == 1e-3


# ---------------------------------------------------------------- in-place semantics

@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda ps: optim.Adam(ps, weight_decay=0.1),
    lambda ps: optim.AdamW(ps),
])
def test_updates_are_in_place(make):
    flat = np.random.default_rng(0).standard_normal(17)
    params = [nn.Parameter(flat[:12].reshape(3, 4)), nn.Parameter(flat[12:])]  # views, like a flat shard
    arrays = [p.data for p in params]
    before = flat.copy()
    opt = make(params)
    run(opt, params, grad_sequence(params, steps=2))
    assert all(p.data is a for p, a in zip(params, arrays))
    assert not np.allclose(flat, before)  # the flat buffer saw the updates


def test_parameters_without_grad_are_skipped_and_zero_grad():
    a, b = make_params()
    opt = optim.SGD([a, b], lr=0.1, momentum=0.9)
    before = b.data.copy()
    a.grad = np.ones(a.shape)
    opt.step()
    np.testing.assert_array_equal(b.data, before)
    assert opt.state[1] == {}
    grad = a.grad
    opt.zero_grad()
    assert a.grad is grad and not np.any(grad)
    opt.zero_grad(set_to_none=True)
    assert a.grad is None


def test_float32_parameters_stay_float32():
    params = make_params(dtype=np.float32)
    for opt in (optim.SGD(params, lr=0.1, momentum=0.9), optim.Adam(params), optim.AdamW(params)):
        run(opt, params, grad_sequence(params, steps=2))
        assert all(p.data.dtype == np.float32 for p in params)
        assert all(v.dtype == np.float32 for s in opt.state for v in s.values() if hasattr(v, "dtype"))


def test_hyperparameters_can_change_between_steps():
    p = nn.Parameter(np.array([1.0]))
    opt = optim.SGD([p], lr=0.1)
    p.grad = np.array([1.0])
    opt.lr = 0.5
    opt.step()
    assert p.data[0] == pytest.approx(0.5)


# ---------------------------------------------------------------- state dicts

def _plain_data(obj):
    """The state dict with arrays as lists must be JSON: nothing pickle-only inside."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain_data(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_data(v) for v in obj]
    assert isinstance(obj, (int, float, bool, str)) or obj is None, type(obj)
    return obj


@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: optim.Adam(ps, lr=0.01, betas=(0.8, 0.9)),
    lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.05),
])
def test_state_dict_round_trip_continues_identically(make):
    params = make_params()
    grads = grad_sequence(params, steps=8)
    opt = make(params)
    run(opt, params, grads[:4])
    sd = opt.state_dict()
    json.dumps(_plain_data(sd))
    saved_values = [p.data.copy() for p in params]
    run(opt, params, grads[4:])

    clones = [nn.Parameter(v.copy()) for v in saved_values]
    fresh = make(clones)
    fresh.lr = 123.0  # overwritten by the load
    fresh.load_state_dict(sd)
    assert fresh.hyperparameters() == opt.hyperparameters()
    run(fresh, clones, grads[4:])
    for a, b in zip(params, clones):
        np.testing.assert_array_equal(a.data, b.data)


def test_state_dict_arrays_are_copies():
    params = make_params()
    opt = optim.Adam(params)
    run(opt, params, grad_sequence(params, steps=1))
    sd = opt.state_dict()
    saved = sd["state"][0]["exp_avg"].copy()
    run(opt, params, grad_sequence(params, steps=1, seed=5))
    np.testing.assert_array_equal(sd["state"][0]["exp_avg"], saved)
    assert sd["hyperparameters"]["betas"] == [0.9, 0.999]


def test_load_state_dict_errors():
    params = make_params()
    opt = optim.Adam(params)
    run(opt, params, grad_sequence(params, steps=1))
    sd = opt.state_dict()
    with pytest.raises(StateDictError, match="state for 2 parameters, the optimizer has 1"):
        optim.Adam(params[:1]).load_state_dict(sd)
    bad = opt.state_dict()
    bad["state"][1]["exp_avg"] = np.zeros(4)
    with pytest.raises(StateDictError, match=r"'exp_avg' of parameter 1 has shape \(4,\).*\(5,\)"):
        optim.Adam(params).load_state_dict(bad)
    with pytest.raises(StateDictError, match="hyperparameters"):
        optim.SGD(params, lr=0.1).load_state_dict(sd)
    with pytest.raises(StateDictError, match="keys"):
        opt.load_state_dict({"state": []})


@pytest.mark.parametrize("make", [lambda ps: optim.Adam(ps, lr=0.01), lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_a_state_dict_through_json_loads_and_continues_identically(make):
    # a JSON round trip turns the state arrays into nested lists; they load as arrays of the parameter's dtype
    params = make_params(dtype=np.float32)
    grads = grad_sequence(params, steps=4)
    opt = make(params)
    run(opt, params, grads[:2])
    sd = json.loads(json.dumps(opt.state_dict(), default=lambda a: a.tolist()))
    clones = [nn.Parameter(p.data.copy()) for p in params]
    fresh = make(clones)
    fresh.load_state_dict(sd)
    for state, p in zip(fresh.state, clones):
        for k, v in state.items():
            assert (type(v), v.dtype) == (np.ndarray, p.dtype) if k != "step" else type(v) is int
    run(opt, params, grads[2:])
    run(fresh, clones, grads[2:])
    for a, b in zip(params, clones):
        np.testing.assert_array_equal(a.data, b.data)


def test_a_bfloat16_state_dict_loads():
    from axonhpc._dtypes import floating_dtype
    p = nn.Parameter(np.ones(3, floating_dtype("bfloat16", "test")))
    opt = optim.Adam([p])
    p.grad = np.ones_like(p.data)
    opt.step()
    fresh = optim.Adam([p])
    fresh.load_state_dict(opt.state_dict())  # bfloat16's numpy kind is "V", not "f"
    assert fresh.state[0]["exp_avg"].dtype == p.data.dtype


@pytest.mark.parametrize("key,value,match", [
    ("exp_avg", [1.0, 2.0], r"state 'exp_avg' of parameter 1 has shape \(2,\), the parameter has \(5,\)"),
    ("exp_avg_sq", [[1.0], [2.0, 3.0]], r"state 'exp_avg_sq' of parameter 1 is a list that is not an array"),
    ("exp_avg", ["a"] * 5, r"state 'exp_avg' of parameter 1 has dtype <U1, not real numbers"),
    ("exp_avg_sq", None, r"state 'exp_avg_sq' of parameter 1 has dtype object, not real numbers"),
    ("step", "1", r"state 'step' of parameter 1 is '1', not an int >= 0"),
    ("step", -1, r"state 'step' of parameter 1 is -1, not an int >= 0"),
])
def test_state_values_that_are_not_arrays_of_the_parameters_shape_are_refused(key, value, match):
    params = make_params()
    opt = optim.Adam(params)
    run(opt, params, grad_sequence(params, steps=1))
    sd = opt.state_dict()
    sd["state"][1][key] = value
    fresh = optim.Adam(params)
    with pytest.raises(StateDictError, match=match):
        fresh.check_state_dict(sd)
    with pytest.raises(StateDictError, match=match):
        fresh.load_state_dict(sd)
    assert fresh.state == [{}, {}]


def test_state_keys_of_another_optimizer_are_refused_before_anything_changes():
    params = make_params()
    opt = optim.Adam(params, lr=0.5)
    run(opt, params, grad_sequence(params, steps=1))
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["hyperparameters"]["lr"] = 0.1
    bad["state"][0]["momentum_buffer"] = bad["state"][0].pop("exp_avg")
    with pytest.raises(StateDictError, match=r"parameter 0 has keys \['exp_avg_sq', 'momentum_buffer', 'step'\]; "
                                             r"Adam keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        opt.check_state_dict(bad)
    with pytest.raises(StateDictError, match="momentum_buffer"):
        opt.load_state_dict(bad)
    assert opt.lr == 0.5 and sorted(opt.state[0]) == sorted(before["state"][0])
    opt.check_state_dict(optim.Adam(params).state_dict())  # a fresh state (nothing before the first step) fits


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("make,match", [
    (lambda ps: optim.SGD(ps, lr=-0.1), "lr=-0.1"),
    (lambda ps: optim.SGD(ps, lr=0.1, nesterov=True), "nesterov"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening=0.1"),
    (lambda ps: optim.Adam(ps, betas=(0.9, 1.0)), "betas"),
    (lambda ps: optim.Adam(ps, betas=0.9), r"Adam betas must be two numbers in \[0, 1\), got 0.9"),
    (lambda ps: optim.AdamW(ps, betas=("a", "b")), r"AdamW betas must be two numbers in \[0, 1\), got \('a', 'b'\)"),
    (lambda ps: optim.Adam(ps, betas=(float("nan"), 0.9)), r"got \(nan, 0.9\)"),
    (lambda ps: optim.Adam(ps, eps=-1.0), "eps=-1.0"),
    (lambda ps: optim.AdamW(ps, weight_decay=-0.1), "weight_decay=-0.1"),
    (lambda ps: optim.SGD([], lr=0.1), "empty"),
    (lambda ps: optim.SGD([ps[0], ps[0]], lr=0.1), "more than once"),
])
def test_invalid_arguments(make, match):
    with pytest.raises(ConfigurationError, match=match):
        make(make_params())


def test_non_parameter_rejected():
    with pytest.raises(TypeError, match="not a Parameter"):
        optim.SGD([np.zeros(3)], lr=0.1)


# ---------------------------------------------------------------- clip_grad_norm

def test_clip_grad_norm_scales_to_max_norm():
    params = make_params()
    for p, g in zip(params, grad_sequence(params, steps=1)[0]):
        p.grad = g * 10
    grads = [p.grad for p in params]
    expected = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    before = [g.copy() for g in grads]
    total = optim.clip_grad_norm(params, 1.0)
    assert isinstance(total, float) and total == pytest.approx(expected, rel=1e-14)
    coef = 1.0 / (expected + 1e-6)
    for g, b, p in zip(grads, before, params):
        assert p.grad is g  # clipped in place
        np.testing.assert_allclose(g, b * coef, rtol=1e-14)
    assert optim.clip_grad_norm(params, 1e9) == pytest.approx(coef * expected, rel=1e-12)


def test_clip_grad_norm_no_clip_below_threshold_and_other_norms():
    params = make_params()
    params[0].grad = np.full((3, 4), 0.1)
    params[1].grad = None  # skipped
    grad = params[0].grad.copy()
    assert optim.clip_grad_norm(params, 10.0) == pytest.approx(math.sqrt(12 * 0.01))
    np.testing.assert_array_equal(params[0].grad, grad)
    params[0].grad[1, 2] = -3.0
    assert optim.clip_grad_norm(params, 1.0, norm_type=float("inf")) == 3.0
    np.testing.assert_allclose(np.abs(params[0].grad).max(), 3.0 / (3.0 + 1e-6))
    p = nn.Parameter(np.zeros(2))
    p.grad = np.array([3.0, -4.0])
    assert optim.clip_grad_norm(p, 100.0, norm_type=1) == pytest.approx(7.0)
    assert optim.clip_grad_norm([nn.Parameter(np.zeros(1))], 1.0) == 0.0
    with pytest.raises(ValueError):
        optim.clip_grad_norm(p, 1.0, norm_type=0)
    with pytest.raises(InvalidArgumentError, match="norm_type must be a number, got 'two'"):
        optim.clip_grad_norm(p, 1.0, norm_type="two")
    with pytest.raises(InvalidArgumentError, match="max_norm must be a number, got None"):
        optim.clip_grad_norm(p, None)


@pytest.mark.parametrize("norm_type,expected", [(2.0, math.sqrt(1000 * 100.0 ** 2)), (1.0, 1000 * 100.0),
                                                (3.0, (1000 * 100.0 ** 3) ** (1 / 3)), (float("inf"), 100.0)])
def test_clip_grad_norm_of_float16_gradients_is_computed_in_float64(norm_type, expected):
    # a thousand 100s: the sum (1e5), the sum of squares and of cubes are all past float16's 65504
    p = nn.Parameter(np.zeros(1000, dtype=np.float16))
    p.grad = np.full(1000, 100.0, dtype=np.float16)
    total = optim.clip_grad_norm([p], 1.0, norm_type)
    assert total == pytest.approx(expected, rel=1e-12)
    assert p.grad.dtype == np.float16
    np.testing.assert_array_equal(p.grad, np.float16(100.0) * np.float16(1.0 / (expected + 1e-6)))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_leaves_gradients_with_a_non_finite_norm_unchanged(bad, norm_type):
    params = make_params()
    for p in params:
        p.grad = np.full(p.shape, 5.0)
    params[1].grad[2] = bad
    before = [p.grad.copy() for p in params]
    total = optim.clip_grad_norm(params, 1.0, norm_type)
    assert math.isnan(total) if np.isnan(bad) else total == math.inf
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.grad, b)  # neither zeroed (torch, an inf norm) nor NaN (torch, a NaN norm)
