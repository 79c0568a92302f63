"""Device elementwise kernels, built once and kept: what ``optim.fused`` and ``nn.kernels`` share.

[Note: exact fused kernels]
A fused kernel does in one pass what the array code does one kernel at a time, in the same order and dtype,
with Python floats rounded as numpy rounds them. Compiled with ``--fmad=false`` and IEEE division and sqrt,
it matches the array code bit for bit on the same GPU. Bodies are in the common part of CUDA C++ and C99,
so the tests' stand-in compiles them as C on the host, where arithmetic rounds exactly as on a GPU.

[Note: multi-tensor kernels]
``multi_tensor`` makes one launch over a list of arrays (as PyTorch's ``multi_tensor_apply``): the thread
of element ``i`` finds its array by a binary search of ``starts`` and runs the single-array body, so the
result is bit for bit. ``TensorTables`` keeps the address tables, so a step copies nothing to the device.

[Note: scalars in device memory]
A CUDA graph replays a kernel with its captured arguments, so ``multi_tensor(..., device_scalars=True)``
reads the scalars from a small device array that ``fill`` writes outside the graph.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from .._dtypes import array_module
from ..errors import InvalidArgumentError, ShapeError
from . import capture

# Compile options: no multiply-add contraction, so every operation rounds as the array code does.
OPTIONS = ("--fmad=false",)
# The dtypes the kernels are written for; 16-bit floats keep the array code.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_cache: Dict[Tuple[Any, str, Tuple[Any, ...]], Any] = {}  # (array module, name, variant) -> kernel
_lock = threading.Lock()

Source = Tuple[str, str, str, str]  # in_params, out_params, operation, preamble


def has_kernels(xp: Any) -> bool:
    """Whether ``xp`` (an array module) compiles elementwise kernels: cupy does, numpy does not."""
    return xp is not np and hasattr(xp, "ElementwiseKernel")


def serves(x: Any) -> bool:
    """Whether the kernels serve array ``x``: a cupy array of float32 or float64 (a type test, no device work)."""
    return np.dtype(x.dtype) in KERNEL_DTYPES and has_kernels(array_module(x))


def elementwise(xp: Any, name: str, variant: Tuple[Any, ...], build: Callable[..., Source]) -> Any:
    """The ``ElementwiseKernel`` ``axonhpc_<name>`` of ``build(*variant)``, built on first use and kept per variant."""
    def make() -> Any:
        in_params, out_params, body, preamble = build(*variant)
        return xp.ElementwiseKernel(in_params, out_params, body, f"axonhpc_{name}", preamble=preamble, options=OPTIONS)

    return _kept(xp, name, variant, make)


ReductionSource = Tuple[str, str, str, str, str, str, str]
# in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, reduce_type


def reduction(xp: Any, name: str, variant: Tuple[Any, ...], build: Callable[..., ReductionSource]) -> Any:
    """The ``ReductionKernel`` ``axonhpc_<name>`` of ``build(*variant)``, kept; it folds in cupy's order, so not bit for bit."""
    def make() -> Any:
        in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, reduce_type = build(*variant)
        return xp.ReductionKernel(in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                                  f"axonhpc_{name}", reduce_type=reduce_type, options=OPTIONS)

    return _kept(xp, name, variant, make)


def _kept(xp: Any, name: str, variant: Tuple[Any, ...], make: Callable[[], Any]) -> Any:
    key = (xp, name, variant)
    kernel = _cache.get(key)
    if kernel is None:
        with _lock:
            kernel = _cache.get(key)
            if kernel is None:
                kernel = _cache[key] = make()
    return kernel


_C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
# Elements one multi-tensor launch covers at most: cupy passes the loop size as a C int.
MAX_MULTI_ELEMENTS = 2 ** 31 - 1


def _params(text: str) -> List[Tuple[str, ...]]:
    """``"T x, raw float32 y"`` as ``[("T", "x"), ("raw", "float32", "y")]``."""
    return [tuple(entry.split()) for entry in (e.strip() for e in text.split(",")) if entry]


