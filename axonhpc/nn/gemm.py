"""2-D matrix products of cupy arrays through cuBLAS itself, so that a CUDA graph can hold them.

[Note: products in a CUDA graph]
cupy refuses every cuBLAS call while a stream captures (cupy issue 6290), although cuBLAS supports capture
since CUDA 12.2; the first whole-step capture on an H100 failed there, at the first Linear. So the layers'
2-D products call ``cublasGemmEx`` themselves with cupy's handle on the current stream, eagerly and in a
capture alike, so a replayed step runs the very calls of the eager one. The compute type follows cupy's
table (``nn.matmul``'s [Note: TF32]). cuBLAS is column-major: a C-contiguous (r, c) array is to it the
(c, r) transpose, so ``C = A @ B`` is computed as ``C^T = B^T A^T``. The library is the already loaded
``libcublas.so.<major>`` (``RTLD_NOLOAD``: the copy cupy is bound to).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from typing import Any

import numpy as np

from .._dtypes import bfloat16_dtype
from ..errors import BackendUnavailableError

logger = logging.getLogger(__name__)

OP_N, OP_T = 0, 1
# cudaDataType_t
_DATA_TYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
# cublasComputeType_t
COMPUTE_32F, COMPUTE_64F, COMPUTE_32F_FAST_TF32 = 68, 70, 77
_GEMM_DEFAULT, _GEMM_DEFAULT_TENSOR_OP = -1, 99
_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
_POINTER_MODE_HOST = 0


class _Cublas:
    """``libcublas`` through ctypes: the three calls a product needs."""

    def __init__(self, cupy: Any):
        self._cupy = cupy
        handle = cupy.cuda.device.get_cublas_handle()  # cupy has loaded the library and made its handle
        lib = _loaded_cublas(_cublas_module(cupy).getVersion(handle) // 10000)
        vp, i = ctypes.c_void_p, ctypes.c_int
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes, self._set_stream.restype = [vp, vp], i
        self._pointer_mode = lib.cublasSetPointerMode_v2
        self._pointer_mode.argtypes, self._pointer_mode.restype = [vp, i], i
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self._gemm.restype = i
        # the algorithm cupy's own products ask for (cupy/_core/_routines_linalg.pyx): the tensor-op default
        # from compute capability 8.0 (7.0 for float16), else the default
        capability = int(cupy.cuda.Device().compute_capability)
        self._algo = {dtype: _GEMM_DEFAULT_TENSOR_OP if capability >= 80 or (capability >= 70 and dtype == 2)
                      else _GEMM_DEFAULT for dtype in _DATA_TYPES.values()}

    def gemm_ex(self, opa: int, opb: int, m: int, n: int, k: int, alpha: Any, a: Any, lda: int, b: Any, ldb: int,
                beta: Any, c: Any, ldc: int, compute: int) -> None:
        """``cublasGemmEx`` on cupy's handle and current stream, on the memory of cupy arrays ``a``, ``b``, ``c``.

        alpha and beta are 0-d numpy arrays of the compute type's scalar (host pointer mode).
        """
        cuda = self._cupy.cuda
        handle = cuda.device.get_cublas_handle()
        status = self._set_stream(handle, cuda.get_current_stream().ptr) or self._pointer_mode(handle, _POINTER_MODE_HOST)
        if status:
            _check("cublasSetStream/cublasSetPointerMode", status)
        codes = _codes()
        code_ab, code_c = codes[a.dtype], codes[c.dtype]
        _check("cublasGemmEx", self._gemm(handle, opa, opb, m, n, k, alpha.ctypes.data, a.data.ptr, code_ab, lda,
                                          b.data.ptr, code_ab, ldb, beta.ctypes.data, c.data.ptr, code_c, ldc,
                                          compute, self._algo[code_c]))


_CODES: dict = {}  # numpy dtype -> cudaDataType (a dict of dtypes: dtype.name is slow on a hot path)


def _codes() -> dict:
    if not _CODES:
        bfloat16 = bfloat16_dtype()
        for name, code in _DATA_TYPES.items():
            dtype = bfloat16 if name == "bfloat16" else np.dtype(name)
            if dtype is not None:  # bfloat16 without ml_dtypes: not a dtype here
                _CODES[dtype] = code
    return _CODES


def data_type(x: Any) -> int:
    """cuBLAS's ``cudaDataType`` of ``x``'s dtype."""
    return _codes()[x.dtype]


_ONE: dict = {}  # (scalar type, value) -> 0-d host array passed by address (never written)


def _scalar(kind: Any, value: float) -> Any:
    key = (kind, value)
    array = _ONE.get(key)
    if array is None:
        array = _ONE[key] = np.array(value, kind)
    return array


def _check(call: str, status: int) -> None:
    if status != 0:
        raise BackendUnavailableError(f"{call} returned cuBLAS status {status}")


def _cublas_module(cupy: Any) -> Any:
    """cupy's wrapper module of cuBLAS (``cupy.cuda.cublas``)."""
    module = getattr(cupy.cuda, "cublas", None)
    if module is None:
        from cupy_backends.cuda.libs import cublas as module  # type: ignore[no-redef]
    return module


