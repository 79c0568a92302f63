"""Fused optimizer kernels: one launch for the parameters, bit for bit the unfused update and the host's.

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

from axonhpc import nn, optim
from axonhpc.cuda import kernels as cuda_kernels
from axonhpc.backends.devices import device_facts
from axonhpc.errors import ConfigurationError
from support.strict_cupy import StrictCupy

STEPS = 5
SHAPES = [(3, 4), (5,), (2, 3, 2)]

CONFIGS = {
    "adam": lambda ps, f: optim.Adam(ps, lr=1e-2, fused=f),
    "adam_l2": lambda ps, f: optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=f),
    "adamw": lambda ps, f: optim.AdamW(ps, lr=1e-2, weight_decay=0.05, fused=f),
    "adamw_no_decay": lambda ps, f: optim.AdamW(ps, lr=3e-3, weight_decay=0.0, fused=f),
    "adam_low_beta1": lambda ps, f: optim.Adam(ps, lr=1e-2, betas=(0.3, 0.9), fused=f),  # the lerp's other side
    "adamw_beta1_zero": lambda ps, f: optim.AdamW(ps, lr=1e-2, betas=(0.0, 0.999), fused=f),
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
    return cuda_kernels.launches(xp)


def _assert_bitwise(got, expected):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and np.array_equal(a, b), (i, np.max(np.abs(a - b)))


def _expected_launches(config):
    """One multi-tensor launch a step; Adam's skipped parameter lags a step behind from step 3 on, so
    its update has other scalars (the bias corrections) and is launched alone in the last two steps."""
    return STEPS + (2 if config.startswith("adam") else 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_is_the_unfused_update_bit_for_bit(config, dtype, strict_cupy):
    before = _launches(strict_cupy)
    fused, _ = _train(strict_cupy, config, None, dtype, skip=1)
    assert _launches(strict_cupy) - before == _expected_launches(config)
    unfused, _ = _train(strict_cupy, config, False, dtype, skip=1)
    assert _launches(strict_cupy) - before == _expected_launches(config)  # fused=False launches none
    on_host, _ = _train(np, config, None, dtype, skip=1)
    _assert_bitwise(fused, unfused)
    _assert_bitwise(fused, on_host)


def test_the_kernels_are_compiled_without_multiply_add_contraction(strict_cupy):
    _train(strict_cupy, "adam", True, np.float32, skip=1)
    _train(strict_cupy, "sgd_momentum", True, np.float32)
    one = nn.Parameter(strict_cupy.ones(3, dtype=np.float32))
    opt = optim.SGD([one], lr=0.1, momentum=0.9)
    one.grad = strict_cupy.ones(3, dtype=np.float32)
    opt.step()
    kernels = list(cuda_kernels.kept(strict_cupy).values())
    assert {k.name for k in kernels} >= {"axonhpc_adam", "axonhpc_adam_multi", "axonhpc_sgd", "axonhpc_sgd_multi"}
    assert all("--fmad=false" in k.options for k in kernels)


def _mixed(xp):
    """Parameters of two dtypes, one of them a non-contiguous view (it cannot join a multi-tensor launch)."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((4, 6)).astype(np.float32)
    arrays = [base[:, ::2], rng.standard_normal((3, 3)).astype(np.float32), rng.standard_normal(5),
              rng.standard_normal((2, 2)), rng.standard_normal(7).astype(np.float32)]
    params = [nn.Parameter(xp.asarray(a) if xp is np else xp.asarray(a.copy())) for a in arrays]
    if xp is not np:
        params[0] = nn.Parameter(xp.asarray(base)[:, ::2])  # the view, on the device
    grads = [[rng.standard_normal(a.shape).astype(a.dtype) for a in arrays] for _ in range(STEPS)]
    return params, grads


