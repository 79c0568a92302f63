"""Reading a checkpoint's ``.npz`` archive without trusting it: every size is checked before anything is allocated.

[Note: untrusted archives]
``numpy.load`` believes each member's ``.npy`` header (a declared shape ``(2**40,)`` allocates 8 TiB before a
byte is read), and zipfile believes the central directory. ``Archive`` refuses, before allocating: at opening,
names other than a plain ``<name>.npy``, duplicates, encryption, other compression methods, members beyond
the file or overlapping another (how a small zip expands to terabytes), inconsistent stored sizes, and deflate
ratios above ``MAX_DEFLATE_RATIO``; at reading, oversize or unusual ``.npy`` headers, non-plain dtypes,
Fortran order, a dtype or shape other than the metadata's, more than ``max_bytes``, and sizes that do not
match the header. So what an entry allocates is bounded by the file; the CRC and then ``format``'s sha256
are checked after. Nothing is written to disk, but odd names are refused since no writer makes them.

[Note: one header at a time]
``numpy.lib.format`` parses headers with ``ast.literal_eval``; on Python 3.11 ``ast`` keeps its recursion
depth in state shared by all threads, so two threads parsing at once (thread-backend ranks loading together)
can fail with ``SystemError: AST constructor recursion depth mismatch`` (CPython issue 106905).
``_HEADER_LOCK`` makes this module's header reads take turns; it cannot guard other libraries' calls.
"""
from __future__ import annotations

import io
import math
import os
import re
import stat
import struct
import threading
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from numpy.lib import format as npy_format

from ..errors import CheckpointEntryError, CheckpointError

MAX_DEFLATE_RATIO = 1032  # deflate's own ceiling: at most 258 bytes out per 2 bits in
MAX_HEADER_BYTES = 10_000  # numpy.load's own limit on a .npy header
_HEADER_LOCK = threading.Lock()  # see [Note: one header at a time]
_CHUNK = 1 << 24  # bytes copied per read into the new array

_MEMBER = re.compile(r"([A-Za-z0-9_]{1,128})\.npy")
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes
_PLAIN_KINDS = "biufc"


# One entry cannot be read safely; the message names the entry and the offending values.
EntryRefused = CheckpointEntryError


def _shape_text(shape: Sequence[int]) -> str:
    return str(tuple(shape))


