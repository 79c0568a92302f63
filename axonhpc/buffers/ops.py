"""Flat buffers where a model's arrays live: host memory (the compiled buffers) or a GPU (cupy).

What a flat buffer is made of depends only on where the parameters live, so ``flat_ops_for``
chooses once per wrapper: ``HOST`` (numpy, the compiled nogil copies) or ``DeviceOps`` (cupy,
device-to-device copies; nothing passes through the host). Both offer the same operations, so a
strategy never branches on the array module. A model split between host and device is refused
before any message is sent.

[Note: gradients as bucket views]
``views(flat, shapes)`` returns arrays sharing ``flat``'s memory, back to back. DDP makes each
``p.grad`` such a view (PyTorch's ``gradient_as_bucket_view``), so a bucket is all-reduced where
backward wrote it, with no pack copy, on host and device alike.
"""
from __future__ import annotations

import importlib
from typing import Any, List, Sequence, Tuple

import numpy as np

from .._dtypes import check_array, is_cupy_array, to_host
from .._ext import _pack
from ..errors import ConfigurationError, ShapeError, UnsupportedDtypeError


class FlatOps:
    """Flat-buffer operations for one kind of memory.

    Attributes:
        name: "host" or "device".
        xp: the array module of the buffers (numpy or cupy).
        host_memory: the buffers are host memory, so a node's shared-memory window can hold them.
    """

    name = "abstract"
    xp: Any = np
    host_memory = False

    def empty(self, numel: int, dtype: Any) -> Any:
        """An uninitialised 1-D buffer of ``numel`` elements."""
        return self.xp.empty(int(numel), dtype=np.dtype(dtype))

    def zeros(self, numel: int, dtype: Any) -> Any:
        """A zeroed 1-D buffer of ``numel`` elements."""
        return self.xp.zeros(int(numel), dtype=np.dtype(dtype))

    def owns(self, array: Any) -> bool:
        """True if ``array`` lives in this kind of memory."""
        raise NotImplementedError

    def pack(self, arrays: Sequence[Any], out: Any = None) -> Any:
        """Copy ``arrays`` (one dtype) one after another into ``out`` (a new buffer if None)."""
        raise NotImplementedError

    def unpack(self, flat: Any, arrays: Sequence[Any]) -> None:
        """Copy consecutive runs of ``flat`` into ``arrays``, in place."""
        raise NotImplementedError

    def pack_padded(self, arrays: Sequence[Any], out: Any, numel: int) -> Any:
        """Copy ``arrays`` into ``out[:numel]`` and zero ``out[numel:]`` (FSDP's padded flat parameter)."""
        self.pack(arrays, out=out[:numel])
        out[numel:] = 0
        return out

    def views(self, flat: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        """Arrays of ``shapes`` sharing ``flat``'s memory, back to back (see the note)."""
        out, offset = [], 0
        for shape in shapes:
            n = int(np.prod(shape, dtype=np.int64))
            out.append(flat[offset:offset + n].reshape(shape))
            offset += n
        if offset > flat.size:
            raise ShapeError(f"views: shapes hold {offset} elements but the flat buffer has {flat.size}")
        return out

    def to_host(self, array: Any) -> np.ndarray:
        """``array`` in host memory (a copy when it is on a device; itself when it is already there)."""
        return to_host(array)

    def from_host(self, array: Any) -> Any:
        """A host array in this kind of memory (itself for the host)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<flat buffers: {self.name}>"


class HostOps(FlatOps):
    """numpy buffers with the compiled nogil copies."""

    name = "host"
    xp = np
    host_memory = True

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def pack(self, arrays: Sequence[Any], out: Any = None) -> Any:
        return _pack.pack(arrays, out=out)

    def unpack(self, flat: Any, arrays: Sequence[Any]) -> None:
        _pack.unpack(flat, arrays)

    def from_host(self, array: Any) -> Any:
        return np.asarray(array)


class DeviceOps(FlatOps):
    """cupy buffers; copies are device-to-device on the current stream."""

    name = "device"

    def __init__(self, cupy: Any):
        self.xp = cupy

    def owns(self, array: Any) -> bool:
        return isinstance(array, self.xp.ndarray)

    def _checked(self, arrays: Sequence[Any], what: str, writable: bool) -> Tuple[Any, int]:
        dtype, total = None, 0
        for i, a in enumerate(arrays):
            name = f"{what}[{i}]"
            if not self.owns(a):
                raise UnsupportedDtypeError(f"{name} is a {type(a).__module__}.{type(a).__name__}; these flat "
                                            "buffers are on the device, so every array must be a cupy array")
            check_array(a, name, writable=writable)
            if dtype is None:
                dtype = a.dtype
            elif a.dtype != dtype:
                raise UnsupportedDtypeError(f"{name} has dtype {a.dtype} but {what}[0] has {dtype}; all arrays of "
                                            "one pack or unpack share one dtype")
            total += int(a.size)
        return dtype, total

    def _flat(self, flat: Any, dtype: Any, numel: int, what: str, writable: bool) -> None:
        if not self.owns(flat):
            raise UnsupportedDtypeError(f"{what} is a {type(flat).__module__}.{type(flat).__name__}, not a cupy array")
        check_array(flat, what, writable=writable)
        if dtype is not None and flat.dtype != dtype:
            raise UnsupportedDtypeError(f"{what} has dtype {flat.dtype} but the arrays have {dtype}")
        if flat.ndim != 1 or flat.size != numel:
            raise ShapeError(f"{what} has shape {flat.shape} but the arrays hold {numel} elements; "
                             f"it must be 1-D of shape ({numel},)")

    def pack(self, arrays: Sequence[Any], out: Any = None) -> Any:
        arrays = list(arrays)
        dtype, total = self._checked(arrays, "pack: arrays", writable=False)
        if out is None:
            if dtype is None:
                raise UnsupportedDtypeError("pack: no arrays and no out= buffer: the dtype is unknown")
            out = self.empty(total, dtype)
        else:
            self._flat(out, dtype, total, "pack: out", writable=True)
        offset = 0
        for a in arrays:
            out[offset:offset + a.size] = a.reshape(-1)
            offset += a.size
        return out

    def unpack(self, flat: Any, arrays: Sequence[Any]) -> None:
        arrays = list(arrays)
        dtype, total = self._checked(arrays, "unpack: outs", writable=True)
        self._flat(flat, dtype, total, "unpack: flat", writable=False)
        offset = 0
        for a in arrays:
            a[...] = flat[offset:offset + a.size].reshape(a.shape)
            offset += a.size

    def from_host(self, array: Any) -> Any:
        return self.xp.asarray(array)


HOST = HostOps()


def device_ops() -> DeviceOps:
    """The device implementation over cupy (called once device arrays exist, so cupy is importable)."""
    return DeviceOps(importlib.import_module("cupy"))


def flat_ops_for(arrays: Sequence[Any], names: Sequence[str] = (), what: str = "model") -> FlatOps:
    """The flat-buffer operations for arrays that all live in one kind of memory.

    ``names`` and ``what`` ("DDP", "FSDP") name the arrays and their owner in the message.

    Raises:
        ConfigurationError: no arrays, or some on the host and some on a device
            (names of both kinds in the message).
    """
    arrays = list(arrays)
    if not arrays:
        raise ConfigurationError(f"{what}: no arrays to hold in flat buffers")
    names = list(names) or [f"#{i}" for i in range(len(arrays))]
    device = [is_cupy_array(a) for a in arrays]
    if all(device):
        return device_ops()
    if not any(device):
        return HOST
    on_device = [n for n, d in zip(names, device) if d]
    on_host = [n for n, d in zip(names, device) if not d]
    raise ConfigurationError(
        f"{what}: the arrays live in two kinds of memory: on the device {on_device[:5]}"
        f"{' ...' if len(on_device) > 5 else ''}, on the host {on_host[:5]}{' ...' if len(on_host) > 5 else ''}; "
        "move the whole model with model.to('cuda') or model.to('cpu') before wrapping it"
    )


__all__ = ["FlatOps", "HostOps", "DeviceOps", "HOST", "device_ops", "flat_ops_for"]