@pytest.mark.parametrize("config", ["adamw", "sgd_nesterov"])
def test_each_dtype_is_one_launch_and_what_cannot_join_is_updated_alone(config, strict_cupy):
    results = {}
    for xp, fused in ((strict_cupy, None), (strict_cupy, False), (np, None)):
        params, grads = _mixed(xp)
        opt = CONFIGS[config](params, fused)
        before = _launches(strict_cupy)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g if xp is np else xp.asarray(g)
            opt.step()
        launched = _launches(strict_cupy) - before
        results[(xp is np, fused)] = ([p.data if xp is np else p.data.get() for p in params], launched)
    fused_result, launched = results[(False, None)]
    assert launched == STEPS * 3  # a float32 launch, a float64 launch, and the view alone
    names = {name for name, _ in cuda_kernels.kept(strict_cupy)}
    assert {"adam", "adam_multi"} <= names or {"sgd", "sgd_multi"} <= names
    _assert_bitwise(fused_result, results[(False, False)][0])
    _assert_bitwise(fused_result, results[(True, None)][0])


def test_address_tables_are_kept_until_an_address_changes(strict_cupy):
    tables = cuda_kernels.TensorTables()
    a, b = strict_cupy.zeros(3), strict_cupy.zeros(5)
    first = tables.tables(strict_cupy, "k", [[a, b]])
    assert tables.tables(strict_cupy, "k", [[a, b]]) is first
    assert first[0].get().tolist() == [a.data.ptr, b.data.ptr] and first[1].get().tolist() == [0, 3, 8]
    c = strict_cupy.zeros(5)  # a new gradient array (zero_grad(set_to_none=True)) has a new address
    again = tables.tables(strict_cupy, "k", [[a, c]])
    assert again is not first and again[0].get().tolist() == [a.data.ptr, c.data.ptr]
    assert tables.tables(strict_cupy, "other", [[a, b]]) is not again  # kept per group


def test_a_table_a_graph_captured_is_kept_past_the_eviction(strict_cupy, monkeypatch):
    # Only the last KEEP address sets were kept: eager steps on new gradient arrays after a capture dropped the
    # captured table, whose memory the graph's replays still read (the stand-in's replay holds its arrays, so
    # only a real GPU would show it: here the reference itself is checked).
    from axonhpc.cuda import capture

    tables = cuda_kernels.TensorTables()
    a, b = strict_cupy.zeros(3), strict_cupy.zeros(5)
    captured = tables.tables(strict_cupy, "k", [[a, b]])  # made in a warm-up step
    monkeypatch.setattr(capture, "capturing", lambda: True)
    assert tables.tables(strict_cupy, "k", [[a, b]]) is captured  # the capture reads the kept table
    monkeypatch.setattr(capture, "capturing", lambda: False)
    for _ in range(tables.KEEP + 1):  # set_to_none=True steps: new addresses each time
        tables.tables(strict_cupy, "k", [[a, strict_cupy.zeros(5)]])
    kept = [made for made in tables._captured.values()]
    assert len(kept) == 1 and kept[0] is captured


def test_batches_cut_at_the_launch_limit_and_leave_a_larger_array_alone():
    assert cuda_kernels.batches([5, 3, 10, 1, 2], limit=8) == [[0, 1], [2], [3, 4]]
    assert cuda_kernels.batches([], limit=8) == []
    assert cuda_kernels.batches([8, 8], limit=8) == [[0], [1]]


def test_the_stand_in_takes_raw_arrays_and_size_as_cupy_does(strict_cupy):
    kernel = strict_cupy.ElementwiseKernel("raw float64 x, float64 y", "float64 z", "z = x[i] + y;", "k")
    with pytest.raises(ValueError, match="Loop size is undecided"):
        strict_cupy.ElementwiseKernel("raw float64 x", "", "", "k2")(strict_cupy.zeros(2))
    with pytest.raises(ValueError, match="Specified 'size' can be used only"):
        kernel(strict_cupy.zeros(2), strict_cupy.zeros(2), size=2)
    out = kernel(strict_cupy.arange(4.0), np.float64(10), strict_cupy.zeros(2))  # raw x is not broadcast
    assert out.get().tolist() == [10.0, 11.0]
    assert strict_cupy.ElementwiseKernel("raw float64 x", "", "", "k3")(strict_cupy.zeros(2), size=2) == ()


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
    with pytest.raises(ConfigurationError, match=r"Adam\(fused=True\): parameter 1 of shape \(5,\) has dtype float16"):
        optim.Adam([nn.Parameter(strict_cupy.zeros((3, 4))), nn.Parameter(np.zeros(5, np.float16))], fused=True)
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
    before = dict(cuda_kernels._cache)
    _train(np, "adamw", None, np.float32)
    assert cuda_kernels._cache == before
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
