"""A strict stand-in for cupy's arrays: NOT a numpy subclass, and it refuses what cupy refuses.

The device path broke on its first real GPU run because the CPU tests played
device arrays with numpy subclasses, which accept every numpy-only call. The
``DeviceArray`` here holds a numpy array privately and behaves like
``cupy.ndarray`` where cupy differs from numpy:

- implicit conversion to numpy raises ``TypeError`` (``np.asarray(x)``,
  ``np.array(x)``, the buffer protocol, so the compiled buffers and mpi4py's
  host path refuse it too); ``.get()`` is the explicit way;
- numpy arrays never mix with it: ufuncs and array functions given a numpy
  array (``x + host``, ``np.add(x, host)``, ``x[...] = host``,
  ``cupy.concatenate([x, host])``) raise ``TypeError``; so do Python lists
  where cupy wants arrays (``cupy.sin([1, 2])``);
- ``flags`` has ``c_contiguous``, ``f_contiguous`` and ``owndata`` and no
  ``writeable``; there is no ``.ctypes``, ``setflags`` or ``tobytes``;
- reductions return 0-d device arrays, not numpy scalars;
- ``.data.ptr``, ``__cuda_array_interface__`` and ``cupy.get_array_module``
  are there, as in cupy;
- ``cupy.where`` of bfloat16 values returns float32 (cupy has no bfloat16
  loop for it; an H200 run showed the float32 kernel).

Stream capture (``fake_cuda``'s ``Stream.begin_capture``/``end_capture``) is
played as CUDA plays it: while a thread captures, nothing it asks of the
device runs. Every operation is put on a tape instead, and a graph's
``launch()`` runs the tape on the arrays' memory as it then is. Results made
during the capture have their shape and dtype but no values (NaN, 0 or False:
uninitialised memory); arrays written in place keep their contents until a
launch. What cupy refuses during a capture is refused: reads of device values,
copies from or to the host, a stream's ``synchronize``, operations whose
result's size depends on the values (boolean indexing, ``nonzero``), and every
product that cupy hands to cuBLAS (``@``, ``matmul``, ``dot``, ``tensordot``,
``einsum``, ``cupy.cublas.gemm``: cupy 14 refuses cuBLAS in a capture, which
the first graph capture on a GPU met). ``cupy._axonhpc_cublas`` plays the
library itself (``cublasGemmEx`` on the memory at the given addresses, read
column-major with the leading dimensions given), which ``axonhpc.nn.gemm``
calls in cupy's place. Scalars
passed to an operation are frozen on the tape, as they are in a CUDA graph.

Device memory is host memory underneath (nothing here runs on a GPU), so
``.data.ptr`` can be read by the thread-level NCCL fake. Only the methods and
module functions cupy has are offered; anything else raises ``AttributeError``.
"""
from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib.machinery
import sys
import threading
import types
from typing import Any, Iterator, List

import numpy as np

IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")


_sync_logs = threading.local()  # this thread's open count_syncs() lists (threads play ranks)


def _synced(what: str) -> None:
    """Note one device-to-host read (on a GPU each waits for the stream's work so far)."""
    logs = getattr(_sync_logs, "open", None)
    if logs:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
        where = "?" if frame is None else f"{frame.f_code.co_filename.split('/axonhpc/')[-1]}:{frame.f_lineno}"
        for log in logs:
            log.append(f"{what} at {where}")


@contextlib.contextmanager
def count_syncs() -> Iterator[List[str]]:
    """Collect, in a list, each read of a device value by this thread inside the block, and where it happened.

    ``.get()``, ``.item()``, ``.tolist()``, ``cupy.asnumpy`` and the conversions ``bool()``,
    ``float()``, ``int()`` and ``operator.index`` of a device array (and, with ``fake_cuda``,
    a stream's or event's ``synchronize``): on a GPU each one waits for every kernel queued
    before it, so the host stops running ahead of the device.
    """
    log: List[str] = []
    logs = _sync_logs.__dict__.setdefault("open", [])
    logs.append(log)
    try:
        yield log
    finally:
        logs.remove(log)


_tape = threading.local()  # this thread's capture: ``ops`` is the tape while a stream captures
CAPTURING_SYNC = "the current stream is capturing, so synchronous API calls are disallowed"


def capturing() -> bool:
    """Whether this thread is capturing a graph (what ``Stream.is_capturing`` answers for its streams)."""
    return getattr(_tape, "ops", None) is not None


def begin_tape() -> None:
    """Start recording this thread's device operations instead of running them."""
    if capturing():
        raise RuntimeError("cudaErrorIllegalState: this thread is already capturing")
    _tape.ops = []


def end_tape() -> List[Any]:
    """Stop recording; returns the recorded operations, in order."""
    ops, _tape.ops = _tape.ops, None
    return ops


CUBLAS_IN_CAPTURE = "calling cuBLAS API during stream capture is currently unsupported"
_CUBLAS_FUNCTIONS = {"matmul", "dot", "tensordot", "einsum"}


def refuse_cublas_in_capture() -> None:
    """cupy's refusal of a cuBLAS call while the current stream captures."""
    if capturing():
        raise NotImplementedError(CUBLAS_IN_CAPTURE)


allocation_hook: Any = None  # fake_cuda: notes where arrays were allocated from (a graph's own pool)
write_hook: Any = None  # fake_cuda: checks a kernel's outputs before it writes them outside a capture


def _allocated(a: np.ndarray) -> np.ndarray:
    """``a``, just allocated by a creation function or a kernel's output (told to ``allocation_hook``)."""
    if allocation_hook is not None:
        allocation_hook(a)
    return a


def refuse_in_capture(what: str, message: str = CAPTURING_SYNC) -> None:
    """Raise cupy's error for ``what`` if this thread is capturing."""
    if capturing():
        raise RuntimeError(f"{what}: {message}")


