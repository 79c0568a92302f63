"""How the layers' matrix products run: TF32 on GPUs, and products added straight into gradients.

[Note: TF32]
cupy picks the cuBLAS compute type of a float32 product from a process-wide
table (``cupy._core._routines_linalg.set_compute_type``) that it reads at
every GEMM; unset, it takes TF32 only when the environment says
``CUPY_TF32=1``. axonhpc's switch is ``ax.settings.allow_tf32`` (off by
default, as in PyTorch). ``sync_matmul_precision`` copies it into cupy's
table whenever the settings changed: every ``nn`` module call runs it (one
integer comparison when nothing changed), so the next forward after
``ax.settings.allow_tf32 = True`` computes in TF32, and so does every other
cupy float32 product in the process from then on: the table is global.
Turning the setting off again restores cupy's default. It is never written
while the setting is off and was never on, so ``CUPY_TF32=1`` alone keeps
working. numpy has no TF32 and ignores the setting.

[Note: products into gradients]
A weight gradient is a product, ``grad += a @ b``. numpy computes ``a @ b``
into a temporary and adds it: one more pass over the gradient. For cupy
arrays of a floating dtype ``nn.gemm`` calls ``cublasGemmEx`` with
``beta=1``, which adds the product into the gradient inside the GEMM, with
no temporary: what a framework's fused weight-gradient GEMM does. Its
compute type follows the table above, so TF32 applies there too.

[Note: the layers' 2-D products]
``product_2d`` is how the layers multiply: on cupy arrays through
``nn.gemm`` (cuBLAS called directly, so a CUDA graph can hold the product;
see [Note: products in a CUDA graph] there), elsewhere with ``@``.
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

    Cheap when nothing changed; does nothing while cupy is not imported.

    Raises:
        BackendUnavailableError: TF32 asked for, and the installed cupy has no
            compute-type table to set.
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
    """Apply ``settings.allow_tf32`` to cupy now (``nn`` modules do it on their next call).

    For code that multiplies cupy matrices itself, before any module call.

    Raises:
        BackendUnavailableError: as ``sync_matmul_precision``.
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
    """``out += a @ b`` for 2-D arrays, inside the GEMM where the array library allows it.

    Args:
        out: the accumulator (a gradient), shape (a.shape[0], b.shape[1]).
        a, b: the factors, of ``out``'s array library.
    """
    cupy = gemm.module_of(out)
    if cupy is not None and gemm.handles(a, b, cupy) and gemm.writes_into(out, a):
        gemm.gemm(a, b, cupy, out=out, beta=1.0, tf32=_tf32_in_force(cupy))
        return
    out += a @ b


def product_2d(a: Any, b: Any, dtype: Any = None) -> Any:
    """``a @ b`` for ``a`` (..., k) and a matrix ``b`` (k, n): through ``nn.gemm`` on cupy arrays it takes.

    An ``a`` of more dimensions is multiplied as the 2-D (rows, k) view of it when C-contiguous.
    Anything ``nn.gemm`` does not take (integer arrays, strided views) goes to ``@``. ``dtype``
    (2-D only): the result's, written by the GEMM itself where it can (float32 from 16-bit factors),
    so the product is what ``add_product`` adds into a zero gradient.
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


__all__ = ["sync_matmul_precision", "apply_matmul_precision", "add_product", "product_2d"]
