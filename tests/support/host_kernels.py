"""A cupy ``ElementwiseKernel`` body, or a ``ReductionKernel``'s expressions, compiled as C on the host, so the
strict stand-in can run them.

Nothing here runs on a GPU. The body a kernel gives cupy (CUDA C++) is
compiled by the host's C compiler as C99 with ``<tgmath.h>`` (so ``sqrt`` of
a float is ``sqrtf``, as CUDA's overload is), with ``-ffp-contract=off`` (no
fused multiply-add, as the library's kernels ask NVRTC with ``--fmad=false``)
and no fast-math. Each element is one loop iteration:

- an input array parameter is a ``const`` local read from its element; a
  ``raw`` input array is a ``const`` pointer to its first element, for the body
  to index (cupy's raw arrays are indexed by flat position too);
- a scalar input parameter is a ``const`` local of its parameter type;
- an output parameter is its element itself (a macro), read and written by the body.

What is checked this way is the body's arithmetic, in the order and dtype
it is written: a body that is not also valid C (C++-only syntax, CUDA
intrinsics) fails to compile here, and CUDA-specific behaviour is only seen
on a GPU. A preamble (helper functions, file scope after the type
placeholders' typedefs, as cupy places it) may mark its functions
``__device__``, which is defined empty. ``exp``, ``tanh`` and the like are the
C library's, within a few ulp of CUDA's and numpy's; arithmetic and ``sqrt``
round as on a GPU. Compiled libraries are cached by the hash of their source under
the temporary directory, written under a temporary name and renamed (ranks
compile concurrently).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

C_TYPES = {
    np.dtype(np.float32): ("float", ctypes.c_float),
    np.dtype(np.float64): ("double", ctypes.c_double),
    np.dtype(np.int32): ("int32_t", ctypes.c_int32),
    np.dtype(np.int64): ("int64_t", ctypes.c_int64),
    np.dtype(np.uint64): ("uint64_t", ctypes.c_uint64),
    np.dtype(np.bool_): ("bool", ctypes.c_bool),
}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_loaded: Dict[str, ctypes.CDLL] = {}
_compiling = threading.Lock()


def parse_params(text: str, raw_allowed: bool = True) -> List[Tuple[str, str, bool]]:
    """``"T x, raw uint64 y"`` as ``[("T", "x", False), ("uint64", "y", True)]``; refuses what the stand-in does not offer.

    Raises:
        ValueError: a malformed entry or a reserved name (``i``, ``n``, a leading underscore), as cupy
            raises; NotImplementedError for ``raw`` parameters where ``raw_allowed`` is False (the
            stand-in offers raw inputs of elementwise kernels only).
    """
    params = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        words = entry.split()
        raw = words[0] == "raw"
        if raw:
            if not raw_allowed:
                raise NotImplementedError(f"the strict stand-in offers no raw parameter here (an ElementwiseKernel's "
                                          f"output, a ReductionKernel's parameter): {entry!r}")
            words = words[1:]
        if len(words) != 2 or not all(_IDENT.match(w) for w in words):
            raise ValueError(f"Invalid parameter: {entry!r}")
        type_, name = words
        if name in ("i", "n") or name.startswith("_"):
            raise ValueError(f"{name!r} is a reserved name in an elementwise kernel")
        params.append((type_, name, raw))
    return params


DTYPE_NAMES = frozenset("bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
                        "complex64 complex128".split())


def is_placeholder(type_: str) -> bool:
    """A type name that is not a dtype name (``T``) stands for the dtype of its argument."""
    return type_ not in DTYPE_NAMES


def c_source(name: str, inputs: Sequence[Tuple[str, str, bool]], outputs: Sequence[Tuple[str, str]],
             placeholders: Dict[str, np.dtype], operation: str, preamble: str = "") -> str:
    """The C translation unit of one kernel (see the module docstring).

    Args:
        inputs: ``(C type, name, kind)`` per input parameter, kind "array" (an element a
            loop iteration), "raw" (the whole array, indexed by the body) or "scalar".
        outputs: ``(C type, name)`` per output parameter.
        placeholders: placeholder type name -> dtype (each becomes a typedef).
    """
    lines = _head(placeholders, preamble)
    args = ["int64_t _n"]
    args += [f"{ct} _in_{nm}" if kind == "scalar" else f"const {ct}* _in_{nm}" for ct, nm, kind in inputs]
    args += [f"{ct}* _out_{nm}" for ct, nm in outputs]
    lines.append(f"void {name}({', '.join(args)}) {{")
    lines += [f"  const {ct}* const {nm} = _in_{nm};" for ct, nm, kind in inputs if kind == "raw"]
    lines.append("  for (int64_t i = 0; i < _n; ++i) {")
    lines.append("    const int64_t n = _n; (void)n;")
    for ct, nm, kind in inputs:
        if kind != "raw":
            lines.append(f"    const {ct} {nm} = _in_{nm}{'[i]' if kind == 'array' else ''};")
    lines += [f"#define {nm} (_out_{nm}[i])" for _, nm in outputs]
    lines += ["    {", operation, "    }"]
    lines += [f"#undef {nm}" for _, nm in outputs]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def _head(placeholders: Dict[str, np.dtype], preamble: str) -> List[str]:
    lines = ["#include <tgmath.h>", "#include <stdint.h>", "#include <stdbool.h>"]
    lines += [f"typedef {C_TYPES[dtype][0]} {ph};" for ph, dtype in placeholders.items()]
    lines.append("#define __device__")  # a preamble's device functions are plain C functions here
    lines.append(preamble)
    return lines


def reduction_source(name: str, inputs: Sequence[Tuple[str, str, str]], output: Tuple[str, str],
                     placeholders: Dict[str, np.dtype], reduce_type: str, map_expr: str, reduce_expr: str,
                     post_map_expr: str, identity: str, preamble: str = "") -> str:
    """The C translation unit of one ``ReductionKernel``: ``_rows`` reductions of ``_len`` elements each.

    An array input arrives as ``_rows * _len`` elements, each row the elements one output
    element reduces (the caller moves the reduced axes last). The reduction starts from
    ``identity`` and folds the mapped elements in index order: ``a`` the running value,
    ``b`` the next element's ``map_expr``, both of ``reduce_type``. ``post_map_expr``
    then writes the output from ``a`` (and the scalar inputs, as cupy's may). A GPU folds in a tree of partial results, so a
    sum here and there may differ in the last bits.

    Args:
        inputs: ``(C type, name, kind)`` per input, kind "array" or "scalar".
        output: ``(C type, name)`` of the one output.
    """
    lines = _head(placeholders, preamble)
    args = ["int64_t _rows", "int64_t _len"]
    args += [f"{ct} _in_{nm}" if kind == "scalar" else f"const {ct}* _in_{nm}" for ct, nm, kind in inputs]
    args.append(f"{output[0]}* _out_{output[1]}")
    lines.append(f"void {name}({', '.join(args)}) {{")
    # a scalar is a parameter of the whole kernel, as in cupy (the post-map may read it); an array's element
    # exists only in the loop
    lines += [f"  const {ct} {nm} = _in_{nm};" for ct, nm, kind in inputs if kind != "array"]
    lines.append("  for (int64_t _r = 0; _r < _rows; ++_r) {")
    lines.append(f"    {reduce_type} _acc = ({reduce_type})({identity});")
    lines.append("    for (int64_t _j = 0; _j < _len; ++_j) {")
    for ct, nm, kind in inputs:
        if kind == "array":
            lines.append(f"      const {ct} {nm} = _in_{nm}[_r * _len + _j];")
    lines.append(f"      const {reduce_type} b = ({reduce_type})({map_expr});")
    lines.append(f"      const {reduce_type} a = _acc;")
    lines.append(f"      _acc = ({reduce_expr});")
    lines.append("    }")
    lines.append(f"    const {reduce_type} a = _acc;")
    lines.append(f"#define {output[1]} (_out_{output[1]}[_r])")
    lines += ["    {", f"    {post_map_expr};", "    }"]
    lines += [f"#undef {output[1]}", "  }", "}"]
    return "\n".join(lines) + "\n"


def compiler() -> str:
    """The host C compiler (``CC``, else cc/gcc), or raise RuntimeError saying none is there."""
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    raise RuntimeError("the strict stand-in compiles kernel bodies with a C compiler, and none was found "
                       "(set CC or install gcc)")


def load(source: str, name: str) -> ctypes._CFuncPtr:
    """Compile ``source`` (cached by its hash) and return its function ``name``."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    lib = _loaded.get(digest)
    if lib is None:
        with _compiling:  # threads play ranks: one compiles, the others then find the library
            lib = _loaded.get(digest) or _compile(source, name, digest)
    return getattr(lib, name)


def _compile(source: str, name: str, digest: str) -> ctypes.CDLL:
    cache = os.path.join(tempfile.gettempdir(), f"axonhpc-host-kernels-{os.getuid()}")
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"{digest}.so")
    if not os.path.exists(path):
        src = os.path.join(cache, f"{digest}.{os.getpid()}.c")
        tmp = os.path.join(cache, f"{digest}.{os.getpid()}.so")
        with open(src, "w") as f:
            f.write(source)
        done = subprocess.run([compiler(), "-std=c99", "-O2", "-ffp-contract=off", "-fno-fast-math",
                               "-shared", "-fPIC", src, "-o", tmp, "-lm"], capture_output=True, text=True)
        os.unlink(src)
        if done.returncode != 0:
            raise RuntimeError(f"kernel {name} does not compile as C on the host:\n{done.stderr}\n{source}")
        os.replace(tmp, path)
    lib = _loaded[digest] = ctypes.CDLL(path)
    return lib


def run(function: ctypes._CFuncPtr, size: Any, inputs: Sequence[Tuple[np.dtype, object]],
        outputs: Sequence[np.ndarray]) -> None:
    """Call a loaded kernel on C-contiguous numpy arrays and scalars of the declared dtypes.

    ``size``: the loop's length (an elementwise kernel), or ``(rows, length)`` (a reduction).
    """
    args = [ctypes.c_int64(n) for n in (size if isinstance(size, tuple) else (size,))]
    for dtype, value in inputs:
        if isinstance(value, np.ndarray):
            args.append(ctypes.c_void_p(value.ctypes.data))
        else:
            args.append(C_TYPES[dtype][1](dtype.type(value).item()))
    args += [ctypes.c_void_p(out.ctypes.data) for out in outputs]
    function.restype = None
    function(*args)


__all__ = ["C_TYPES", "parse_params", "is_placeholder", "c_source", "reduction_source", "compiler", "load", "run"]