def _leaves(value: Any) -> List[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _as_arrays(value: Any) -> Any:
    """numpy scalars as 0-d arrays (what ``_wrap`` makes of them), recursively in tuples and lists."""
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_as_arrays(v) for v in value)
    return value


def _poison(a: np.ndarray) -> None:
    """Give ``a`` no meaningful values, as freshly allocated device memory has none."""
    if a.dtype.kind in "fc":
        a[...] = np.nan
    elif a.dtype.kind in "iub":
        a[...] = 0


def _poisoned(a: np.ndarray) -> np.ndarray:
    """A new array from ``empty``: no values during a capture (outside one numpy's are as good as any)."""
    if capturing():
        _poison(a)
    return a


def _run(compute: Any, inputs: Any = (), in_place: bool = False) -> Any:
    """Run one device operation, or record it while this thread captures.

    Args:
        compute: does the operation on the arrays' current memory; returns its
            numpy result(s), or what an in-place operation returns.
        inputs: the numpy arrays it reads (a result identical to one of them is not new).
        in_place: it writes into existing arrays (``out=``, ``__setitem__``, a kernel's
            given outputs): during a capture it is recorded and not run (returns None).

    During a capture a result that owns its memory is new: it is computed once for its
    shape, given no values, and the tape copies the recomputed result into it at each launch.
    Views of existing arrays are returned as they are.
    """
    ops = getattr(_tape, "ops", None)
    if ops is None:
        return compute()
    if in_place:
        ops.append(compute)
        return None
    with np.errstate(all="ignore"):
        result = _as_arrays(compute())
    leaves = _leaves(result)
    own = [i for i, r in enumerate(leaves) if isinstance(r, np.ndarray) and r.flags.owndata
           and not builtins.any(r is a for a in _leaves(inputs))]
    for i in own:
        _poison(leaves[i])

    def replay() -> None:
        again = _leaves(_as_arrays(compute()))
        for i in own:
            np.copyto(leaves[i], again[i])

    if own:
        ops.append(replay)
    return result


def _refuse_host(value: Any, where: str) -> None:
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise TypeError(f"{where}: unsupported type {type(value)} (a numpy array given where cupy wants a "
                        "cupy array; move it with cupy.asarray)")
    if isinstance(value, list):
        raise TypeError(f"{where}: unsupported type {type(value)} (cupy does not convert lists implicitly)")


def _unwrap(value: Any, where: str) -> Any:
    """The numpy array behind a DeviceArray, recursively in tuples; host arrays refused."""
    if type(value) is DeviceArray:
        return value._a
    if isinstance(value, tuple):
        return tuple(_unwrap(v, where) for v in value)
    _refuse_host(value, where)
    return value


def _unwrap_seq(value: Any, where: str) -> Any:
    """Like ``_unwrap`` for sequence arguments (``concatenate([a, b])``): lists of device arrays pass."""
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap_seq(v, where) for v in value)
    return _unwrap(value, where)


def _wrap(value: Any) -> Any:
    """numpy results as device results: arrays and numpy scalars become DeviceArrays (cupy gives 0-d arrays)."""
    if isinstance(value, np.ndarray):
        return DeviceArray(value)
    if isinstance(value, np.generic):
        return DeviceArray(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, a: np.ndarray):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)

    def __getitem__(self, key: str) -> bool:
        names = {"C_CONTIGUOUS": "c_contiguous", "F_CONTIGUOUS": "f_contiguous", "OWNDATA": "owndata"}
        return getattr(self, names[key])


# cupy.ndarray's methods that behave as numpy's do (result arrays on the device).
_METHODS = frozenset("""
all any argmax argmin argsort astype clip conj conjugate copy cumprod cumsum diagonal dot fill flatten max mean
min nonzero prod ptp ravel repeat reshape round sort squeeze std sum swapaxes take trace transpose var view
""".split())
_ATTRIBUTES = frozenset("dtype shape size ndim itemsize nbytes strides".split())