def _multi_source(source: Source, arrays: Tuple[str, ...], dtype: np.dtype) -> Source:
    """The multi-tensor form of a single-array kernel's source; ``arrays``: the inputs that are arrays."""
    in_params, out_params, body, preamble = source
    ins, outs = _params(in_params), [name for _, name in _params(out_params)]
    read = [name for _, name in ins if name in arrays]
    scalars = [(dtype.name if type_ == "T" else type_, name) for type_, name in ins if name not in arrays]
    params = ([f"raw uint64 {name}_at" for name in read + outs] + ["raw int64 starts", "int64 count"]
              + [f"{type_} {name}" for type_, name in scalars])
    lines = ["long long j = 0, hi = count;  /* the array of element i: starts[j] <= i < starts[j + 1] */",
             "while (hi - j > 1) { const long long mid = (j + hi) / 2; if (starts[mid] <= i) j = mid; "
             "else hi = mid; }",
             "const long long k = i - starts[j];"]
    lines += [f"const T {name} = ((const T*){name}_at[j])[k];" for name in read]
    lines += [f"T* const {name}_p = (T*){name}_at[j] + k;\nT {name} = *{name}_p;" for name in outs]
    lines += ["{", body, "}"]
    lines += [f"*{name}_p = {name};" for name in outs]
    return ", ".join(params), "", "\n".join(lines), f"typedef {_C_TYPES[dtype]} T;\n{preamble}"


def _scalars_from_device(source: Source, names: Sequence[str]) -> Source:
    """``source`` with its scalar parameters ``names`` read from ``raw <type> axonhpc_scalars`` (see the note)."""
    in_params, out_params, body, preamble = source
    params = _params(in_params)  # ("T", "lr"), ("raw", "uint64", "grad_at"), ...
    moved = [(words[0], words[-1]) for words in params if words[-1] in names and len(words) == 2]
    types = {type_ for type_, _ in moved}
    if len(moved) != len(names) or len(types) != 1:
        raise InvalidArgumentError(f"scalars {list(names)} are not parameters of one type in {in_params!r}")
    kept = [" ".join(words) for words in params if words[-1] not in names]
    reads = [f"const T {name} = axonhpc_scalars[{k}];" for k, (_, name) in enumerate(moved)]
    return (", ".join(kept + [f"raw {types.pop()} axonhpc_scalars"]), out_params, "\n".join(reads + [body]),
            preamble)


def multi_tensor(xp: Any, name: str, variant: Tuple[Any, ...], build: Callable[..., Source],
                 arrays: Tuple[str, ...], dtype: Any, device_scalars: bool = False) -> Any:
    """The multi-tensor kernel ``axonhpc_<name>_multi`` of ``build(*variant)`` for float32 or float64 arrays.

    ``device_scalars``: read the scalars from one device array passed last (see [Note: scalars in device memory]).
    """
    dtype = np.dtype(dtype)

    def make(dtype_name: str, array_names: Tuple[str, ...], on_device: bool, *flags: Any) -> Source:
        single = build(*flags)
        source = _multi_source(single, array_names, np.dtype(dtype_name))
        if not on_device:
            return source
        scalars = [n for _, n in _params(single[0]) if n not in array_names]
        return _scalars_from_device(source, scalars)

    suffix = "_multi_dev" if device_scalars else "_multi"
    return elementwise(xp, f"{name}{suffix}", (dtype.name, tuple(arrays), bool(device_scalars)) + tuple(variant),
                       make)


def _fill_source(count: int) -> Source:
    choice = "v0"
    for k in range(1, count):
        choice = f"(i == {k} ? v{k} : {choice})"
    return ", ".join(f"T v{k}" for k in range(count)), "T out", f"out = {choice};", ""


def fill(xp: Any, out: Any, values: Sequence[Any]) -> None:
    """Write ``values`` (scalars of ``out``'s dtype) into the 1-d device array ``out`` with one launch."""
    if out.shape != (len(values),):
        raise ShapeError(f"fill: {len(values)} values for an array of shape {tuple(out.shape)}")
    elementwise(xp, "fill", (len(values),), _fill_source)(*values, out)


