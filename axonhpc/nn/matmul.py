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
arrays of float32 or float64, ``cupy.cublas.gemm`` with ``beta=1`` adds the
product into the gradient inside the GEMM, with no temporary: what a
framework's fused weight-gradient GEMM does. cupy's ``gemm`` issues the
classic ``sgemm``, which ignores the TF32 table, so while TF32 is on (the
settings ask for it, or ``CUPY_TF32=1`` does) the product goes through
``matmul`` (which honours it) and an add instead.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError
from ..settings import settings

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
    cupy = sys.modules.get("cupy")
    if (cupy is not None and type(out) is cupy.ndarray and out.dtype.char in "fd"
            and a.dtype == out.dtype and b.dtype == out.dtype
            and (out.flags.c_contiguous or out.flags.f_contiguous) and not _tf32_in_force(cupy)):
        from cupy import cublas
        cublas.gemm("N", "N", a, b, out=out, alpha=1.0, beta=1.0)
        return
    out += a @ b


__all__ = ["sync_matmul_precision", "apply_matmul_precision", "add_product"]
