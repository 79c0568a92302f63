"""How the layers' matrix products run: TF32 on GPUs, and products added straight into gradients.

[Note: TF32]
cupy picks a float32 product's cuBLAS compute type from a process-wide table it reads at every GEMM (TF32
only with ``CUPY_TF32=1`` when unset). ``sync_matmul_precision`` copies ``ax.settings.allow_tf32`` into that
table whenever the setting changed; every ``nn`` call runs it (one integer comparison), so the next forward
follows the setting, and so does every other cupy float32 product in the process: the table is global. Turning
the setting off restores cupy's default; the table is never written while the setting is off and was never on,
so ``CUPY_TF32=1`` alone keeps working.

[Note: products into gradients]
A weight gradient is ``grad += a @ b``; numpy computes ``a @ b`` into a temporary and adds it, one more pass
over the gradient. On cupy ``nn.gemm`` calls ``cublasGemmEx`` with ``beta=1``, adding the product inside the
GEMM with no temporary, as frameworks' fused weight-gradient GEMMs do. ``product_2d`` likewise goes through
``nn.gemm`` on cupy, so a CUDA graph can hold the product.

[Note: column sums by GEMM]
A bias gradient is the column sum of a (rows, width) gradient. cupy reduces over the leading axis with each
column read down its stride: in an H200's kernel trace a (2048, 4096) float32 sum took about 50 us
of device time where PyTorch's took 17, and the GPT step's 34 sums of (2048, 768) and (2048, 3072) averaged 29.
``column_sums`` computes ``ones(1, rows) @ a`` by ``cublasGemmEx`` instead (about 6 us for (2048, 4096) in
bfloat16), with the factors' own compute type (never TF32, which would round the summands): a product by one is
exact, so the result is the same sum in another order, as PyTorch's reduction also sums in its own order.
16-bit gradients are summed into a float32 output inside the GEMM. The ones row is made afresh by each call
(one small fill, on the stream and in the capture the GEMM runs in), rather than kept: a kept one would be
ordered with only the stream that filled it. That costs host time: a step bound by the host pays a few
microseconds a sum (docs/performance.md has the A/B). Host arrays, and everything with
``settings.fused_kernels`` off, keep ``a.sum(axis=0)``.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError
from ..settings import settings
from . import gemm

# cupy's compute types (cupy/_core/_routines_linalg.pxd): its default, and TF32 for float32.
_COMPUTE_TYPE_DEFAULT = "COMPUTE_TYPE_DEFAULT"
_COMPUTE_TYPE_TF32 = "COMPUTE_TYPE_TF32"


class _State:
    revision = -1      # settings.revision last synchronised
    module = None      # the cupy module it was synchronised with
    cupy_tf32 = False  # whether we set that module's float32 compute type to TF32


def _routines(cupy: Any) -> Any:
    """cupy's module holding the compute-type table (``cupy._core._routines_linalg``), or None."""
    routines = getattr(getattr(cupy, "_core", None), "_routines_linalg", None)
    return routines if hasattr(routines, "set_compute_type") else None


def sync_matmul_precision() -> None:
    """Make cupy's float32 products follow ``settings.allow_tf32`` (see the module note).

    Cheap when nothing changed; does nothing while cupy is not imported. BackendUnavailableError if TF32 is asked
    for and the installed cupy has no compute-type table.
    """
    if _State.revision == settings.revision:
        return
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return  # checked again at the next call: cupy may be imported later
    if cupy is not _State.module:  # a fresh table (a test's stand-in replaced by another)
        _State.module, _State.cupy_tf32 = cupy, False
    want = bool(settings.allow_tf32)
    if want != _State.cupy_tf32:
        routines = _routines(cupy)
        if routines is None:
            raise BackendUnavailableError(
                f"settings.allow_tf32 needs cupy's compute-type table (cupy._core._routines_linalg."
                f"set_compute_type), which cupy {getattr(cupy, '__version__', '?')} does not have")
        kind = _COMPUTE_TYPE_TF32 if want else _COMPUTE_TYPE_DEFAULT
        routines.set_compute_type(np.float32, getattr(routines, kind))
        _State.cupy_tf32 = want
    _State.revision = settings.revision