class DeviceArray:
    """A device array: numpy memory behind cupy's rules (see the module docstring)."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100.0

    def __init__(self, a: np.ndarray):
        if type(a) is not np.ndarray:
            raise TypeError(f"DeviceArray wraps a plain numpy array, got {type(a).__name__}")
        self._a = a

    # -- what cupy offers ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in _ATTRIBUTES:
            return getattr(self._a, name)
        if name in _METHODS:
            method = getattr(self._a, name)
            where = f"cupy.ndarray.{name}"

            def call(*args, **kwargs):
                out = kwargs.get("out")
                args = tuple(_unwrap(a, where) for a in args)
                kwargs = {k: _unwrap(v, where) for k, v in kwargs.items()}
                if name in ("nonzero",):
                    refuse_in_capture(where)
                if name in ("fill", "sort") or out is not None:  # in place
                    done = _run(lambda: method(*args, **kwargs), in_place=True)
                    return out if capturing() and out is not None else _wrap(done)
                return _wrap(_run(lambda: method(*args, **kwargs), (self._a,) + args))

            return call
        raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")

    @property
    def flags(self) -> _Flags:
        return _Flags(self._a)

    @property
    def T(self) -> "DeviceArray":
        return DeviceArray(self._a.T)

    @property
    def base(self) -> Any:
        return None if self._a.base is None else DeviceArray(np.asarray(self._a.base))

    @property
    def data(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(ptr=self._a.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr,
                "data": (a.__array_interface__["data"][0], False),
                "strides": None if a.flags.c_contiguous else a.strides, "version": 3}

    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        refuse_in_capture("get", "the current stream is capturing, so D2H transfers are disallowed")
        if blocking:  # blocking=False queues the copy on the stream; the host does not wait (cupy >= 13)
            _synced("get")
        if out is None:
            return np.array(self._a, order=order)
        if type(out) is not np.ndarray or out.shape != self._a.shape or out.dtype != self._a.dtype:
            raise ValueError(f"get(out=): out must be a numpy array of shape {self._a.shape} and dtype "
                             f"{self._a.dtype}, got {type(out).__name__} {getattr(out, 'shape', None)}")
        np.copyto(out, self._a)
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if type(arr) is not np.ndarray:
            raise TypeError(f"set: only numpy.ndarray is supported, got {type(arr)}")
        refuse_in_capture("set", "the current stream is capturing, so H2D transfers are disallowed")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError(f"set: shape or dtype mismatch ({arr.shape} {arr.dtype} into "
                             f"{self._a.shape} {self._a.dtype})")
        np.copyto(self._a, arr)

    def item(self) -> Any:
        refuse_in_capture("item")
        _synced("item")
        return self._a.item()

    def tolist(self) -> Any:
        refuse_in_capture("tolist")
        _synced("tolist")
        return self._a.tolist()

    # -- what cupy refuses ------------------------------------------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return getattr(_Ufunc(ufunc), method)(*inputs, **kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        fn = getattr(StrictCupy(), func.__name__, None)
        if fn is None:
            return NotImplemented
        return fn(*args, **kwargs)

    # -- Python protocols -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        for i in range(len(self._a)):
            yield self[i]

    def __repr__(self) -> str:
        return "array(" + np.array2string(self._a, separator=", ") + ")"

    def __bool__(self) -> bool:
        refuse_in_capture("bool")
        _synced("bool")
        return bool(self._a)

    def __float__(self) -> float:
        refuse_in_capture("float")
        _synced("float")
        return float(self._a)

    def __int__(self) -> int:
        refuse_in_capture("int")
        _synced("int")
        return int(self._a)

    def __index__(self) -> int:
        refuse_in_capture("index")
        _synced("index")
        return self._a.__index__()

    def __getitem__(self, key: Any) -> "DeviceArray":
        index = _index(key)
        if builtins.any(isinstance(k, np.ndarray) and k.dtype == bool and k.ndim
                        for k in (index if isinstance(index, tuple) else (index,))):
            refuse_in_capture("boolean indexing")  # the result's size is read from the device
        a = self._a

        def pick() -> np.ndarray:
            picked = a[index]
            if isinstance(picked, np.generic):  # cupy gives a 0-d view where numpy gives a scalar
                picked = a[(index if isinstance(index, tuple) else (index,)) + (Ellipsis,)]
            return picked

        return DeviceArray(_run(pick, (a,)))

    def __setitem__(self, key: Any, value: Any) -> None:
        index, value, a = _index(key), _unwrap(value, "cupy.ndarray.__setitem__"), self._a

        def assign() -> None:
            a[index] = value

        _run(assign, in_place=True)

    def __copy__(self):
        return DeviceArray(_run(self._a.copy))

    def __deepcopy__(self, memo):
        return DeviceArray(_run(self._a.copy))

    def __reduce__(self):
        raise TypeError("device arrays are not pickled here (axonhpc never pickles)")


def _index(key: Any) -> Any:
    """An index with device arrays unwrapped (cupy takes device and host index arrays)."""
    if type(key) is DeviceArray:
        return key._a
    if isinstance(key, tuple):
        return tuple(k._a if type(k) is DeviceArray else k for k in key)
    return key


def _operator(ufunc: np.ufunc, reflected: bool = False, inplace: bool = False):
    u = None

    def op(self, other):
        nonlocal u
        u = u or _Ufunc(ufunc)
        if inplace:
            return u(self, other, out=self)
        return u(other, self) if reflected else u(self, other)

    return op


for _name, _uf in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
                   "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power, "matmul": np.matmul,
                   "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}.items():
    setattr(DeviceArray, f"__{_name}__", _operator(_uf))
    setattr(DeviceArray, f"__r{_name}__", _operator(_uf, reflected=True))
    setattr(DeviceArray, f"__i{_name}__", _operator(_uf, inplace=True))
for _name, _uf in {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
                   "eq": np.equal, "ne": np.not_equal}.items():
    setattr(DeviceArray, f"__{_name}__", _operator(_uf))
DeviceArray.__neg__ = lambda self: _Ufunc(np.negative)(self)
DeviceArray.__pos__ = lambda self: _Ufunc(np.positive)(self)
DeviceArray.__abs__ = lambda self: _Ufunc(np.absolute)(self)
DeviceArray.__invert__ = lambda self: _Ufunc(np.invert)(self)
DeviceArray.__hash__ = None


class _Ufunc:
    """A numpy ufunc with cupy's argument rules."""

    def __init__(self, ufunc: np.ufunc):
        self._u = ufunc
        self.__name__ = ufunc.__name__
        self.nin, self.nout = ufunc.nin, ufunc.nout

    def _args(self, args, kwargs):
        where = f"cupy.{self.__name__}"
        args = tuple(_unwrap(a, where) for a in args)
        if "out" in kwargs:
            out = kwargs["out"]
            outs = out if isinstance(out, tuple) else (out,)
            for o in outs:
                if o is not None and type(o) is not DeviceArray:
                    raise TypeError(f"{where}: output arrays must be cupy arrays, got {type(o)}")
            kwargs["out"] = tuple(None if o is None else o._a for o in outs)
        return args, {k: v if k == "out" else _unwrap(v, where) for k, v in kwargs.items()}

    def _apply(self, fn, args, kwargs):
        given = kwargs.get("out")
        args, kwargs = self._args(args, kwargs)
        if given is not None and capturing():
            _run(lambda: fn(*args, **kwargs), in_place=True)
            return given
        return _wrap(_run(lambda: fn(*args, **kwargs), args))

    def __call__(self, *args, **kwargs):
        if self._u is np.matmul:
            refuse_cublas_in_capture()
        return self._apply(self._u, args, kwargs)

    def reduce(self, *args, **kwargs):
        return self._apply(self._u.reduce, args, kwargs)

    def accumulate(self, *args, **kwargs):
        return self._apply(self._u.accumulate, args, kwargs)

    def outer(self, *args, **kwargs):
        return self._apply(self._u.outer, args, kwargs)

    def at(self, a, indices, b=None):
        where = f"cupy.{self.__name__}.at"
        if type(a) is not DeviceArray:
            raise TypeError(f"{where}: unsupported type {type(a)}")
        _refuse_host(indices, where)
        idx, target = _index(indices), a._a
        if b is None:
            _run(lambda: self._u.at(target, idx), in_place=True)
        else:
            value = _unwrap(b, where)
            _run(lambda: self._u.at(target, idx, value), in_place=True)


