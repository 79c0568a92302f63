"""Supported dtypes, array-module dispatch (numpy or cupy) and the local buffer checks every collective runs first.

Arrays are numpy arrays, or cupy arrays where cupy exists. Nothing here
imports cupy or ml_dtypes at package import: both are looked up lazily, so
``import axonhpc`` works without the optional extras.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import (
    ConfigurationError,
    NonContiguousBufferError,
    ReadOnlyBufferError,
    UnsupportedDtypeError,
)

_BASE_DTYPES: Tuple[np.dtype, ...] = tuple(
    np.dtype(name) for name in ("float16", "float32", "float64", "int32", "int64", "uint8")
)


@functools.lru_cache(maxsize=None)
def bfloat16_dtype():
    """numpy dtype of bfloat16 from ml_dtypes, or None if it is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@functools.lru_cache(maxsize=None)
def supported_dtypes() -> Tuple[np.dtype, ...]:
    """The dtypes the collectives accept on this installation."""
    bf16 = bfloat16_dtype()
    return _BASE_DTYPES + ((bf16,) if bf16 is not None else ())


@functools.lru_cache(maxsize=None)
def dtype_places() -> Dict[np.dtype, int]:
    """dtype -> its place in ``supported_dtypes()``: the code a message or header carries for it."""
    return {dtype: k for k, dtype in enumerate(supported_dtypes())}


@functools.lru_cache(maxsize=None)
def _supported_set() -> frozenset:
    return frozenset(supported_dtypes())


@functools.lru_cache(maxsize=None)
def _low_precision_set() -> frozenset:
    bf16 = bfloat16_dtype()
    return frozenset([np.dtype(np.float16)] + ([bf16] if bf16 is not None else []))


def is_supported(dtype: np.dtype) -> bool:
    """True for a dtype the collectives take (``supported_dtypes()``)."""
    return dtype in _supported_set()


def is_low_precision_float(dtype: np.dtype) -> bool:
    """float16 or bfloat16: MPI has no reduction for these, so they are widened."""
    return dtype in _low_precision_set()


def is_floating(dtype: Any) -> bool:
    """True for floating dtypes, the 16-bit ones of ml_dtypes included (what mixed precision casts)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or is_low_precision_float(dtype)


def floating_dtype(value: Any, what: str, expected: str = "a floating dtype") -> np.dtype:
    """``value`` (a dtype or its name; "bfloat16" from ml_dtypes) as a floating dtype; ConfigurationError otherwise."""
    if isinstance(value, str) and value.lower() == "bfloat16":
        bf16 = bfloat16_dtype()
        if bf16 is None:
            raise ConfigurationError(f"{what}=bfloat16 needs ml_dtypes (pip install axonhpc[bf16])")
        return bf16
    try:
        dtype = np.dtype(value)
    except TypeError as exc:
        raise ConfigurationError(f"{what} must be {expected}, got {value!r}") from exc
    if not is_floating(dtype):
        raise ConfigurationError(f"{what} must be {expected}, got {dtype}")
    return dtype


def is_integer(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "iu"


def is_cupy_array(x: Any) -> bool:
    """True for a cupy ndarray, without importing cupy when it is not loaded."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(x: Any):
    """numpy for host arrays, cupy for device arrays (array-module dispatch)."""
    if is_cupy_array(x):
        return sys.modules["cupy"]
    return np


def dtype_groups(items: Iterable[Any], array_of: Optional[Callable[[Any], Any]] = None) -> List[List[Any]]:
    """``items`` in groups of one dtype and one array library (numpy or cupy), in the order each first appears.

    ``array_of(item)`` is the item's array (the item itself when None): what packs into one flat
    message, or one flat shard, together.
    """
    groups: Dict[Tuple[str, type], List[Any]] = {}
    for item in items:
        array = item if array_of is None else array_of(item)
        groups.setdefault((np.dtype(array.dtype).str, type(array)), []).append(item)
    return list(groups.values())


def finite_flags(arrays: Any, verdicts: Sequence[Any] = ()) -> List[bool]:
    """Whether each array (and each of ``verdicts``, after them) is all finite, with one device read for all."""
    verdicts = [array_module(a).isfinite(a).all() if a.size else True for a in arrays] + list(verdicts)
    device = [v for v in verdicts if is_cupy_array(v)]
    read = iter(sys.modules["cupy"].stack(device).get().tolist() if device else ())
    return [bool(next(read)) if is_cupy_array(v) else bool(v) for v in verdicts]


def to_host(x: Any) -> Any:
    """``x`` in host memory: a numpy copy of a cupy array (``.get()``), anything else as it is."""
    return x.get() if is_cupy_array(x) else x


def _describe(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__name__} of shape {getattr(x, 'shape', '?')}"


def check_array(x: Any, what: str, *, writable: bool = False) -> None:
    """Raise a clear error, naming ``x`` as ``what``, if ``x`` cannot be handed to a collective.

    Raises:
        UnsupportedDtypeError: not an array, or a dtype outside ``supported_dtypes()``.
        NonContiguousBufferError: not C-contiguous.
        ReadOnlyBufferError: ``writable`` and the array is read-only.
    """
    if not (isinstance(x, np.ndarray) or is_cupy_array(x)):
        raise UnsupportedDtypeError(
            f"{what} must be a numpy or cupy array, got {type(x).__module__}.{type(x).__name__}"
        )
    if x.dtype not in _supported_set():
        names = ", ".join(str(d) for d in supported_dtypes())
        hint = "" if bfloat16_dtype() is not None else " (bfloat16 needs ml_dtypes: pip install axonhpc[bf16])"
        raise UnsupportedDtypeError(f"{what} has dtype {x.dtype}, which is not supported; use one of {names}{hint}")
    flags = x.flags
    if not flags.c_contiguous:
        raise NonContiguousBufferError(
            f"{what} ({_describe(x)}, strides {x.strides}) is not C-contiguous; "
            "pass numpy.ascontiguousarray(x) and copy the result back"
        )
    # cupy arrays have no read-only state (their flags have no ``writeable``).
    if writable and isinstance(x, np.ndarray) and not flags.writeable:
        raise ReadOnlyBufferError(f"{what} ({_describe(x)}) is read-only but the operation writes into it")


__all__ = [
    "supported_dtypes",
    "dtype_places",
    "bfloat16_dtype",
    "is_low_precision_float",
    "is_integer",
    "is_cupy_array",
    "array_module",
    "dtype_groups",
    "finite_flags",
    "to_host",
    "check_array",
]
