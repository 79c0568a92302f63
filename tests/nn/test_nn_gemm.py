"""``nn.gemm``: the layers' 2-D products through ``cublasGemmEx`` itself, which a CUDA graph can hold.

On the strict stand-in, ``cupy._axonhpc_cublas`` reads and writes the memory at
the arrays' addresses column-major with the leading dimensions given, as
cuBLAS does, so a wrong transpose flag or leading dimension gives a wrong
product here. The GPU tests run the same products and a captured one on a
device (scripts/gpu-check.sh).
"""
import importlib
import sys

import numpy as np
import pytest

from axonhpc.backends.devices import device_facts
from axonhpc.nn import gemm
from axonhpc.nn.matmul import add_product, product_2d
from support.fake_cuda import FakeCupy
from support.strict_cupy import StrictCupy, device, host


@pytest.fixture
def cp(monkeypatch):
    module = StrictCupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def _layouts(a):
    """``a`` as a C-contiguous array and as an F-contiguous one, of the same values."""
    return {"C": a, "F": np.asfortranarray(a)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("order_a", ["C", "F"])
@pytest.mark.parametrize("order_b", ["C", "F"])
@pytest.mark.parametrize("order_out", ["C", "F"])
def test_every_layout_gives_the_product(cp, dtype, order_a, order_b, order_out):
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s).astype(dtype) for s in ((5, 3), (3, 4), (5, 4)))
    da, db = device(_layouts(a)[order_a]), device(_layouts(b)[order_b])
    assert da.flags.c_contiguous == (order_a == "C") and gemm.handles(da, db, cp)
    out = device(_layouts(c)[order_out])
    gemm.gemm(da, db, cp, out=out, beta=1.0)
    rtol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(host(out), a @ b + c, rtol=rtol)
    fresh = gemm.gemm(da, db, cp)
    assert fresh.flags.c_contiguous and fresh.dtype == dtype
    np.testing.assert_allclose(host(fresh), a @ b, rtol=rtol)


def test_vectors_and_empty_shapes(cp):
    rng = np.random.default_rng(1)
    for m, k, n in ((1, 4, 3), (4, 1, 3), (4, 3, 1), (1, 1, 1)):
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        np.testing.assert_allclose(host(gemm.gemm(device(a), device(b), cp)), a @ b, rtol=1e-14)
        np.testing.assert_allclose(host(gemm.gemm(device(a).T.T, device(np.asfortranarray(b)), cp)), a @ b,
                                   rtol=1e-14)
    out = device(np.full((2, 3), 2.0))
    gemm.gemm(device(np.ones((2, 0))), device(np.ones((0, 3))), cp, out=out, beta=0.5)  # k = 0: beta * out
    assert host(out).tolist() == [[1.0] * 3] * 2
    assert gemm.gemm(device(np.ones((0, 2))), device(np.ones((2, 3))), cp).shape == (0, 3)
    fresh = gemm.gemm(device(np.ones((2, 0))), device(np.ones((0, 3))), cp)  # empty sums: zeros, not NaN
    assert host(fresh).tolist() == [[0.0] * 3] * 2
    assert cp._axonhpc_cublas.calls == 8


def test_half_factors_accumulate_into_float32(cp):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 5)).astype(np.float16), rng.standard_normal((5, 4)).astype(np.float16)
    out = device(np.ones((6, 4), np.float32))
    assert gemm.writes_into(out, device(a)) and not gemm.writes_into(device(np.ones((6, 4))), device(a))
    add_product(out, device(a), device(b))
    want = a.astype(np.float32) @ b.astype(np.float32) + 1
    np.testing.assert_allclose(host(out), want, rtol=1e-6)  # not rounded to float16 on the way
    first = product_2d(device(a), device(b), np.float32)
    assert first.dtype == np.float32
    np.testing.assert_allclose(host(first), want - 1, rtol=1e-6)


