"""A state tree as flat named arrays plus a JSON description, and back (the format: docs/checkpoints.md).

[Note: checkpoint format, version 1]
Arrays are stored as entries ``a<index>``, not under their keys, so any string key works. Integers are
decimal strings in the JSON (bit-generator states exceed 2**64, which other JSON readers would round);
non-finite floats are strings, so the JSON stays standard. ml_dtypes types (bfloat16, float8_*) are stored
as an unsigned view with their name recorded, since a ``.npy`` header cannot name them; object, string and
structured arrays are refused (they would need pickle).

Loading checks every array's dtype, shape and sha256, so a flipped bit or a file stitched from two
checkpoints is reported with its key, not returned as plausible numbers. Dtype and shape are compared with
the ``.npy`` header before allocating, so a crafted file cannot make the reader allocate more than the file
holds. ``encode`` refuses states beyond ``MAX_META_BYTES`` or ``MAX_DEPTH``, so everything written can be read.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._dtypes import is_cupy_array
from ..errors import ArgumentTypeError, CheckpointError, InvalidArgumentError
from .archive import Archive, EntryRefused


def checkpoint_path(path: Any, what: str = "checkpoint path") -> str:
    """``os.fspath(path)``, or an ArgumentTypeError naming what was passed instead of a path."""
    try:
        return os.fspath(path)
    except TypeError:
        raise ArgumentTypeError(f"the {what} must be a str or os.PathLike, got {type(path).__name__} {path!r}") \
            from None

FORMAT_NAME = "axonhpc-checkpoint"
FORMAT_VERSION = 1
META_ENTRY = "__meta__"
MAX_META_BYTES = 64 << 20  # JSON of the metadata: about 400,000 arrays' worth
MAX_DEPTH = 100  # containers nested in containers; training states nest a handful deep
MAX_NDIM = 64  # numpy's own limit on dimensions

_PLAIN_KINDS = "biufc"  # bool, signed, unsigned, float, complex: no pickle needed


def key_path(keys: Tuple[Any, ...]) -> str:
    """Render a position in the tree the way a user would index it: ``state['model']['0.weight']``."""
    return "state" + "".join(f"[{k!r}]" for k in keys)


def _ml_dtypes_name(dtype: np.dtype) -> str | None:
    """The ml_dtypes name of ``dtype`` (``"bfloat16"``), or None for a numpy dtype."""
    if getattr(dtype.type, "__module__", "") == "ml_dtypes":
        return dtype.name
    return None


def _storage_view(array: np.ndarray, where: Tuple[Any, ...]) -> Tuple[np.ndarray, str]:
    """The array as it goes into the file, and the dtype text recorded for it."""
    dtype = array.dtype
    ml_name = _ml_dtypes_name(dtype)
    if ml_name is not None:
        return array.view(np.dtype(f"<u{dtype.itemsize}")), ml_name
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None:
        raise CheckpointError(
            f"cannot checkpoint {key_path(where)}: arrays of dtype {dtype} are not supported "
            f"(only bool, integer, float, complex and ml_dtypes arrays; object arrays would need pickle)"
        )
    return array, dtype.str


def _sha256(array: np.ndarray) -> str:
    # A flat uint8 view of the C-contiguous array: hashed without copying it.
    return hashlib.sha256(array.reshape(-1).view(np.uint8)).hexdigest()


def _encode_float(value: float) -> Any:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _decode_float(value: Any) -> float:
    return float(value)  # float("nan"), float("-inf") and numbers alike


class _Encoder:
    """One pass over the state: collects arrays and builds the JSON tree."""

    def __init__(self) -> None:
        self.arrays: Dict[str, np.ndarray] = {}
        self._open: set = set()  # ids of the containers on the current path, to catch cycles

    def node(self, value: Any, where: Tuple[Any, ...]) -> Dict[str, Any]:
        if is_cupy_array(value):
            value = value.get()  # checkpoints hold host arrays; loading gives numpy
        if isinstance(value, np.str_):
            value = str(value)  # a str that happens to come out of numpy, not a string array
        # numpy scalars first: np.float64 is also a Python float, np.bool_ is not a bool.
        if isinstance(value, np.generic):
            return self._array(np.asarray(value), where, "scalar")
        if isinstance(value, np.ndarray):
            return self._array(value, where, "array")
        if value is None:
            return {"t": "none"}
        if isinstance(value, bool):
            return {"t": "bool", "v": value}
        if isinstance(value, int):
            return {"t": "int", "v": str(int(value))}
        if isinstance(value, float):
            return {"t": "float", "v": _encode_float(float(value))}
        if isinstance(value, str):
            return {"t": "str", "v": value}
        if isinstance(value, (dict, list, tuple)):
            return self._container(value, where)
        raise CheckpointError(
            f"cannot checkpoint {key_path(where)}: values of type {type(value).__module__}."
            f"{type(value).__qualname__} are not supported (use arrays, int, float, bool, str, None, "
            f"and dicts with str keys, lists or tuples of those)"
        )

    def _container(self, value: Any, where: Tuple[Any, ...]) -> Dict[str, Any]:
        if len(where) >= MAX_DEPTH:
            raise CheckpointError(f"cannot checkpoint {key_path(where[:3])}...: containers are nested more than "
                                  f"{MAX_DEPTH} deep, more than a checkpoint may hold")
        if id(value) in self._open:
            raise CheckpointError(f"cannot checkpoint {key_path(where)}: the container contains itself")
        self._open.add(id(value))
        try:
            if isinstance(value, dict):
                items: List[Any] = []
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise CheckpointError(
                            f"cannot checkpoint {key_path(where)}: dict key {key!r} is a "
                            f"{type(key).__name__}; only str keys are supported"
                        )
                    items.append([key, self.node(item, where + (key,))])
                return {"t": "dict", "items": items}
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {"t": kind, "items": [self.node(item, where + (i,)) for i, item in enumerate(value)]}
        finally:
            self._open.discard(id(value))

    def _array(self, array: np.ndarray, where: Tuple[Any, ...], tag: str) -> Dict[str, Any]:
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        contiguous = array if array.flags.c_contiguous else array.copy(order="C")
        stored, dtype_text = _storage_view(contiguous, where)
        entry = f"a{len(self.arrays)}"
        self.arrays[entry] = stored
        return {"t": tag, "entry": entry, "dtype": dtype_text, "shape": list(stored.shape),
                "sha256": _sha256(stored)}


def encode(state: Any, save: Optional[str] = None) -> Dict[str, np.ndarray]:
    """Flatten ``state`` (nested dicts, lists, tuples of arrays and plain scalars) into a checkpoint's entries.

    ``save``: the token of the directory save this file belongs to, recorded in the metadata (see
    ``checkpoint.directory``); None for a file of its own.

    Raises:
        CheckpointError: a value or key that cannot be stored, naming where it is; nesting deeper than
            ``MAX_DEPTH``; metadata larger than ``MAX_META_BYTES``.
    """
    encoder = _Encoder()
    tree = encoder.node(state, ())
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "tree": tree}
    if save is not None:
        meta["save"] = save
    data = json.dumps(meta, allow_nan=False, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_META_BYTES:
        raise CheckpointError(f"cannot checkpoint this state: its metadata takes {len(data)} bytes of JSON, more "
                              f"than the {MAX_META_BYTES} a checkpoint may hold ({len(encoder.arrays)} arrays)")
    entries = dict(encoder.arrays)
    entries[META_ENTRY] = np.frombuffer(data, dtype=np.uint8)
    return entries


def parse_meta(raw: np.ndarray, source: str) -> Dict[str, Any]:
    """The checked metadata of a checkpoint from its ``__meta__`` entry.

    Raises:
        CheckpointError: not JSON, not an axonhpc checkpoint, or a newer format version.
    """
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError(f"{source}: entry {META_ENTRY!r} is {raw.dtype} of shape {raw.shape}, "
                              f"not the uint8 JSON text of an axonhpc checkpoint")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{source}: the {META_ENTRY!r} entry is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or "tree" not in meta:
        raise CheckpointError(f"{source}: not an axonhpc checkpoint (its {META_ENTRY!r} entry does not "
                              f"describe format {FORMAT_NAME!r})")
    version = meta.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{source}: checkpoint format version {version!r}; this axonhpc reads "
                              f"versions 1 to {FORMAT_VERSION}")
    return meta


def _ml_dtype(name: str, source: str, where: Tuple[Any, ...]) -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as exc:
        raise CheckpointError(f"{source}: {key_path(where)} is a {name} array, which needs the ml_dtypes "
                              f"package (pip install 'axonhpc[bf16]')") from exc
    if not hasattr(ml_dtypes, name):
        raise CheckpointError(f"{source}: {key_path(where)} has dtype {name!r}, which this ml_dtypes "
                              f"{getattr(ml_dtypes, '__version__', '')} does not provide")
    return np.dtype(getattr(ml_dtypes, name))


class _Decoder:
    """One pass over the JSON tree, reading and verifying each array entry."""

    def __init__(self, entries: Archive, source: str) -> None:
        self.entries = entries
        self.source = source
        self.used: set = set()

    def fail(self, where: Tuple[Any, ...], problem: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {key_path(where)}: {problem}")

    def node(self, node: Any, where: Tuple[Any, ...]) -> Any:
        tag = node.get("t") if isinstance(node, dict) else None
        try:
            if tag in ("dict", "list", "tuple") and len(where) >= MAX_DEPTH:
                raise self.fail(where, f"the metadata is nested too deeply (more than {MAX_DEPTH} containers)")
            if tag == "dict":
                out = {}
                for key, item in node["items"]:
                    if not isinstance(key, str):
                        raise ArgumentTypeError(f"dict key {key!r} is not a str")
                    out[key] = self.node(item, where + (key,))
                return out
            if tag in ("list", "tuple"):
                items = [self.node(item, where + (i,)) for i, item in enumerate(node["items"])]
                return tuple(items) if tag == "tuple" else items
            if tag == "none":
                return None
            if tag in ("bool", "str"):
                value = node["v"]
                if not isinstance(value, bool if tag == "bool" else str):
                    raise ArgumentTypeError(f"a {tag} node holds {type(value).__name__}")
                return value
            if tag == "int":
                if not isinstance(node["v"], (str, int)) or isinstance(node["v"], bool):
                    raise ArgumentTypeError(f"an int node holds {type(node['v']).__name__}")
                return int(node["v"])
            if tag == "float":
                return _decode_float(node["v"])
            if tag in ("array", "scalar"):
                array = self._array(node, where)
                if tag == "scalar" and array.ndim != 0:
                    raise InvalidArgumentError(f"a scalar of shape {array.shape}")
                return array[()] if tag == "scalar" else array
        except (KeyError, TypeError, ValueError) as exc:
            raise self.fail(where, f"malformed metadata node {_brief(node)} ({type(exc).__name__}: {exc})") from exc
        raise self.fail(where, f"unknown metadata node {_brief(node)}")

    def _shape(self, node: Dict[str, Any]) -> Tuple[int, ...]:
        shape = node["shape"]
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise InvalidArgumentError(f"shape {shape!r} is not a list of at most {MAX_NDIM} non-negative integers")
        return tuple(shape)

    def _array(self, node: Dict[str, Any], where: Tuple[Any, ...]) -> np.ndarray:
        entry, dtype_text, shape = node["entry"], node["dtype"], self._shape(node)
        if not isinstance(entry, str) or not isinstance(dtype_text, str) or not isinstance(node["sha256"], str):
            raise ArgumentTypeError("entry, dtype and sha256 must be strings")
        if entry in self.used:
            raise self.fail(where, f"entry {entry!r} is described twice in the metadata")
        ml_dtype = None
        if dtype_text.startswith(("<", ">", "|", "=")):
            expected = np.dtype(dtype_text)
            if expected.kind not in _PLAIN_KINDS or expected.fields is not None or expected.subdtype is not None:
                raise InvalidArgumentError(f"dtype {dtype_text!r} is not a plain bool, integer, float or complex dtype")
        else:
            ml_dtype = _ml_dtype(dtype_text, self.source, where)
            expected = np.dtype(f"<u{ml_dtype.itemsize}")
        try:
            stored = self.entries.read(entry, expected, shape)
        except EntryRefused as exc:
            raise self.fail(where, str(exc)) from exc
        self.used.add(entry)
        digest = _sha256(stored)
        if digest != node["sha256"]:
            raise self.fail(where, f"checksum mismatch in entry {entry!r} (sha256 {digest}, recorded "
                                   f"{node['sha256']}): the file is corrupt")
        return stored.view(ml_dtype) if ml_dtype is not None else stored


def _brief(node: Any) -> str:
    """A metadata node for a message, cut short: a crafted one may be megabytes long."""
    text = repr(node)
    return text if len(text) <= 200 else text[:200] + "..."


def _described(tree: Any) -> set:
    """Entry names the metadata refers to (malformed nodes are skipped: decoding reports them)."""
    found, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("entry"), str):
            found.add(node["entry"])
        items = node.get("items")
        if isinstance(items, list):
            for item in items:
                stack.append(item[1] if node.get("t") == "dict" and isinstance(item, list) and len(item) == 2
                             else item)
    return found


def decode(meta: Dict[str, Any], entries: Archive, names: List[str], source: str) -> Any:
    """Rebuild the state tree from checked metadata and the archive's entries (``names``: all of them, to refuse extras).

    Raises:
        CheckpointError: a missing, unreadable, mistyped or corrupt entry, or a malformed or too deeply nested
            metadata node, naming its key.
    """
    extra = sorted(set(names) - _described(meta["tree"]) - {META_ENTRY})
    if extra:
        raise CheckpointError(f"{source}: entries {extra[:10]} are not described by the metadata; "
                              f"the file was altered after it was written")
    decoder = _Decoder(entries, source)
    return decoder.node(meta["tree"], ())