# Functions that take host data on purpose (they copy it to the device).
_FROM_HOST = {"asarray", "array", "ascontiguousarray", "asanyarray"}
# Functions whose first argument is a sequence of arrays.
_SEQUENCE_FIRST = {"concatenate", "stack", "vstack", "hstack", "column_stack", "dstack"}
# Creation functions (no array arguments).
_CREATION = {"empty", "zeros", "ones", "full", "arange", "linspace", "eye", "identity"}
# Everything else cupy has, as numpy's function of the same name, that axonhpc's code could reach.
_FUNCTIONS = set("""
abs absolute add all allclose amax amin any arccos arcsin arctan arctan2 argmax argmin argsort around array_equal
broadcast_to ceil clip copy copyto cos cosh count_nonzero cumprod cumsum diag divide dot einsum empty_like equal
erf exp expm1 expand_dims flatnonzero flip floor full_like greater greater_equal isclose isfinite isinf isnan
less less_equal log log1p log2 logaddexp logical_and logical_not logical_or matmul max maximum mean min minimum
moveaxis multiply negative nonzero not_equal ones_like outer power prod ravel reciprocal remainder repeat reshape
round rsqrt sign sin sinh sort split sqrt square squeeze std subtract sum swapaxes take take_along_axis tanh tile
transpose tril triu true_divide var where zeros_like argwhere bincount cbrt floor_divide fmax fmin tensordot
""".split())


# Functions whose result's size depends on the values (cupy reads it from the device).
_SIZED_BY_VALUES = {"nonzero", "argwhere", "flatnonzero"}
# Functions that allocate and launch nothing (the memory holds whatever it held).
_NO_KERNEL = {"empty", "empty_like"}


def _strict_function(source: Any, name: str) -> Any:
    """numpy's ``source`` with cupy's argument rules: device arrays in and out, host arrays refused."""
    def call(*args, **kwargs):
        where = f"cupy.{name}"
        if "out" in kwargs and kwargs["out"] is not None and type(kwargs["out"]) is not DeviceArray:
            raise TypeError(f"{where}: out must be a cupy array, got {type(kwargs['out'])}")
        given = kwargs.get("out")
        args = tuple(_unwrap(a, where) for a in args)
        kwargs = {k: _unwrap(v, where) for k, v in kwargs.items()}
        if name in _SIZED_BY_VALUES:
            refuse_in_capture(where)
        if name in _CUBLAS_FUNCTIONS:
            refuse_cublas_in_capture()
        if name == "copyto" or given is not None:  # in place into the first argument or ``out``
            done = _run(lambda: source(*args, **kwargs), in_place=True)
            return given if capturing() and given is not None else _wrap(done)
        if name in _NO_KERNEL:
            return _wrap(_allocated(_poisoned(source(*args, **kwargs))))
        return _wrap(_run(lambda: source(*args, **kwargs), args))

    return call


_numpy_where = _strict_function(np.where, "where")


def _where(condition: Any, *values: Any) -> Any:
    """``cupy.where``: its loops have no bfloat16 (ml_dtypes) one, so bfloat16 choices are selected in float32
    and the result is float32, as cupy gives it."""
    from axonhpc._dtypes import bfloat16_dtype

    bf16 = bfloat16_dtype()
    if bf16 is not None and builtins.any(type(v) is DeviceArray and v.dtype == bf16 for v in values):
        values = tuple(v.astype(np.float32) if type(v) is DeviceArray and v.dtype == bf16 else v for v in values)
    return _numpy_where(condition, *values)


class _Linalg(types.ModuleType):
    """``cupy.linalg``: the few functions numpy's linalg shares with it that code here may reach."""

    _NAMES = frozenset("norm det inv solve svd qr eigh cholesky".split())

    def __getattr__(self, name: str) -> Any:
        if name in self._NAMES:
            return _strict_function(getattr(np.linalg, name), f"linalg.{name}")
        raise AttributeError(f"module 'cupy.linalg' (strict stand-in) has no attribute {name!r}")


class _Cublas(types.ModuleType):
    """``cupy.cublas``: ``gemm`` with the checks of cupy's (cupy/cublas.py), computing in place into ``out``."""

    _OPS = {"N": lambda m: m, "T": lambda m: m.T, "H": lambda m: m.T.conj()}

    def __init__(self):
        super().__init__("cupy.cublas")
        self.calls = 0  # how many gemm calls ran, for the tests

    def gemm(self, transa, transb, a, b, out=None, alpha=1.0, beta=0.0):
        where = "cupy.cublas.gemm"
        refuse_cublas_in_capture()
        a_, b_ = _unwrap(a, where), _unwrap(b, where)
        if not isinstance(a_, np.ndarray) or not isinstance(b_, np.ndarray):
            raise AttributeError(f"{where}: the operands must be cupy arrays")
        assert a_.ndim == b_.ndim == 2
        assert a_.dtype == b_.dtype
        if a_.dtype.char not in "fdFD":
            raise TypeError("invalid dtype")
        if transa not in self._OPS or transb not in self._OPS:
            raise TypeError(f"invalid trans (actual: {transa!r}, {transb!r})")
        a_, b_ = self._OPS[transa](a_), self._OPS[transb](b_)
        assert b_.shape[0] == a_.shape[1]
        if out is None:
            def fresh() -> np.ndarray:
                self.calls += not capturing()
                return np.asfortranarray(np.matmul(a_, b_) * a_.dtype.type(alpha))

            return DeviceArray(_run(fresh, (a_, b_)))
        o = _unwrap(out, where)
        assert o.ndim == 2
        assert o.shape == (a_.shape[0], b_.shape[1])
        assert o.dtype == a_.dtype

        def into() -> None:
            self.calls += 1
            product = np.matmul(a_, b_)
            if alpha != 1.0:
                product *= a_.dtype.type(alpha)
            if beta == 0.0:
                o[...] = product
            else:
                if beta != 1.0:
                    np.multiply(o, o.dtype.type(beta), out=o)
                np.add(o, product, out=o)

        _run(into, in_place=True)
        return out