class Archive:
    """An open checkpoint archive whose central directory passed the module note's checks (from ``open_archive``).

    Attributes:
        names: entry names (member names without ``.npy``), in file order.
    """

    def __init__(self, file: io.BufferedReader, archive: zipfile.ZipFile, infos: Dict[str, zipfile.ZipInfo]):
        self._file = file
        self._zip = archive
        self._infos = infos
        self.names: List[str] = list(infos)

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the zip and the file."""
        try:
            self._zip.close()
        finally:
            self._file.close()

    def read(self, entry: str, dtype: Optional[np.dtype] = None, shape: Optional[Tuple[int, ...]] = None,
             max_bytes: Optional[int] = None) -> np.ndarray:
        """A new C-contiguous array of ``entry``, its header checked against ``dtype``, ``shape`` and ``max_bytes``.

        Raises:
            EntryRefused: missing, unsafe, not as expected, truncated or failing its CRC.
        """
        info = self._infos.get(entry)
        if info is None:
            raise EntryRefused(f"entry {entry!r} is missing from the file")
        try:
            with self._zip.open(info) as member:
                header_len, got_dtype, got_shape = _read_npy_header(member, entry)
                nbytes = _check_header(entry, info, header_len, got_dtype, got_shape, dtype, shape, max_bytes)
                array = np.empty(got_shape, dtype=got_dtype)
                _fill(member, array, nbytes, entry)
        except EntryRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - CRC errors, truncated deflate streams, bad local headers
            raise EntryRefused(f"entry {entry!r} cannot be read ({type(exc).__name__}: {exc})") from exc
        return array


def _read_exact(member, n: int, entry: str, what: str) -> bytes:
    data = member.read(n)
    if len(data) != n:
        raise EntryRefused(f"entry {entry!r} ends inside its {what} ({len(data)} of {n} bytes)")
    return data


def _read_npy_header(member, entry: str) -> Tuple[int, np.dtype, Tuple[int, ...]]:
    """(header length in bytes, dtype, shape) of the ``.npy`` member, read with bounded sizes."""
    magic = _read_exact(member, npy_format.MAGIC_LEN, entry, ".npy magic string")
    try:
        version = npy_format.read_magic(io.BytesIO(magic))
    except ValueError as exc:
        raise EntryRefused(f"entry {entry!r} is not a .npy array ({exc})") from exc
    if version not in ((1, 0), (2, 0)):
        raise EntryRefused(f"entry {entry!r} is a .npy file of version {version[0]}.{version[1]}; "
                           f"checkpoints use versions 1.0 and 2.0")
    length_format = "<H" if version == (1, 0) else "<I"
    length_bytes = _read_exact(member, struct.calcsize(length_format), entry, ".npy header length")
    length = struct.unpack(length_format, length_bytes)[0]
    if length > MAX_HEADER_BYTES:
        raise EntryRefused(f"entry {entry!r} declares a .npy header of {length} bytes (at most "
                           f"{MAX_HEADER_BYTES} are read)")
    text = _read_exact(member, length, entry, ".npy header")
    reader = io.BytesIO(magic + length_bytes + text)
    reader.seek(npy_format.MAGIC_LEN)
    try:
        read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        with _HEADER_LOCK:
            shape, fortran_order, dtype = read_header(reader, max_header_size=MAX_HEADER_BYTES)
    except Exception as exc:  # noqa: BLE001 - literal_eval and dtype errors of a crafted header
        raise EntryRefused(f"entry {entry!r} has an unreadable .npy header ({type(exc).__name__}: {exc})") from exc
    if dtype.hasobject:
        raise EntryRefused(f"entry {entry!r} holds Python objects (dtype {dtype}), which only unpickling could "
                           f"read; checkpoints are read with allow_pickle=False")
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise EntryRefused(f"entry {entry!r} has dtype {dtype}; checkpoints hold bool, integer, float and "
                           f"complex arrays only")
    if fortran_order:
        raise EntryRefused(f"entry {entry!r} is stored in Fortran order (shape {_shape_text(shape)}); "
                           f"checkpoints store C order")
    if any(d < 0 for d in shape):
        raise EntryRefused(f"entry {entry!r} declares the negative shape {_shape_text(shape)}")
    return len(magic) + len(length_bytes) + length, dtype, tuple(shape)


def _check_header(entry: str, info: zipfile.ZipInfo, header_len: int, dtype: np.dtype, shape: Tuple[int, ...],
                  want_dtype: Optional[np.dtype], want_shape: Optional[Tuple[int, ...]],
                  max_bytes: Optional[int]) -> int:
    """Compare the header with the caller's expectation and the member's size; the data bytes."""
    if (want_dtype is not None and dtype != want_dtype) or (want_shape is not None and shape != tuple(want_shape)):
        raise EntryRefused(f"entry {entry!r} holds {dtype} of shape {_shape_text(shape)}, the metadata records "
                           f"{want_dtype if want_dtype is not None else dtype} of shape "
                           f"{_shape_text(want_shape if want_shape is not None else shape)}")
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow however large the claim
    if max_bytes is not None and nbytes > max_bytes:
        raise EntryRefused(f"entry {entry!r} declares {dtype} of shape {_shape_text(shape)}, {nbytes} bytes; "
                           f"at most {max_bytes} are allowed here")
    if info.file_size != header_len + nbytes:
        raise EntryRefused(f"entry {entry!r}: its .npy header declares {dtype} of shape {_shape_text(shape)} "
                           f"({header_len} header bytes + {nbytes} data bytes = {header_len + nbytes}), but the "
                           f"zip member holds {info.file_size} bytes")
    return nbytes


def _fill(member, array: np.ndarray, nbytes: int, entry: str) -> None:
    """Read exactly ``nbytes`` into ``array``'s memory; the zip CRC is checked at the last byte."""
    view = memoryview(array.reshape(-1).view(np.uint8)) if nbytes else memoryview(b"")
    done = 0
    while done < nbytes:
        got = member.readinto(view[done:done + _CHUNK])
        if not got:
            raise EntryRefused(f"entry {entry!r} ends after {done} of its {nbytes} data bytes (truncated)")
        done += got
    if member.read(1):
        raise EntryRefused(f"entry {entry!r} holds more than the {nbytes} data bytes its header declares")


