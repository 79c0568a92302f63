"""Fused optimizer kernels: one launch a parameter, bit for bit the unfused update and the host's.

On CI the kernels run on the strict cupy stand-in, which compiles their
bodies as C on the host (``host_kernels``): that checks the arithmetic, its
order and its dtype, and that the library passes ``--fmad=false``. Whether
NVRTC compiles them and the GPU rounds the same is checked by
``test_fused_matches_unfused_on_a_gpu``, which runs with real cupy where a
CUDA device exists (``bash scripts/gpu-check.sh``) and skips everywhere else.
"""
import importlib
import sys

import numpy as np
import pytest

from axonhpc import _kernels, nn, optim
from axonhpc.backends.devices import device_facts
from axonhpc.errors import ConfigurationError
from strict_cupy import StrictCupy

STEPS = 5
SHAPES = [(3, 4), (5,), (2, 3, 2)]

CONFIGS = {
    "adam": lambda ps, f: optim.Adam(ps, lr=1e-2, fused=f),
    "adam_l2": lambda ps, f: optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=f),
    "adamw": lambda ps, f: optim.AdamW(ps, lr=1e-2, weight_decay=0.05, fused=f),
    "adamw_no_decay": lambda ps, f: optim.AdamW(ps, lr=3e-3, weight_decay=0.0, fused=f),
    "sgd": lambda ps, f: optim.SGD(ps, lr=0.1, fused=f),
    "sgd_l2": lambda ps, f: optim.SGD(ps, lr=0.1, weight_decay=0.01, fused=f),
    "sgd_momentum": lambda ps, f: optim.SGD(ps, lr=0.1, momentum=0.9, fused=f),
    "sgd_dampened": lambda ps, f: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01, fused=f),
    "sgd_nesterov": lambda ps, f: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=f),
}


@pytest.fixture
def strict_cupy(monkeypatch):
    cupy = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def _problem(dtype, seed=0):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def _train(xp, config, fused, dtype, skip=None):
    """Parameters after STEPS steps on ``xp`` arrays; parameter ``skip`` has no gradient at step 2."""
    params0, grads = _problem(dtype)
    params = [nn.Parameter(xp.asarray(p)) for p in params0]
    opt = CONFIGS[config](params, fused)
    for step, step_grads in enumerate(grads):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            p.grad = None if (i == skip and step == 2) else xp.asarray(g)
        opt.step()
    return [p.data.get() if xp is not np else p.data for p in params], opt


def _launches(xp):
    return _kernels.launches(xp)


def _assert_bitwise(got, expected):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and np.array_equal(a, b), (i, np.max(np.abs(a - b)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_is_the_unfused_update_bit_for_bit(config, dtype, strict_cupy):
    before = _launches(strict_cupy)
    fused, _ = _train(strict_cupy, config, None, dtype, skip=1)
    assert _launches(strict_cupy) - before == STEPS * len(SHAPES) - 1  # one launch a parameter a step
    unfused, _ = _train(strict_cupy, config, False, dtype, skip=1)
    assert _launches(strict_cupy) - before == STEPS * len(SHAPES) - 1  # fused=False launches none
    on_host, _ = _train(np, config, None, dtype, skip=1)
    _assert_bitwise(fused, unfused)
    _assert_bitwise(fused, on_host)


def test_the_kernels_are_compiled_without_multiply_add_contraction(strict_cupy):
    _train(strict_cupy, "adam", True, np.float32)
    _train(strict_cupy, "sgd_momentum", True, np.float32)
    kernels = list(_kernels.kept(strict_cupy).values())
    assert {k.name for k in kernels} >= {"axonhpc_adam", "axonhpc_sgd"}
    assert all("--fmad=false" in k.options for k in kernels)


@pytest.mark.parametrize("config", ["adam", "sgd_momentum"])
def test_a_state_dict_moves_between_fused_and_unfused(config, strict_cupy):
    params0, grads = _problem(np.float64)

    def run(fused_first, fused_second):
        params = [nn.Parameter(strict_cupy.asarray(p)) for p in params0]
        opt = CONFIGS[config](params, fused_first)
        for step, step_grads in enumerate(grads):
            if step == 2:
                state = opt.state_dict()
                opt = CONFIGS[config](params, fused_second)
                opt.load_state_dict(state)
            for p, g in zip(params, step_grads):
                p.grad = strict_cupy.asarray(g)
            opt.step()
        return [p.data.get() for p in params]

    _assert_bitwise(run(True, False), run(False, False))
    _assert_bitwise(run(False, True), run(False, False))


def test_float16_and_host_parameters_keep_the_array_code(strict_cupy):
    before = _launches(strict_cupy)
    half, _ = _train(strict_cupy, "sgd_nesterov", None, np.float16)
    host, _ = _train(np, "adam", None, np.float32)
    assert _launches(strict_cupy) == before
    _assert_bitwise(half, _train(np, "sgd_nesterov", None, np.float16)[0])
    assert host[0].dtype == np.float32


def test_fused_true_refuses_what_the_kernel_does_not_serve(strict_cupy):
    with pytest.raises(ConfigurationError, match=r"Adam\(fused=True\): parameter 1 of shape \(5,\) is a host array"):
        optim.Adam([nn.Parameter(strict_cupy.zeros((3, 4))), nn.Parameter(np.zeros(5))], fused=True)
    with pytest.raises(ConfigurationError, match=r"SGD\(fused=True\): parameter 0 of shape \(2,\) has dtype float16"):
        optim.SGD([nn.Parameter(strict_cupy.zeros(2, dtype=np.float16))], lr=0.1, fused=True)
    with pytest.raises(ConfigurationError, match="fused must be None, True or False, got 'yes'"):
        optim.AdamW([nn.Parameter(strict_cupy.zeros(2))], fused="yes")
    p = nn.Parameter(strict_cupy.zeros(3))
    opt = optim.SGD([p], lr=0.1, fused=True)
    p.grad = strict_cupy.zeros(3, dtype=np.float32)
    with pytest.raises(ConfigurationError, match=r"has a gradient of another kind \(\w+ of float32, shape \(3,\)\)"):
        opt.step()


def test_fused_none_on_the_host_builds_no_kernel():
    before = dict(_kernels._cache)
    _train(np, "adamw", None, np.float32)
    assert _kernels._cache == before
    assert optim.SGD([nn.Parameter(np.zeros(2))], lr=0.1).fused is None


_cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_matches_unfused_on_a_gpu(config, dtype):
    fused, opt = _train(_cupy, config, True, dtype, skip=1)
    unfused, _ = _train(_cupy, config, False, dtype, skip=1)
    _assert_bitwise(fused, unfused)
    _assert_bitwise(fused, _train(np, config, None, dtype, skip=1)[0])