class _RoutinesLinalg(types.ModuleType):
    """``cupy._core._routines_linalg``'s compute-type table (float16, float32, float64), as cupy keeps it."""

    COMPUTE_TYPE_TBD, COMPUTE_TYPE_DEFAULT, COMPUTE_TYPE_PEDANTIC = 0, 1, 2
    COMPUTE_TYPE_FP16, COMPUTE_TYPE_FP32, COMPUTE_TYPE_FP64, COMPUTE_TYPE_BF16, COMPUTE_TYPE_TF32 = 3, 4, 5, 6, 7

    def __init__(self):
        super().__init__("cupy._core._routines_linalg")
        self.compute_types = [self.COMPUTE_TYPE_TBD] * 3

    @staticmethod
    def _index(dtype: Any) -> int:
        char = np.dtype(dtype).char
        if char == "e":
            return 0
        if char in "fF":
            return 1
        if char in "dD":
            return 2
        raise TypeError(f"dtype is not supported: {dtype}")

    def set_compute_type(self, dtype: Any, compute_type: int) -> None:
        if compute_type not in range(8):
            raise ValueError(f"Unknown compute type: {compute_type}")
        self.compute_types[self._index(dtype)] = compute_type

    def get_compute_type(self, dtype: Any) -> int:
        index = self._index(dtype)
        if self.compute_types[index] == self.COMPUTE_TYPE_TBD:
            import os

            tf32 = np.dtype(dtype).char in "fF" and int(os.getenv("CUPY_TF32", "0")) > 0
            self.compute_types[index] = self.COMPUTE_TYPE_TF32 if tf32 else self.COMPUTE_TYPE_DEFAULT
        return self.compute_types[index]


def _placeholder_dtypes(in_params: list, out_params: list, args: list) -> dict:
    """Type placeholder -> dtype, from the array arguments, else the scalars (as cupy decides them)."""
    from support import host_kernels

    types_: dict = {}
    for (type_, name, _), arg in zip(in_params + out_params, args):
        if type(arg) is DeviceArray and host_kernels.is_placeholder(type_):
            if types_.setdefault(type_, arg.dtype) != arg.dtype:
                raise TypeError(f"Type is mismatched. {name} {arg.dtype} {types_[type_]}")
    for (type_, name, _), arg in zip(in_params, args):
        if type(arg) is not DeviceArray and host_kernels.is_placeholder(type_) and type_ not in types_:
            types_[type_] = np.asarray(arg).dtype
    return types_


def _dtype_of(type_: str, placeholders: dict, what: str) -> np.dtype:
    from support import host_kernels

    dtype = placeholders[type_] if host_kernels.is_placeholder(type_) else np.dtype(type_)
    if dtype not in host_kernels.C_TYPES:
        raise NotImplementedError(f"the strict stand-in's {what} has no {dtype} arguments")
    return dtype