def _check_member(source: str, info: zipfile.ZipInfo, file_size: int, raw) -> Tuple[int, int]:
    """Central-directory checks of one member; returns the byte span of its local header and data."""
    name = info.filename
    if info.flag_bits & 0x1:
        raise CheckpointError(f"{source}: zip member {name!r} is encrypted; checkpoints are not")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise CheckpointError(f"{source}: zip member {name!r} uses compression method {info.compress_type}; "
                              f"only stored (0) and deflate (8) are read")
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        raise CheckpointError(f"{source}: zip member {name!r} is stored uncompressed but declares "
                              f"{info.compress_size} stored and {info.file_size} uncompressed bytes")
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > info.compress_size * MAX_DEFLATE_RATIO:
        raise CheckpointError(f"{source}: zip member {name!r} declares {info.file_size} uncompressed bytes from "
                              f"{info.compress_size} compressed ones, more than deflate can produce "
                              f"({MAX_DEFLATE_RATIO}:1): a zip bomb or a corrupt directory")
    start = info.header_offset
    if start < 0 or start + _LOCAL_HEADER.size > file_size:
        raise CheckpointError(f"{source}: zip member {name!r} starts at byte {start}, outside the file of "
                              f"{file_size} bytes")
    raw.seek(start)
    fields = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
    if fields[0] != b"PK\x03\x04":
        raise CheckpointError(f"{source}: zip member {name!r} has no local header at byte {start}")
    stop = start + _LOCAL_HEADER.size + fields[-2] + fields[-1] + info.compress_size
    if stop > file_size:
        raise CheckpointError(f"{source}: zip member {name!r} declares {info.compress_size} bytes of data "
                              f"ending at byte {stop}, but the file has {file_size} bytes (truncated, or a "
                              f"size no file this large could hold)")
    return start, stop


def open_archive(path: str, source: str) -> Archive:
    """Open ``path`` and check its zip directory; ``source`` is how messages name it.

    Raises:
        CheckpointError: no such file, not a regular file, a single ``.npy``, not a zip, or a zip directory
            that fails a check, naming the member and values.
    """
    try:
        # O_NONBLOCK: a FIFO planted under a checkpoint's name must not block the open forever
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{source}: no such file") from exc
    except OSError as exc:
        raise CheckpointError(f"{source} cannot be read as an npz archive without pickle "
                              f"({type(exc).__name__}: {exc})") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CheckpointError(f"{source} is not a regular file (mode {stat.filemode(info.st_mode)})")
    raw = os.fdopen(fd, "rb")
    try:
        file_size = info.st_size
        if raw.read(len(npy_format.MAGIC_PREFIX)) == npy_format.MAGIC_PREFIX:
            raise CheckpointError(f"{source} is a single .npy array, not an axonhpc checkpoint (.npz)")
        raw.seek(0)
        try:
            archive = zipfile.ZipFile(raw)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error to the caller
            raise CheckpointError(f"{source} cannot be read as an npz archive without pickle "
                                  f"({type(exc).__name__}: {exc})") from exc
        try:
            infos: Dict[str, zipfile.ZipInfo] = {}
            spans = []
            for info in archive.infolist():
                match = _MEMBER.fullmatch(info.filename)
                if match is None:
                    raise CheckpointError(f"{source}: zip member {info.filename!r} is not an array entry (a "
                                          f"checkpoint holds only '<name>.npy' members, the name of letters, "
                                          f"digits and '_'; no directories or '..')")
                entry = match.group(1)
                if entry in infos:
                    raise CheckpointError(f"{source}: zip member {info.filename!r} appears more than once")
                spans.append(_check_member(source, info, file_size, raw) + (info.filename,))
                infos[entry] = info
            spans.sort()
            for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
                if start < end:
                    raise CheckpointError(f"{source}: zip members {first!r} and {second!r} overlap (bytes "
                                          f"{start} to {end}): a zip bomb or a corrupt directory")
        except BaseException:
            archive.close()
            raise
    except BaseException:
        raw.close()
        raise
    return Archive(raw, archive, infos)


__all__ = ["Archive", "EntryRefused", "open_archive", "MAX_DEFLATE_RATIO", "MAX_HEADER_BYTES"]
