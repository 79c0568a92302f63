"""Matrix products in nn: gradients accumulated inside the GEMM on the device, and the TF32 setting.

Nothing here runs on a GPU: ``strict_cupy`` plays cupy, with its compute-type
table, and cuBLAS's ``cublasGemmEx`` (``nn.gemm`` calls it directly) reading
the memory at the arrays' addresses column-major, as the library does. The
GPU tests run the same products on a device (tests/nn/test_nn_gemm.py).
"""
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn
from axonhpc.errors import BackendUnavailableError, ShapeError
from axonhpc.settings import Settings
from support.settings_override import override
from support.strict_cupy import StrictCupy, device, host


@pytest.fixture
def fake_cupy(monkeypatch):
    module = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.delenv("CUPY_TF32", raising=False)
    yield module
    nn.apply_matmul_precision()  # no state of this stand-in outlives the test


def _layer_and_data(dtype, seed=0):
    layer = nn.Linear(6, 5, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 6)).astype(dtype)
    g = rng.standard_normal((4, 5)).astype(dtype)
    return layer, x, g


def _two_backwards(layer, x, g):
    """Two forward/backward passes, so the second adds into an existing gradient."""
    for _ in range(2):
        layer(x)
        layer.backward(g)
    return layer.weight.grad, layer.bias.grad


def test_first_weight_gradient_is_the_product_itself_and_later_ones_add():
    layer, x, g = _layer_and_data(np.float64)
    layer(x)
    layer.backward(g)
    assert np.array_equal(layer.weight.grad, g.T @ x)
    first = layer.weight.grad
    layer(x)
    layer.backward(g)
    assert layer.weight.grad is first  # accumulated in place (a DDP bucket view stays a view)
    assert np.array_equal(layer.weight.grad, g.T @ x + g.T @ x)


def test_accumulate_product_refuses_a_product_of_another_shape():
    p = nn.Parameter(np.zeros((3, 4)))
    with pytest.raises(ShapeError, match=r"\(3, 2\) @ \(2, 5\).*\(3, 4\)"):
        p.accumulate_product(np.ones((3, 2)), np.ones((2, 5)))
    with pytest.raises(ShapeError, match=r"\(3, 2\) @ \(3, 4\)"):
        p.accumulate_product(np.ones((3, 2)), np.ones((3, 4)))
    assert p.grad is None


def test_accumulate_product_runs_the_grad_hooks_once():
    p = nn.Parameter(np.zeros((2, 2)))
    seen = []
    p.register_grad_hook(lambda param: seen.append(param.grad.copy()))
    p.accumulate_product(np.eye(2), np.full((2, 2), 3.0))
    p.accumulate_product(np.eye(2), np.ones((2, 2)))
    assert [s.tolist() for s in seen] == [[[3.0, 3.0], [3.0, 3.0]], [[4.0, 4.0], [4.0, 4.0]]]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_gradient_accumulates_inside_the_gemm_and_matches_the_host(fake_cupy, dtype):
    host_layer, x, g = _layer_and_data(dtype)
    want_w, want_b = _two_backwards(host_layer, x, g)
    layer, _, _ = _layer_and_data(dtype)
    layer.to("cuda")
    got_w, got_b = _two_backwards(layer, device(x), device(g))
    blas = fake_cupy._axonhpc_cublas
    # every product through nn.gemm, none through cupy (which refuses cuBLAS in a graph capture):
    # per pass the forward, the bias gradient (a column sum, [Note: column sums by GEMM]), the weight gradient
    # and the input gradient
    assert fake_cupy.cublas.calls == 0 and blas.calls == 8
    # the second weight gradient adds into the first
    assert blas.betas == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert set(blas.computes) == {70 if dtype == np.float64 else 68}  # 64F, or 32F (TF32 off)
    rtol = 1e-6 if dtype == np.float32 else 1e-15
    np.testing.assert_allclose(host(got_w), want_w, rtol=rtol)
    np.testing.assert_allclose(host(got_b), want_b, rtol=rtol)


def test_half_precision_device_gradients_go_through_the_gemm_in_float32_accumulation(fake_cupy):
    layer, x, g = _layer_and_data(np.float16)
    layer.to("cuda")
    got_w, _ = _two_backwards(layer, device(x), device(g))
    blas = fake_cupy._axonhpc_cublas
    assert blas.calls == 8 and set(blas.computes) == {68} and got_w.dtype == np.float16
    host_layer, x, g = _layer_and_data(np.float32)
    want_w, _ = _two_backwards(host_layer, x, g)
    np.testing.assert_allclose(host(got_w).astype(np.float32), want_w, rtol=2e-2, atol=2e-2)