class ElementwiseKernel:
    """``cupy.ElementwiseKernel`` whose body is compiled as C on the host (``host_kernels``).

    Checked as cupy checks: the number of arguments, host arrays and lists
    refused, one dtype per type placeholder (from the array arguments, else
    the scalars), outputs of the declared dtype, inputs broadcast to one
    shape (``i`` is the flat index into it) and outputs of exactly that shape;
    ``raw`` inputs are not broadcast, and ``size=`` is the loop's length
    exactly when every array is raw. Offered narrower than cupy: no ``raw``
    outputs, no ``loop_prep``/``after_loop``,
    float32/float64/int32/int64/uint64/bool types.
    """

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel",
                 reduce_dims: bool = True, preamble: str = "", no_return: bool = False,
                 return_tuple: bool = False, **kwargs: Any):
        from support import host_kernels

        unknown = set(kwargs) - {"options", "loop_prep", "after_loop"}
        if unknown:
            raise TypeError(f"ElementwiseKernel() got unexpected keyword arguments {sorted(unknown)}")
        if kwargs.get("loop_prep") or kwargs.get("after_loop"):
            raise NotImplementedError("the strict stand-in's ElementwiseKernel has no loop_prep or after_loop")
        self.in_params = host_kernels.parse_params(in_params)
        self.out_params = host_kernels.parse_params(out_params, raw_allowed=False)
        self.operation, self.name, self.preamble = operation, name, preamble
        self.no_return, self.return_tuple = no_return, return_tuple
        self.options = tuple(kwargs.get("options", ()))
        self.calls = 0  # launches so far (a test counter; cupy has no such attribute)

    def __call__(self, *args: Any, size: Any = None, block_size: Any = None, stream: Any = None) -> Any:
        from support import host_kernels

        n_in, n_out = len(self.in_params), len(self.out_params)
        if len(args) not in (n_in, n_in + n_out):
            raise TypeError(f"Wrong number of arguments for {self.name!r}")
        for arg in args:
            _refuse_host(arg, self.name)
        args = list(args)
        placeholders = _placeholder_dtypes(self.in_params, self.out_params, args)

        def dtype_of(type_: str) -> np.dtype:
            return _dtype_of(type_, placeholders, "ElementwiseKernel")

        params = self.in_params + self.out_params
        looped = [a for (_, _, raw), a in zip(params, args) if type(a) is DeviceArray and not raw]
        if len(args) == n_in and n_out:
            looped.append(None)  # outputs to allocate: not raw, so they count as cupy counts them
        if size is not None and looped:
            raise ValueError("Specified 'size' can be used only if all of the ndarray are 'raw'.")
        if size is None and not looped:
            raise ValueError("Loop size is undecided.")
        looped = [a for a in looped if a is not None]
        try:
            shape = (int(size),) if size is not None else np.broadcast_shapes(*(a.shape for a in looped))
        except ValueError:
            raise ValueError(f"operands could not be broadcast together with shapes "
                             f"{[a.shape for a in looped]} in {self.name!r}") from None
        for (_, name, _), arg in zip(self.out_params, args[n_in:]):
            if type(arg) is DeviceArray and arg.shape != shape:
                raise ValueError(f"output {name!r} of {self.name!r} has shape {arg.shape}, the arguments broadcast "
                                 f"to {shape} (an output is never broadcast)")
        if len(args) == n_in:
            args += [DeviceArray(_allocated(np.empty(shape, dtype_of(t)))) for t, _, _ in self.out_params]
            for out in args[n_in:]:
                _poison(out._a)  # fresh memory: no values until the kernel (or a graph's launch) writes them
        elif write_hook is not None and not capturing():
            for out in args[n_in:]:
                if type(out) is DeviceArray:
                    write_hook(out._a, self.name)
        for (type_, name, _), arg in zip(self.out_params, args[n_in:]):
            if type(arg) is not DeviceArray:
                raise TypeError(f"output {name!r} of {self.name!r} must be a cupy array, got {type(arg).__name__}")
            if arg.dtype != dtype_of(type_):
                raise TypeError(f"Type is mismatched. {name} {arg.dtype} {dtype_of(type_)}")
        inputs = []
        for (type_, name, raw), arg in zip(self.in_params, args):
            dtype = dtype_of(type_)
            is_array = type(arg) is DeviceArray
            if is_array and arg.dtype != dtype:
                raise TypeError(f"Type is mismatched. {name} {arg.dtype} {dtype}")
            if raw and not is_array:
                raise TypeError(f"raw parameter {name!r} of {self.name!r} must be a cupy array, got "
                                f"{type(arg).__name__}")
            if raw:
                if not arg._a.flags.c_contiguous:
                    raise NotImplementedError(f"the strict stand-in takes raw arrays C-contiguous only ({name!r})")
                inputs.append((host_kernels.C_TYPES[dtype][0], name, "raw"))
                continue
            inputs.append((host_kernels.C_TYPES[dtype][0], name, "array" if is_array else "scalar"))
        outputs = [(host_kernels.C_TYPES[dtype_of(t)][0], name) for t, name, _ in self.out_params]
        source = host_kernels.c_source(self.name, inputs, outputs, placeholders, self.operation, self.preamble)
        function = host_kernels.load(source, self.name)

        def launch() -> None:  # reads the arrays' memory as it is when the kernel runs
            values = []
            for (type_, _, raw), arg in zip(self.in_params, args):
                dtype = dtype_of(type_)
                if raw:
                    values.append((dtype, arg._a))
                elif type(arg) is DeviceArray:
                    values.append((dtype, np.ascontiguousarray(np.broadcast_to(arg._a, shape))))
                else:
                    values.append((dtype, arg))
            targets = [a._a if a._a.flags.c_contiguous else np.ascontiguousarray(a._a) for a in args[n_in:]]
            host_kernels.run(function, int(np.prod(shape, dtype=np.int64)), values, targets)
            for out, target in zip(args[n_in:], targets):
                if target is not out._a:
                    out._a[...] = target
            self.calls += 1

        _run(launch, in_place=True)
        if self.no_return:
            return None
        results = tuple(args[n_in:])
        return results if self.return_tuple or n_out != 1 else results[0]