def test_what_it_does_not_take_goes_to_matmul(cp):
    a = device(np.arange(12.0).reshape(3, 4))
    strided = a[:, ::2]
    assert not gemm.handles(strided, device(np.ones((2, 2))), cp)
    assert not gemm.handles(device(np.ones((2, 2), np.int64)), device(np.ones((2, 2), np.int64)), cp)
    np.testing.assert_array_equal(host(product_2d(strided, device(np.eye(2)))), host(strided))
    batched = device(np.arange(24.0).reshape(2, 3, 4))
    got = product_2d(batched, device(np.ones((4, 2))))
    assert got.shape == (2, 3, 2) and cp._axonhpc_cublas.calls == 1  # C-contiguous stack: one 2-D product
    np.testing.assert_array_equal(host(got), np.arange(24.0).reshape(2, 3, 4) @ np.ones((4, 2)))
    assert product_2d(np.ones((2, 3)), np.ones((3, 2))).tolist() == [[3.0, 3.0]] * 2  # numpy: plain @


def test_a_captured_product_replays_on_the_arrays_as_they_are_then(monkeypatch):
    """The graph a layer's product goes into (cupy refuses its own matmul there, as cupy 14 does)."""
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    a, b = device(np.ones((2, 3))), device(np.full((3, 2), 2.0))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match="cuBLAS API during stream capture"):
            a @ b
        out = product_2d(a, b)
        graph = stream.end_capture()
    b[...] = 3.0
    graph.launch()
    assert host(out).tolist() == [[9.0, 9.0]] * 2


# -- on a GPU (bash scripts/gpu-check.sh) ------------------------------------------------------------------

_cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_the_products_of_cublas_itself_match_cupys_on_a_gpu(dtype):
    cp = _cupy
    rng = np.random.default_rng(3)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2}[dtype]
    for order_a in "CF":
        for order_b in "CF":
            a = cp.asarray(rng.standard_normal((65, 33)), dtype=dtype, order=order_a)
            b = cp.asarray(rng.standard_normal((33, 17)), dtype=dtype, order=order_b)
            for order_out in "CF":
                out = cp.asarray(rng.standard_normal((65, 17)), dtype=dtype, order=order_out)
                want = (a.astype(cp.float64) @ b.astype(cp.float64) + out.astype(cp.float64)).get()
                gemm.gemm(a, b, cp, out=out, beta=1.0)
                np.testing.assert_allclose(out.astype(cp.float64).get(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
def test_a_captured_product_replays_on_a_gpu():
    cp = _cupy
    a, b = cp.ones((64, 32), cp.float32), cp.full((32, 16), 2.0, cp.float32)
    eager = product_2d(a, b)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = product_2d(a, b)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert bool((out == eager).all())
    b[...] = 3.0
    graph.launch(stream)
    stream.synchronize()
    assert float(out[0, 0]) == 96.0


@pytest.mark.gpu
@pytest.mark.skipif(_cupy is None, reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_column_sums_and_a_bfloat16_relu_on_a_gpu(dtype):
    from axonhpc import nn
    from axonhpc.nn.matmul import column_sums

    cp = _cupy
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    low = np.dtype(dtype).itemsize == 2
    a = np.random.default_rng(5).standard_normal((2048, 96)).astype(dtype)
    got = column_sums(cp.asarray(a), np.float32 if low else None).get()
    exact = a.astype(np.float64)
    eps = float(np.finfo(np.float32 if low else dtype).eps)
    assert got.dtype == (np.float32 if low else np.dtype(dtype))
    np.testing.assert_allclose(got, exact.sum(axis=0), rtol=0, atol=64 * eps * np.abs(exact).sum(axis=0).max())
    if np.dtype(dtype).name == "bfloat16":  # ReLU keeps bfloat16 (cupy's where would not)
        relu = nn.ReLU()
        y = relu(cp.asarray(a))
        assert y.dtype == a.dtype and np.array_equal(y.get().view(np.uint16), np.where(a < 0, 0, a).view(np.uint16))
        assert relu.backward(cp.asarray(a)).dtype == a.dtype