def test_allow_tf32_sets_cupy_compute_type_at_the_next_module_call_and_restores_it(fake_cupy):
    table = fake_cupy._core._routines_linalg
    blas = fake_cupy._axonhpc_cublas
    layer, x, g = _layer_and_data(np.float32)
    layer.to("cuda")
    layer(device(x))
    assert table.get_compute_type(np.float32) == table.COMPUTE_TYPE_DEFAULT  # off, never on: cupy's own choice
    assert blas.computes == [68]
    with override(allow_tf32=True):
        assert table.compute_types[1] == table.COMPUTE_TYPE_DEFAULT  # applied by the next call, not before
        layer(device(x))
        assert table.compute_types[1] == table.COMPUTE_TYPE_TF32
        assert table.compute_types[2] == table.COMPUTE_TYPE_TBD  # float64 is never TF32
        layer.backward(device(g))
        layer(device(x))
        layer.backward(device(g))
        # forward, weight and input gradients (beta=1 too) in TF32; the bias's column sums never (32F: TF32
        # would round the summands)
        assert blas.computes[1:] == [77, 68, 77, 77] * 2
        assert blas.betas[1:] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    layer(device(x))
    assert table.compute_types[1] == table.COMPUTE_TYPE_DEFAULT
    layer.backward(device(g))
    assert blas.computes[-4:] == [68] * 4 and fake_cupy.cublas.calls == 0


def test_cupy_tf32_from_the_environment_is_left_alone_and_respected(fake_cupy, monkeypatch):
    monkeypatch.setenv("CUPY_TF32", "1")
    table = fake_cupy._core._routines_linalg
    layer, x, g = _layer_and_data(np.float32)
    layer.to("cuda")
    _two_backwards(layer, device(x), device(g))
    assert table.get_compute_type(np.float32) == table.COMPUTE_TYPE_TF32
    assert fake_cupy._axonhpc_cublas.computes == [77, 68, 77, 77] * 2  # the bias's column sums: 32F


def test_apply_matmul_precision_acts_before_any_module_call(fake_cupy):
    table = fake_cupy._core._routines_linalg
    with override(allow_tf32=True):
        nn.apply_matmul_precision()
        assert table.compute_types[1] == table.COMPUTE_TYPE_TF32
    nn.apply_matmul_precision()
    assert table.compute_types[1] == table.COMPUTE_TYPE_DEFAULT


def test_allow_tf32_with_a_cupy_that_has_no_compute_type_table_is_refused(fake_cupy):
    del fake_cupy._core
    layer, x, _ = _layer_and_data(np.float32)
    with override(allow_tf32=True):
        with pytest.raises(BackendUnavailableError, match="allow_tf32.*compute-type table.*14.0.0"):
            layer(x)
    layer(x)  # off again: nothing to set, nothing refused


def test_numpy_ignores_allow_tf32():
    layer, x, g = _layer_and_data(np.float32)
    want = _two_backwards(layer, x, g)[0].copy()
    layer.zero_grad(set_to_none=True)
    with override(allow_tf32=True):
        got = _two_backwards(layer, x, g)[0]
    assert np.array_equal(got, want)


def test_allow_tf32_reads_its_environment_variable():
    assert ax.settings.allow_tf32 is False
    assert Settings().load_environment({"AXONHPC_ALLOW_TF32": "1"}).allow_tf32 is True


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16"])
def test_column_sums_on_the_device_are_one_gemm_in_the_factors_compute_type(fake_cupy, dtype):
    from axonhpc.nn.matmul import column_sums

    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(3)
    a = rng.standard_normal((37, 11)).astype(dtype)
    blas = fake_cupy._axonhpc_cublas
    with override(allow_tf32=True):  # a column sum never runs in TF32: it would round the summands
        nn.apply_matmul_precision()
        low = np.dtype(dtype).itemsize == 2
        got = column_sums(device(a), np.float32 if low else None)
    assert blas.calls == 1 and blas.computes == [70 if np.dtype(dtype) == np.float64 else 68]
    want = a.astype(np.float64).sum(axis=0)
    assert host(got).dtype == (np.float32 if low else np.dtype(dtype)) and got.shape == (11,)
    eps = float(np.finfo(np.float32 if low else dtype).eps)
    np.testing.assert_allclose(host(got), want, rtol=0, atol=64 * eps * np.abs(a.astype(np.float64)).sum(axis=0).max())
    # what nn.gemm does not take, and the setting off: the array code itself
    assert column_sums(device(a)[:, ::2]).shape == (6,) and blas.calls == 1
    with override(fused_kernels=False):
        column_sums(device(a))
    assert blas.calls == 1
    assert host(column_sums(device(a[:0]))).tolist() == [0.0] * 11