class ReductionKernel:
    """``cupy.ReductionKernel`` whose expressions are compiled as C on the host (``host_kernels``).

    Checked as cupy checks: the number of arguments, host arrays and lists
    refused, one dtype per type placeholder, inputs broadcast to one shape,
    ``axis`` in range (None: every axis), ``keepdims``, an output of the
    declared dtype and of the reduced shape. ``reduce_type`` defaults to the
    output's type, as in cupy. The elements are folded in index order, where a
    GPU folds a tree of partial results: a sum may differ in its last bits.
    Offered narrower than cupy: one output, an identity (cupy may go without),
    no ``raw`` parameters, float32/float64/int32/int64/uint64/bool types.
    """

    def __init__(self, in_params: str, out_params: str, map_expr: str, reduce_expr: str, post_map_expr: str,
                 identity: Any, name: str = "reduce_kernel", reduce_type: Any = None, reduce_dims: bool = True,
                 preamble: str = "", options: Any = ()):
        from support import host_kernels

        self.in_params = host_kernels.parse_params(in_params, raw_allowed=False)
        self.out_params = host_kernels.parse_params(out_params, raw_allowed=False)
        if len(self.out_params) != 1:
            raise NotImplementedError(f"the strict stand-in's ReductionKernel has one output, not {out_params!r}")
        if identity is None:
            raise NotImplementedError("the strict stand-in's ReductionKernel needs an identity")
        self.map_expr, self.reduce_expr, self.post_map_expr = map_expr, reduce_expr, post_map_expr
        self.identity, self.name, self.preamble = str(identity), name, preamble
        self.reduce_type = reduce_type
        self.options = tuple(options)
        self.calls = 0  # launches so far (a test counter; cupy has no such attribute)

    def __call__(self, *args: Any, out: Any = None, axis: Any = None, keepdims: bool = False,
                 stream: Any = None) -> Any:
        from support import host_kernels

        n_in = len(self.in_params)
        if len(args) not in (n_in, n_in + 1):
            raise TypeError(f"Wrong number of arguments for {self.name}")
        if out is not None:
            if len(args) != n_in:
                raise ValueError("cannot specify 'out' as both a positional and keyword argument")
            args = args + (out,)
        for arg in args:
            _refuse_host(arg, self.name)
        args = list(args)
        placeholders = _placeholder_dtypes(self.in_params, self.out_params, args)
        arrays = [a for a in args[:n_in] if type(a) is DeviceArray]
        shape = np.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
        ndim = len(shape)
        axes = tuple(range(ndim)) if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
        for ax in axes:
            if not -ndim <= ax < ndim:
                raise np.exceptions.AxisError(ax, ndim)
        if len({ax % ndim for ax in axes}) != len(axes):
            raise ValueError("duplicate value in 'axis'")
        axes = tuple(sorted(ax % ndim for ax in axes))
        kept = tuple(ax for ax in range(ndim) if ax not in axes)
        out_shape = tuple(1 if ax in axes else shape[ax] for ax in range(ndim)) if keepdims else \
            tuple(shape[ax] for ax in kept)
        (out_type, out_name, _), = self.out_params
        out_dtype = _dtype_of(out_type, placeholders, "ReductionKernel")
        if len(args) > n_in:
            given = args[n_in]
            if type(given) is not DeviceArray or given.dtype != out_dtype or given.shape != out_shape:
                raise ValueError(f"output {out_name!r} of {self.name!r} must be a cupy array of {out_dtype} and "
                                 f"shape {out_shape}")
        else:
            args.append(DeviceArray(np.empty(out_shape, out_dtype)))
            _poison(args[-1]._a)
        inputs = []
        for (type_, name, _), arg in zip(self.in_params, args):
            dtype = _dtype_of(type_, placeholders, "ReductionKernel")
            if type(arg) is DeviceArray and arg.dtype != dtype:
                raise TypeError(f"Type is mismatched. {name} {arg.dtype} {dtype}")
            inputs.append((host_kernels.C_TYPES[dtype][0], name, "array" if type(arg) is DeviceArray else "scalar"))
        reduce_type = self.reduce_type or out_type
        reduce_c = host_kernels.C_TYPES[_dtype_of(reduce_type, placeholders, "ReductionKernel")][0]
        source = host_kernels.reduction_source(self.name, inputs, (host_kernels.C_TYPES[out_dtype][0], out_name),
                                               placeholders, reduce_c, self.map_expr, self.reduce_expr,
                                               self.post_map_expr, self.identity, self.preamble)
        function = host_kernels.load(source, self.name)
        rows = int(np.prod([shape[ax] for ax in kept], dtype=np.int64))
        length = int(np.prod([shape[ax] for ax in axes], dtype=np.int64))
        result = args[-1]

        def launch() -> None:  # reads the arrays' memory as it is when the kernel runs
            values = []
            for (type_, _, _), arg in zip(self.in_params, args):
                dtype = _dtype_of(type_, placeholders, "ReductionKernel")
                if type(arg) is DeviceArray:
                    moved = np.transpose(np.broadcast_to(arg._a, shape), kept + axes)
                    values.append((dtype, np.ascontiguousarray(moved).reshape(rows, length)))
                else:
                    values.append((dtype, arg))
            target = np.empty(rows, out_dtype)
            host_kernels.run(function, (rows, length), values, [target])
            result._a[...] = target.reshape(out_shape)
            self.calls += 1

        _run(launch, in_place=True)
        return result


class StandinCublas:
    """``cublasGemmEx`` over the memory at the addresses given, as the library reads it (see the module docstring)."""

    _TYPES = {0: np.float32, 1: np.float64, 2: np.float16}
    _COMPUTE = {68: np.float32, 70: np.float64, 77: np.float32}  # 32F, 64F, 32F_FAST_TF32 (played as 32F)

    def __init__(self):
        self.calls = 0  # gemm_ex calls made (outside a capture: each launch of a recorded one is not counted)
        self.computes: List[int] = []  # the compute type of each call
        self.betas: List[float] = []  # and its beta (1: added into the output)

    def _dtype(self, code: int) -> Any:
        if code == 14:
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self._TYPES[code])

    @staticmethod
    def _matrix(ptr: int, rows: int, cols: int, ld: int, dtype: Any) -> np.ndarray:
        """The column-major (rows, cols) matrix at ``ptr`` with leading dimension ``ld``."""
        assert ld >= max(1, rows), f"cuBLAS: leading dimension {ld} < {rows} rows"
        size = dtype.itemsize * (ld * (cols - 1) + rows)
        raw = (ctypes.c_char * size).from_address(ptr)
        return np.ndarray((rows, cols), dtype, buffer=raw, strides=(dtype.itemsize, dtype.itemsize * ld))

    def gemm_ex(self, opa, opb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, compute):
        from axonhpc.nn.gemm import data_type

        for x in (a, b, c):
            assert type(x) is DeviceArray, f"cuBLAS reads device memory, got a {type(x).__name__}"
        a_type, b_type, c_type = data_type(a), data_type(b), data_type(c)
        dtype, out_dtype = self._dtype(a_type), self._dtype(c_type)
        assert b_type == a_type and (c_type == a_type or (c_type == 0 and a_type in (2, 14)))
        assert opa in (0, 1) and opb in (0, 1)
        acc = self._COMPUTE[compute]
        assert (acc == np.float64) == (dtype == np.float64), "cuBLAS: compute type of another precision"
        # Read at the addresses, as cuBLAS does; the arrays themselves are held by the launch, as a graph's
        # memory pool holds what its capture allocated.
        held = (a._a, b._a, c._a)
        pa, pb, pc = (x.data.ptr for x in (a, b, c))
        A = self._matrix(pa, m, k, lda, dtype) if opa == 0 else self._matrix(pa, k, m, lda, dtype).T
        B = self._matrix(pb, k, n, ldb, dtype) if opb == 0 else self._matrix(pb, n, k, ldb, dtype).T
        C = self._matrix(pc, m, n, ldc, out_dtype)
        alpha, beta = acc(alpha), acc(beta)

        def launch() -> None:
            assert held
            product = np.matmul(A.astype(acc), B.astype(acc)) * alpha
            if beta != 0:  # beta 0: C is not read (it may hold anything)
                product += beta * C.astype(acc)
            C[...] = product.astype(out_dtype)

        if not capturing():
            self.calls += 1
        self.computes.append(compute)
        self.betas.append(float(beta))
        _run(launch, in_place=True)