def apply_matmul_precision() -> None:
    """Apply ``settings.allow_tf32`` to cupy now, for code that multiplies cupy matrices before any module call.

    Raises BackendUnavailableError as ``sync_matmul_precision``.
    """
    _State.revision = -1
    sync_matmul_precision()


def _tf32_in_force(cupy: Any) -> bool:
    """Whether cupy's float32 products run in TF32 now (set by us, or by ``CUPY_TF32=1``)."""
    if _State.cupy_tf32 and _State.module is cupy:
        return True
    routines = _routines(cupy)
    return routines is not None and routines.get_compute_type(np.float32) == getattr(routines, _COMPUTE_TYPE_TF32)


def add_product(out: Any, a: Any, b: Any) -> None:
    """``out += a @ b`` for 2-D arrays, inside the GEMM where the array library allows it."""
    cupy = gemm.module_of(out)
    if cupy is not None and gemm.handles(a, b, cupy) and gemm.writes_into(out, a):
        gemm.gemm(a, b, cupy, out=out, beta=1.0, tf32=_tf32_in_force(cupy))
        return
    out += a @ b


def product_2d(a: Any, b: Any, dtype: Any = None) -> Any:
    """``a @ b`` for ``a`` (..., k) and a matrix ``b`` (k, n): through ``nn.gemm`` on cupy arrays it takes.

    A C-contiguous ``a`` of more dimensions is multiplied as its 2-D view; what ``nn.gemm`` does not take goes to
    ``@``. ``dtype`` (2-D only) is the result's, written by the GEMM itself where it can (float32 from 16-bit
    factors), so the product is what ``add_product`` adds into a zero gradient.
    """
    cupy = gemm.module_of(a)
    if cupy is not None and b.ndim == 2 and a.ndim >= 2:
        flat = a.reshape(-1, a.shape[-1]) if a.ndim > 2 and a.flags.c_contiguous else a
        if gemm.handles(flat, b, cupy):
            want = None if dtype is None else np.dtype(dtype)
            into = (cupy.empty((a.shape[0], b.shape[1]), dtype=want)
                    if want is not None and want != a.dtype and flat is a and gemm.can_write(want, a.dtype) else None)
            out = gemm.gemm(flat, b, cupy, out=into, tf32=_tf32_in_force(cupy))
            out = out if flat is a else out.reshape(a.shape[:-1] + (b.shape[-1],))
            return out if want is None or out.dtype == want else out.astype(want)
    if a.ndim > 2 and a.flags.c_contiguous and b.ndim == 2:
        return (a.reshape(-1, a.shape[-1]) @ b).reshape(a.shape[:-1] + (b.shape[-1],))
    return a @ b


def column_sums(a: Any, dtype: Any = None) -> Any:
    """``a.sum(axis=0, dtype=dtype)`` of a 2-D array: on a cupy array ``nn.gemm`` takes, one GEMM with a row of
    ones (see [Note: column sums by GEMM]); ``dtype`` float32 for 16-bit ``a`` is written by the GEMM itself."""
    cupy = gemm.module_of(a)
    if cupy is not None and a.ndim == 2 and a.shape[0] > 0 and settings.fused_kernels:
        want = a.dtype if dtype is None else np.dtype(dtype)
        if gemm.can_write(want, a.dtype) and gemm.handles(a, a, cupy):
            out = cupy.empty((1, a.shape[1]), dtype=want)
            gemm.gemm(cupy.ones((1, a.shape[0]), dtype=a.dtype), a, cupy, out=out)
            return out.reshape(a.shape[1])
    return a.sum(axis=0) if dtype is None else a.sum(axis=0, dtype=dtype)


__all__ = ["sync_matmul_precision", "apply_matmul_precision", "add_product", "product_2d", "column_sums"]