def _loaded_cublas(major: int) -> Any:
    """The ``libcublas.so.<major>`` this process has loaded: the one a library linked against that name, as
    cupy's cuBLAS module is, was bound to (the first loaded under it); else the first one mapped."""
    try:
        return ctypes.CDLL(f"libcublas.so.{major}", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libcublas.so" in line]
    except OSError:
        paths = []
    if not paths:
        raise BackendUnavailableError(f"the layers' matrix products call cuBLAS themselves (see nn.gemm), but no "
                                      f"libcublas.so.{major} is loaded in this process after cupy made its handle")
    return ctypes.CDLL(paths[0])


_cached: tuple = (None, None)  # (the cupy module, its library): one cupy per process, a test's stand-in aside
_lock = threading.Lock()


def _library(cupy: Any) -> Any:
    """The cuBLAS of ``cupy`` (None where it could not be reached: products then go through cupy, and a
    CUDA graph cannot hold them; the reason is logged once)."""
    global _cached
    module, lib = _cached
    if module is not cupy:
        with _lock:
            module, lib = _cached
            if module is not cupy:
                lib = getattr(cupy, "_axonhpc_cublas", None)
                if lib is None:
                    try:
                        lib = _Cublas(cupy)
                    except (OSError, AttributeError, BackendUnavailableError) as exc:
                        logger.warning("the layers' products go through cupy's matmul, which a CUDA graph cannot "
                                       "hold: cuBLAS could not be called directly (%s: %s)", type(exc).__name__, exc)
                        lib = None
                _cached = (cupy, lib)
    return lib


def handles(a: Any, b: Any, cupy: Any) -> bool:
    """Whether ``gemm`` multiplies these: 2-D cupy arrays of one dtype it knows, each C- or F-contiguous
    (and cuBLAS reachable)."""
    if not (type(a) is cupy.ndarray and type(b) is cupy.ndarray and a.ndim == 2 and b.ndim == 2
            and a.dtype == b.dtype and a.dtype in _codes()):
        return False
    fa, fb = a.flags, b.flags
    return (fa.c_contiguous or fa.f_contiguous) and (fb.c_contiguous or fb.f_contiguous) and _library(cupy) is not None


def can_write(out_dtype: Any, dtype: Any) -> bool:
    """Whether ``gemm`` writes a product of ``dtype`` factors as ``out_dtype``: the same dtype, or float32 for
    16-bit factors (cuBLAS accumulates those in float32 either way)."""
    return out_dtype == dtype or (out_dtype == _FLOAT32 and dtype.itemsize == 2 and dtype in _codes())


def writes_into(out: Any, a: Any) -> bool:
    """Whether ``gemm`` can write a product of ``a``'s dtype into ``out`` (``can_write``, C- or F-contiguous)."""
    if not can_write(out.dtype, a.dtype) or out.ndim != 2:
        return False
    flags = out.flags
    return bool(flags.c_contiguous or flags.f_contiguous)


def _operand(x: Any) -> tuple:
    """(op, leading dimension) of ``x`` read as the transpose of cuBLAS's column-major matrix of it."""
    rows, cols = x.shape
    if x.flags.c_contiguous:
        return OP_N, max(1, cols)
    return OP_T, max(1, rows)


def gemm(a: Any, b: Any, cupy: Any, out: Any = None, beta: float = 0.0, tf32: bool = False) -> Any:
    """``out = a @ b + beta * out`` (a new C-contiguous array when ``out`` is None), by ``cublasGemmEx``.

    ``tf32``: float32 products in TF32 (``nn.matmul`` says whether it is in force).
    """
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = cupy.empty((m, n), dtype=a.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: beta * out (0 where out was not to be read: it may hold NaN)
        if beta == 0:
            out.fill(0)
        else:
            out *= out.dtype.type(beta)
        return out
    dtype = a.dtype
    if dtype == _FLOAT64:
        compute, scalar = COMPUTE_64F, np.float64
    else:
        compute, scalar = (COMPUTE_32F_FAST_TF32 if tf32 and dtype == _FLOAT32 else COMPUTE_32F), np.float32
    lib = _library(cupy)
    one, beta_ = _scalar(scalar, 1.0), _scalar(scalar, float(beta))
    if out.flags.c_contiguous:  # out^T = B^T A^T, column-major (n, m)
        opa, lda = _operand(b)
        opb, ldb = _operand(a)
        lib.gemm_ex(opa, opb, n, m, k, one, b, lda, a, ldb, beta_, out, max(1, n), compute)
    else:  # column-major out (m, n): out = A B with A, B read as the matrices themselves
        opa, lda = _operand(a.T)
        opb, ldb = _operand(b.T)
        lib.gemm_ex(opa, opb, m, n, k, one, a, lda, b, ldb, beta_, out, max(1, m), compute)
    return out


def module_of(x: Any) -> Any:
    """cupy, when ``x`` is one of its arrays; else None."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and type(x) is cupy.ndarray else None


__all__ = ["gemm", "handles", "can_write", "writes_into", "module_of"]