class StrictCupy(types.ModuleType):
    """The ``cupy`` module over DeviceArrays; ``cuda`` is filled in by the caller (``fake_cuda``)."""

    ndarray = DeviceArray
    ElementwiseKernel = ElementwiseKernel
    ReductionKernel = ReductionKernel

    def __init__(self):
        super().__init__("cupy")
        self.__version__ = "14.0.0-strict-standin"
        self.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
        self.linalg = _Linalg("cupy.linalg")
        self.cublas = _Cublas()
        self._axonhpc_cublas = StandinCublas()
        self._core = types.SimpleNamespace(_routines_linalg=_RoutinesLinalg())
        for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32",
                     "uint64", "bool_", "dtype", "newaxis", "inf", "nan", "pi", "e", "integer", "floating"):
            setattr(self, name, getattr(np, name))

    def __getattr__(self, name: str) -> Any:
        source = getattr(np, name, None)
        if isinstance(source, np.ufunc):
            return _Ufunc(source)
        if name in _FROM_HOST:
            def from_host(obj, dtype=None, *args, **kwargs):
                kwargs.pop("order", None)
                if type(obj) is DeviceArray:  # already on the device: asarray keeps it, array copies
                    a = obj._a
                    if name == "array" or kwargs.get("copy") or (dtype is not None and obj.dtype != dtype):
                        return DeviceArray(_run(lambda: np.array(a, dtype=dtype)))
                    if name == "ascontiguousarray" and not a.flags.c_contiguous:
                        return DeviceArray(_run(lambda: np.ascontiguousarray(a)))
                    return obj
                if isinstance(obj, (list, tuple)) and builtins.any(type(o) is DeviceArray for o in obj):
                    raise TypeError(IMPLICIT)  # cupy.array([device, device]) converts through numpy
                # host data is copied to the device (cupy.asarray(numpy) always copies)
                refuse_in_capture(f"cupy.{name}", "the current stream is capturing, so H2D transfers are disallowed")
                return DeviceArray(np.array(obj, dtype=dtype, order="C"))

            return from_host
        if name in _CREATION:
            if name in _NO_KERNEL:
                return lambda *args, **kwargs: DeviceArray(_allocated(_poisoned(getattr(np, name)(*args, **kwargs))))
            return lambda *args, **kwargs: DeviceArray(_allocated(_run(lambda: getattr(np, name)(*args, **kwargs))))
        if name in _SEQUENCE_FIRST:
            def joined(arrays, *args, **kwargs):
                where = f"cupy.{name}"
                parts = _unwrap_seq(list(arrays), where)
                if len(parts) > 8 and len({p.dtype for p in parts}) == 1:
                    # cupy's _concatenate: more than 8 arrays of one dtype are joined by one kernel over a
                    # table of their addresses, made with core.array (a copy from pinned host memory whose
                    # event cupy queries at once: cudaErrorCapturedEvent in a capture).
                    refuse_in_capture(f"cupy.{name} of {len(parts)} arrays",
                                      "operation not permitted when stream is capturing (cudaErrorCapturedEvent)")
                kwargs = {k: _unwrap(v, where) for k, v in kwargs.items()}
                return _wrap(_run(lambda: getattr(np, name)(parts, *args, **kwargs), tuple(parts)))

            return joined
        if name == "where":
            return _where
        if name in _FUNCTIONS and source is not None:
            return _strict_function(source, name)
        raise AttributeError(f"module 'cupy' (strict stand-in) has no attribute {name!r}")

    @staticmethod
    def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        if type(a) is DeviceArray:
            return a.get(out=out, order=order)
        return np.array(a, order=order) if out is None else np.copyto(out, a) or out

    @staticmethod
    def get_array_module(*args: Any) -> types.ModuleType:
        import sys

        return sys.modules["cupy"] if builtins.any(type(a) is DeviceArray for a in args) else np

    @staticmethod
    def isscalar(value: Any) -> bool:
        return np.isscalar(value)

    @staticmethod
    def result_type(*args: Any) -> np.dtype:
        return np.result_type(*(a.dtype if type(a) is DeviceArray else a for a in args))

    @staticmethod
    def finfo(dtype: Any) -> Any:
        return np.finfo(dtype)

    @staticmethod
    def iinfo(dtype: Any) -> Any:
        return np.iinfo(dtype)

    @staticmethod
    def can_cast(from_: Any, to: Any, casting: str = "safe") -> bool:
        return np.can_cast(from_.dtype if type(from_) is DeviceArray else from_, to, casting)


class UnreadableDeviceArray(DeviceArray):
    """A device array whose copy to the host fails, as when host memory is exhausted."""

    __slots__ = ()

    def get(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise MemoryError("cannot allocate 56 bytes of host memory")


def device(a: Any) -> DeviceArray:
    """A DeviceArray copy of ``a`` (what ``cupy.asarray(numpy_array)`` returns)."""
    return DeviceArray(np.array(a))


def host(a: Any) -> np.ndarray:
    """``a`` as a numpy array: ``.get()`` for device arrays."""
    return a.get() if type(a) is DeviceArray else np.asarray(a)