class TensorTables:
    """The device tables of a multi-tensor launch, kept while the arrays' addresses stay the same.

    The last ``KEEP`` address sets per key are kept: gradients made afresh each step come back from cupy's pool at
    a few alternating addresses, and each new table is a host copy (25 us on an H100 machine). A table a CUDA
    graph captured is kept for good: the graph reads it at every replay, and nothing else holds it (dropped,
    its memory would go back to the pool, and a replay would read whatever is written there next).
    """

    KEEP = 4

    def __init__(self) -> None:
        self._kept: Dict[Any, Dict[Tuple[Any, ...], Tuple[Any, ...]]] = {}
        self._captured: Dict[Tuple[Any, Tuple[Any, ...]], Tuple[Any, ...]] = {}

    def tables(self, xp: Any, key: Any, lists: Sequence[Sequence[Any]]) -> Tuple[Any, ...]:
        """``(address table per list..., starts)`` for ``lists`` of arrays (each list in the same order)."""
        sizes = tuple(int(a.size) for a in lists[0])
        identity = (sizes,) + tuple(tuple(a.data.ptr for a in arrays) for arrays in lists)
        kept = self._kept.setdefault(key, {})
        made = kept.get(identity)
        if made is not None:
            if capture.capturing():
                self._captured[(key, identity)] = made
            return made
        capture.refuse("a fused optimizer update over arrays it has not updated before",
                        "its table of their device addresses would be copied to the device during the capture; "
                        "keep the gradient arrays between steps (zero_grad() with set_to_none=False, the "
                        "default) so that the table made in the warm-up steps still holds")
        count = len(sizes)
        host = np.zeros((len(lists) + 1) * count + 1, dtype=np.uint64)  # the tables and starts, one copy
        for k, ptrs in enumerate(identity[1:]):
            host[k * count:(k + 1) * count] = ptrs
        np.cumsum(sizes, out=host[len(lists) * count + 1:])
        device = xp.asarray(host)
        made = tuple(device[k * count:(k + 1) * count] for k in range(len(lists))) + \
            (device[len(lists) * count:].view(np.int64),)
        if len(kept) >= self.KEEP:
            del kept[next(iter(kept))]
        kept[identity] = made
        return made


def launch_multi(xp: Any, kernel: Any, tables: TensorTables, key: Any, lists: Sequence[Sequence[Any]],
                 scalars: Sequence[Any]) -> None:
    """Run a ``multi_tensor`` kernel over ``lists`` (one list per array parameter, C-contiguous) and ``scalars``."""
    *addresses, starts = tables.tables(xp, key, lists)
    total = sum(int(a.size) for a in lists[0])
    kernel(*addresses, starts, np.int64(len(lists[0])), *scalars, size=total)


def batches(sizes: Sequence[int], limit: int = MAX_MULTI_ELEMENTS) -> List[List[int]]:
    """Indices of ``sizes`` in runs of at most ``limit`` elements (an array larger than that alone)."""
    out: List[List[int]] = []
    total = limit + 1
    for index, size in enumerate(sizes):
        if total + size > limit:
            out.append([])
            total = 0
        out[-1].append(index)
        total += size
    return out


def launches(xp: Any, names: Any = None) -> int:
    """Launches so far of ``xp``'s kept kernels (the tests' stand-in counts; cupy's kernels count 0)."""
    return sum(getattr(k, "calls", 0) for (module, name, _), k in list(_cache.items())
               if module is xp and (names is None or name in names))


def kept(xp: Any) -> Dict[Tuple[str, Tuple[Any, ...]], Any]:
    """The kept kernels of ``xp`` by ``(name, variant)`` (for tests and diagnostics)."""
    return {(name, variant): k for (module, name, variant), k in list(_cache.items()) if module is xp}


__all__ = ["OPTIONS", "KERNEL_DTYPES", "MAX_MULTI_ELEMENTS", "has_kernels", "serves", "elementwise", "reduction",
           "multi_tensor", "fill", "TensorTables", "launch_multi", "batches", "launches", "kept"]
