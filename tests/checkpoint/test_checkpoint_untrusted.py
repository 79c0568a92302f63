"""Checkpoints from untrusted sources: crafted, truncated and corrupted files are refused with a clear
CheckpointError, before anything large is allocated, and checkpoint directories cannot point outside themselves."""
import gc
import hashlib
import io
import json
import os
import struct
import sys
import threading
import tracemalloc
import zipfile

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import checkpoint
from axonhpc.checkpoint import load, load_per_rank, save, save_per_rank
from axonhpc.checkpoint import archive
from axonhpc.checkpoint import format as ckpt_format
from axonhpc.checkpoint import io as ckpt_io
from axonhpc.checkpoint.directory import (
    INDEX,
    MAX_WORLD_SIZE,
    PER_RANK_FORMAT,
    member_path,
    rank_file,
    save_directory,
)
from axonhpc.checkpoint.format import encode
from axonhpc.errors import CheckpointError
from axonhpc.groups import ProcessGroup

ONE = ProcessGroup.mock()
HUGE = 2**40  # elements: 8 TiB of float64
ZEROS_SHA = hashlib.sha256(np.zeros(4).tobytes()).hexdigest()


# ------------------------------------------------------------------------------------ crafting files by hand

def npy_bytes(dtype, shape, data=b"", fortran_order=False, version=(1, 0)):
    """A .npy member whose header says whatever we like, followed by ``data``."""
    out = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": fortran_order,
              "shape": tuple(shape)}
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(out, header)
    else:
        np.lib.format.write_array_header_2_0(out, header)
    return out.getvalue() + data


def npy_of(array):
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def meta_bytes(tree):
    return npy_of(np.frombuffer(json.dumps({"format": "axonhpc-checkpoint", "version": 1, "tree": tree}).encode(),
                                np.uint8))


def array_node(entry, dtype, shape, sha="0" * 64):
    return {"t": "array", "entry": entry, "dtype": np.dtype(dtype).str, "shape": list(shape), "sha256": sha}


def write_zip(path, members, compression=zipfile.ZIP_STORED):
    """``members``: list of (member name, bytes); written in that order, duplicates and all."""
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, data in members:
            zf.writestr(zipfile.ZipInfo(name), data, compress_type=compression)


def members_of(state):
    """The (member name, bytes) of the file ``save`` writes for ``state``."""
    return [(f"{name}.npy", npy_of(array)) for name, array in encode(state).items()]


def patch_member(path, member, *, compress_size=None, file_size=None, offset=None):
    """Overwrite fields of ``member``'s central directory entry (and its local header's sizes)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(member).header_offset
        at = zf.start_dir
    while data[at:at + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack("<3H", data[at + 28:at + 34])
        if bytes(data[at + 46:at + 46 + n]) == member.encode():
            if compress_size is not None:
                data[at + 20:at + 24] = struct.pack("<L", compress_size)
                data[local + 18:local + 22] = struct.pack("<L", compress_size)
            if file_size is not None:
                data[at + 24:at + 28] = struct.pack("<L", file_size)
                data[local + 22:local + 26] = struct.pack("<L", file_size)
            if offset is not None:
                data[at + 42:at + 46] = struct.pack("<L", offset)
            path.write_bytes(bytes(data))
            return
        at += 46 + n + m + k
    raise AssertionError(f"no central directory entry for {member}")


def refused(path, *fragments):
    """Load ``path``; it must raise CheckpointError naming the path and every fragment. Returns the message."""
    with pytest.raises(CheckpointError) as info:
        load(path, group=ONE)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


def refused_small(path, *fragments, limit_mb=8):
    """``refused``, and the refusal allocated less than ``limit_mb`` on the way (tracemalloc sees numpy)."""
    tracemalloc.start()
    try:
        message = refused(path, *fragments)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit_mb * 2**20, f"peak {peak} bytes while refusing {path}"
    return message


# ------------------------------------------------------------------------------------ lying sizes

def test_a_member_declaring_a_huge_shape_is_refused_before_allocating(tmp_path):
    """The metadata says (4,); the .npy header claims 2**40 elements: numpy.load would allocate 8 TiB."""
    path = tmp_path / "huge.npz"
    write_zip(path, [("__meta__.npy", meta_bytes({"t": "dict", "items": [["w", array_node("a0", "<f8", (4,))]]})),
                     ("a0.npy", npy_bytes("<f8", (HUGE,), b"\0" * 32))])
    refused_small(path, "state['w']", "entry 'a0' holds float64 of shape (1099511627776,)",
                  "the metadata records float64 of shape (4,)")


def test_metadata_and_header_agreeing_on_a_huge_shape_is_refused_by_the_member_size(tmp_path):
    path = tmp_path / "huge.npz"
    write_zip(path, [("__meta__.npy", meta_bytes({"t": "array", "entry": "a0", "dtype": "<f8", "shape": [HUGE],
                                                  "sha256": "0" * 64})),
                     ("a0.npy", npy_bytes("<f8", (HUGE,), b"\0" * 32))])
    refused_small(path, "state: entry 'a0'", "declares float64 of shape (1099511627776,)",
                  "8796093022208 data bytes", "but the zip member holds 160 bytes")


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_zip_directory_lying_about_sizes_too_is_refused(tmp_path, compression):
    """Metadata, .npy header and zip directory all claim 2 GiB; the file holds a few hundred bytes."""
    n = 2**28  # float64: 2 GiB, still within the 32-bit zip fields
    path = tmp_path / "bomb.npz"
    node = {"t": "array", "entry": "a0", "dtype": "<f8", "shape": [n], "sha256": "0" * 64}
    member = npy_bytes("<f8", (n,), b"\0" * 64)
    write_zip(path, [("__meta__.npy", meta_bytes(node)), ("a0.npy", member)], compression)
    header_len = len(npy_bytes("<f8", (n,)))
    if compression == zipfile.ZIP_STORED:
        patch_member(path, "a0.npy", compress_size=header_len + 8 * n, file_size=header_len + 8 * n)
        refused_small(path, "zip member 'a0.npy' declares", f"{header_len + 8 * n} bytes of data",
                      f"but the file has {path.stat().st_size} bytes")
    else:
        patch_member(path, "a0.npy", file_size=header_len + 8 * n)
        refused_small(path, "zip member 'a0.npy' declares", f"{header_len + 8 * n} uncompressed bytes",
                      "more than deflate can produce (1032:1)")


def test_stored_members_with_two_different_sizes_are_refused(tmp_path):
    path = tmp_path / "c.npz"
    write_zip(path, members_of({"w": np.zeros(4)}))
    size = zipfile.ZipFile(path).getinfo("a0.npy").file_size
    patch_member(path, "a0.npy", file_size=size + 1000)
    refused_small(path, "zip member 'a0.npy' is stored uncompressed but declares", f"{size + 1000} uncompressed")


def test_overlapping_members_are_refused(tmp_path):
    """Two directory entries sharing one stretch of data: how a small zip expands to terabytes."""
    path = tmp_path / "overlap.npz"
    write_zip(path, members_of({"a": np.zeros(100), "b": np.zeros(100)}))
    with zipfile.ZipFile(path) as zf:
        first = zf.getinfo("a0.npy").header_offset
    patch_member(path, "a1.npy", offset=first)
    refused_small(path, "zip members 'a0.npy' and 'a1.npy' overlap")


def test_a_deflated_checkpoint_within_the_ratio_still_loads(tmp_path):
    """Compression itself is fine (np.savez_compressed writes it), only impossible ratios are refused."""
    path = tmp_path / "deflated.npz"
    state = {"zeros": np.zeros(100_000), "w": np.arange(10.0)}
    write_zip(path, members_of(state), zipfile.ZIP_DEFLATED)
    out = load(path, group=ONE)
    assert out["zeros"].tobytes() == state["zeros"].tobytes() and out["w"].tobytes() == state["w"].tobytes()


def test_other_compression_methods_and_encryption_are_refused(tmp_path):
    path = tmp_path / "bz2.npz"
    write_zip(path, members_of({"w": np.zeros(4)}), zipfile.ZIP_BZIP2)
    refused(path, "uses compression method 12; only stored (0) and deflate (8) are read")
    path = tmp_path / "encrypted.npz"
    write_zip(path, members_of({"w": np.zeros(4)}))
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        at = zf.start_dir
    data[at + 8] |= 0x1  # the central directory's "encrypted" flag of the first member
    path.write_bytes(bytes(data))
    refused(path, "is encrypted")


# ------------------------------------------------------------------------------------ crafted headers

@pytest.mark.parametrize("member,fragments", [
    (npy_bytes("<f8", (4,), b"\0" * 32, fortran_order=True), ["Fortran order"]),
    (npy_bytes("<f8", (4,), b"\0" * 32, version=(2, 0)), ["checksum mismatch"]),  # 2.0 is read; data is wrong
    (b"\x93NUMPY\x03\x00" + b"\0" * 100, ["version 3.0"]),
    (b"\x93NUMPY\x01\x00" + struct.pack("<H", 60000) + b" " * 100, ["header of 60000 bytes"]),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': <f8'  \n", ["unreadable .npy header"]),
    (npy_bytes([("x", "<f8")], (4,), b"\0" * 32), ["has dtype [('x', '<f8')]; checkpoints hold bool"]),
    (npy_bytes("<U2", (4,), b"\0" * 32), ["has dtype <U2"]),
    (npy_bytes("<f8", (-4,), b"\0" * 32), ["negative shape (-4,)"]),
    (b"NOTNUMPY" + b"\0" * 100, ["is not a .npy array"]),
    (b"\x93NU", ["ends inside its .npy magic string"]),
    (npy_bytes("<f8", (4,), b"\0" * 31), ["(128 header bytes + 32 data bytes = 160), but the zip member holds 159"]),
    (npy_bytes("<f8", (4,), b"\0" * 33), ["but the zip member holds 161"]),
])
def test_crafted_npy_headers_are_refused(tmp_path, member, fragments):
    path = tmp_path / "c.npz"
    meta = meta_bytes({"t": "dict", "items": [["w", array_node("a0", "<f8", (4,))]]})
    write_zip(path, [("__meta__.npy", meta), ("a0.npy", member)])
    refused(path, "state['w']", "entry 'a0'", *fragments)


@pytest.mark.parametrize("shape,problem", [
    ([-1], "shape [-1] is not a list"),
    ([2.5], "shape [2.5]"),
    (["4"], "shape ['4']"),
    ([1] * 65, "at most 64"),
    ("4", "shape '4'"),
    ([True], "shape [True]"),
])
def test_absurd_shapes_in_the_metadata_are_refused(tmp_path, shape, problem):
    path = tmp_path / "c.npz"
    node = {"t": "array", "entry": "a0", "dtype": "<f8", "shape": shape, "sha256": "0" * 64}
    write_zip(path, [("__meta__.npy", meta_bytes({"t": "dict", "items": [["w", node]]})),
                     ("a0.npy", npy_of(np.zeros(4)))])
    refused_small(path, "state['w']: malformed metadata node", problem)


@pytest.mark.parametrize("node,problem", [
    ({"t": "bool", "v": [1, 2]}, "a bool node holds list"),
    ({"t": "str", "v": 3}, "a str node holds int"),
    ({"t": "int", "v": [1]}, "an int node holds list"),
    ({"t": "int", "v": "9" * 5000}, "ValueError"),
    ({"t": "dict", "items": [[3, {"t": "none"}]]}, "dict key 3 is not a str"),
    ({"t": "scalar", "entry": "a0", "dtype": "<f8", "shape": [4], "sha256": None}, "must be strings"),
    ({"t": "array", "entry": "a0", "dtype": "|O", "shape": [4], "sha256": "0" * 64}, "not a plain"),
    ({"t": "array", "entry": "a0", "dtype": "finfo", "shape": [4], "sha256": "0" * 64}, "malformed"),
    ({"t": "list", "items": [array_node("a0", "<f8", (4,), ZEROS_SHA), array_node("a0", "<f8", (4,), ZEROS_SHA)]},
     "entry 'a0' is described twice"),
    ({"t": "what"}, "unknown metadata node"),
])
def test_malformed_metadata_nodes_are_refused(tmp_path, node, problem):
    path = tmp_path / "c.npz"
    data = [("a0.npy", npy_of(np.zeros(4)))] if "a0" in json.dumps(node) else []
    write_zip(path, [("__meta__.npy", meta_bytes({"t": "dict", "items": [["w", node]]}))] + data)
    refused(path, "state['w']", problem)


def test_metadata_larger_than_the_cap_is_refused_before_reading_it(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    save(path, {"name": "x" * 5000}, group=ONE)
    monkeypatch.setattr(ckpt_io, "MAX_META_BYTES", 4096)
    refused_small(path, "entry '__meta__' cannot be read", "at most 4096 are allowed here")
    monkeypatch.setattr(ckpt_format, "MAX_META_BYTES", 4096)
    with pytest.raises(CheckpointError, match="more than the 4096 a checkpoint may hold"):
        save(tmp_path / "d.npz", {"name": "x" * 5000}, group=ONE)


def test_nesting_is_capped_the_same_way_on_save_and_load(tmp_path):
    deepest = []
    for _ in range(ckpt_format.MAX_DEPTH - 1):
        deepest = [deepest]
    assert load_round_trip(tmp_path, deepest) == deepest  # exactly MAX_DEPTH containers
    with pytest.raises(CheckpointError, match="nested more than 100 deep"):
        save(tmp_path / "deeper.npz", [deepest], group=ONE)
    tree = {"t": "list", "items": []}
    for _ in range(150):  # deeper than the cap, shallow enough for Python's JSON reader
        tree = {"t": "list", "items": [tree]}
    path = tmp_path / "deep.npz"
    write_zip(path, [("__meta__.npy", meta_bytes(tree))])
    refused(path, "nested too deeply")


def load_round_trip(tmp_path, state):
    save(tmp_path / "rt.npz", state, group=ONE)
    return load(tmp_path / "rt.npz", group=ONE)


# ------------------------------------------------------------------------------------ names and entries

@pytest.mark.parametrize("name", ["../a0.npy", "../../etc/passwd", "/abs.npy", "sub/a0.npy", "a0", "a0.npy.exe",
                                  "..npy", "a\\b.npy", "notes.txt"])
def test_members_that_are_not_plain_array_entries_are_refused(tmp_path, name):
    path = tmp_path / "c.npz"
    write_zip(path, members_of({"w": np.zeros(4)}) + [(name, npy_of(np.zeros(1)))])
    refused(path, f"zip member {name!r} is not an array entry")


def test_extra_and_duplicate_entries_are_refused(tmp_path):
    path = tmp_path / "extra.npz"
    write_zip(path, members_of({"w": np.zeros(4)}) + [("evil.npy", npy_of(np.zeros(1)))])
    refused(path, "entries ['evil'] are not described by the metadata")
    path = tmp_path / "dup.npz"
    with pytest.warns(UserWarning, match="Duplicate name"):
        write_zip(path, members_of({"w": np.zeros(4)}) + [("a0.npy", npy_of(np.ones(4)))])
    refused(path, "zip member 'a0.npy' appears more than once")


# ------------------------------------------------------------------------------------ damage

def test_every_truncation_is_refused(tmp_path):
    path = tmp_path / "c.npz"
    save(path, {"model": {"w": np.arange(200.0), "b": np.ones(3, np.float32)}, "step": 7}, group=ONE)
    data = path.read_bytes()
    cut = tmp_path / "cut.npz"
    lengths = sorted(set(range(0, len(data), 97)) | {1, 6, len(data) - 22, len(data) - 1})
    for length in lengths:
        cut.write_bytes(data[:length])
        refused(cut)
    assert len(lengths) > 10


def test_every_flipped_byte_is_refused_or_harmless(tmp_path):
    """Flip each byte of a small checkpoint: it loads exactly as saved (a byte nobody reads, such as a
    zip timestamp) or raises CheckpointError; never another exception, never other values."""
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 3, "name": "run"}
    path = tmp_path / "c.npz"
    save(path, state, group=ONE)
    data = path.read_bytes()
    bad = tmp_path / "flipped.npz"
    outcomes = {"refused": 0, "harmless": 0}
    for at in range(len(data)):
        damaged = bytearray(data)
        damaged[at] ^= 0xFF
        bad.write_bytes(bytes(damaged))
        try:
            out = load(bad, group=ONE)
        except CheckpointError as exc:
            assert str(bad) in str(exc)
            outcomes["refused"] += 1
            continue
        assert out["w"].tobytes() == state["w"].tobytes() and out["w"].dtype == state["w"].dtype, at
        assert out["w"].shape == (2, 3) and out["step"] == 3 and out["name"] == "run", at
        outcomes["harmless"] += 1
    assert outcomes["refused"] > len(data) // 2, outcomes


def test_a_flipped_byte_in_the_data_names_the_key(tmp_path):
    path = tmp_path / "c.npz"
    marker = np.arange(64, dtype=np.float64) + 0.25
    save(path, {"opt": {"m": marker}}, group=ONE)
    data = bytearray(path.read_bytes())
    data[data.find(marker.tobytes()) + 100] ^= 0x01
    path.write_bytes(bytes(data))
    refused(path, "state['opt']['m']", "entry 'a0' cannot be read", "CRC")


# ------------------------------------------------------------------------------------ directories

def save_one_rank_dir(path, state, extra=None):
    save_per_rank(path, state, group=ONE, extra=extra)


def rewrite_index(path, index):
    save(os.path.join(path, INDEX), index, group=ONE)


@pytest.mark.parametrize("world_size", ["../../etc/passwd", "/etc/passwd", -1, 0, MAX_WORLD_SIZE + 1, 2**70,
                                        1.0, True, None, [1]])
def test_per_rank_index_values_are_checked_before_use(tmp_path, world_size):
    path = str(tmp_path / "ckpt")
    save_one_rank_dir(path, {"w": np.zeros(2)})
    rewrite_index(path, {"format": PER_RANK_FORMAT, "world_size": world_size, "extra": None})
    with pytest.raises(CheckpointError) as info:
        load_per_rank(path, group=ONE)
    message = str(info.value)
    assert path in message and f"world_size={world_size!r}"[:40] in message and "expected an integer" in message


def test_file_names_outside_the_directory_are_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    for name in ["../../etc/passwd", "/etc/passwd", "..", ".", "", "sub/x.npz", "a\0b"]:
        with pytest.raises(CheckpointError, match="is not a plain file name"):
            member_path(root, name, "rank file of rank 0")
    with pytest.raises(CheckpointError, match="'../x.npz' is not a plain file name"):
        save_directory(root, ONE, ("../x.npz", lambda: {"w": 1}), lambda: {"format": "x"})
    with pytest.raises(CheckpointError, match="may not be named 'index.npz'"):
        save_directory(root, ONE, (INDEX, lambda: {"w": 1}), lambda: {"format": "x"})
    assert os.listdir(tmp_path) == ["ckpt"]  # nothing written beside the directory


def test_a_rank_file_symlinked_outside_the_directory_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    save_one_rank_dir(path, {"w": np.zeros(2)})
    outside = str(tmp_path / "elsewhere.npz")
    save(outside, {"w": np.full(2, 666.0)}, group=ONE)  # a valid checkpoint: only the location is wrong
    name = os.path.join(path, rank_file(0, 1))
    os.remove(name)
    os.symlink(outside, name)
    with pytest.raises(CheckpointError) as info:
        load_per_rank(path, group=ONE)
    message = str(info.value)
    assert "rank file of rank 0 'rank-00000-of-00001.npz' resolves to" in message
    assert outside in message and "outside the checkpoint directory" in message


def test_an_index_symlinked_outside_is_refused_and_links_inside_are_fine(tmp_path):
    path = str(tmp_path / "ckpt")
    save_one_rank_dir(path, {"w": np.arange(2.0)}, extra={"step": 1})
    # A link inside the directory, and the directory itself reached through a link: fine.
    os.rename(os.path.join(path, rank_file(0, 1)), os.path.join(path, "real.npz"))
    os.symlink("real.npz", os.path.join(path, rank_file(0, 1)))
    os.symlink(path, str(tmp_path / "latest"))
    state, extra = load_per_rank(str(tmp_path / "latest"), group=ONE)
    assert state["w"].tolist() == [0.0, 1.0] and extra == {"step": 1}
    other = str(tmp_path / "other")
    save_one_rank_dir(other, {"w": np.zeros(2)})
    os.remove(os.path.join(path, INDEX))
    os.symlink(os.path.join(other, INDEX), os.path.join(path, INDEX))
    with pytest.raises(CheckpointError, match=r"the index 'index.npz' resolves to .*outside the checkpoint"):
        load_per_rank(path, group=ONE)


# ------------------------------------------------------------------------------------ sharded directories

def _fsdp_case(path, world_size=1):
    from support.ddp_cases import make_model, make_optimizer

    def body(world):
        fsdp = ax.FSDP(make_model(), group=world.default_group)
        opt = make_optimizer("adam", fsdp.parameters())
        checkpoint.save_sharded(path, fsdp, opt, extra={"step": 1})
        return fsdp

    return body


def _load_sharded(path):
    from support.ddp_cases import make_model

    def body(world):
        fsdp = ax.FSDP(make_model(), group=world.default_group)
        try:
            checkpoint.load_sharded(path, fsdp)
        except CheckpointError as exc:
            return str(exc)
        return None

    return ax.run_local(body, world_size=1)[0]


@pytest.mark.parametrize("change,fragment", [
    ({"shard_world_size": "../../etc/passwd"}, "shard_world_size='../../etc/passwd'; expected an integer"),
    ({"shard_world_size": 2**40}, "shard_world_size=1099511627776; expected an integer from 1 to 16777216"),
    ({"shard_world_size": 0}, "shard_world_size=0"),
    ({"units": ["x"]}, "units=list; expected a dict"),
    ({"units": "unit0"}, "units=str"),
])
def test_sharded_index_values_are_checked_before_use(tmp_path, change, fragment):
    path = str(tmp_path / "ckpt")
    ax.run_local(_fsdp_case(path), world_size=2)
    index = load(os.path.join(path, INDEX), group=ONE)
    rewrite_index(path, dict(index, **change))
    message = _load_sharded(path)
    assert message is not None and path in message and fragment in message, message


def test_sharded_unit_sizes_must_be_integers(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(_fsdp_case(path), world_size=2)
    index = load(os.path.join(path, INDEX), group=ONE)
    name = next(iter(index["units"]))
    rewrite_index(path, dict(index, units=dict(index["units"], **{name: "1e99"})))
    message = _load_sharded(path)
    assert message is not None and f"{name}='1e99'; expected an integer" in message, message


def test_a_shard_file_symlinked_outside_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(_fsdp_case(path), world_size=2)
    elsewhere = str(tmp_path / "elsewhere")
    ax.run_local(_fsdp_case(elsewhere), world_size=2)
    shard = os.path.join(path, "shard-00001-of-00002.npz")
    os.remove(shard)
    os.symlink(os.path.join(elsewhere, "shard-00001-of-00002.npz"), shard)
    message = _load_sharded(path)
    assert message is not None and "shard file 1 'shard-00001-of-00002.npz' resolves to" in message, message
    assert _load_sharded(elsewhere) is None  # the untouched copy still loads


def test_a_fifo_or_device_under_a_checkpoint_name_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "ckpt")
    save_one_rank_dir(path, {"w": np.zeros(2)})
    name = os.path.join(path, rank_file(0, 1))
    os.remove(name)
    os.mkfifo(name)  # opening a FIFO for reading blocks until a writer comes: never, here
    with pytest.raises(CheckpointError, match=r"is not a regular file \(mode p"):
        load_per_rank(path, group=ONE)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        load("/dev/zero", group=ONE)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        load(tmp_path, group=ONE)  # a directory


def test_an_index_without_its_extra_entry_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    save_one_rank_dir(path, {"w": np.zeros(2)})
    rewrite_index(path, {"format": PER_RANK_FORMAT, "world_size": 1})
    with pytest.raises(CheckpointError, match=r"the index has no 'extra' entry \(keys \['format', 'world_size'\]\)"):
        load_per_rank(path, group=ONE)


# ------------------------------------------------------------------------------------ threads

class _Finalized:
    """Cyclic garbage whose finalizer runs Python code, so a collection can switch threads mid-AST."""

    def __del__(self):
        total = 0
        for i in range(50):
            total += i


def test_headers_read_by_many_threads_at_once_are_all_read(monkeypatch):
    # [Note: one header at a time]: ranks of the thread backend load together; on Python 3.11 two
    # threads inside ast at once fail with "AST constructor recursion depth mismatch".
    member = npy_of(np.zeros((3, 4)))
    failures = []

    def reader():
        try:
            for _ in range(2000):
                garbage = _Finalized()
                garbage.cycle = garbage
                assert archive._read_npy_header(io.BytesIO(member), "a0")[1:] == (np.dtype("<f8"), (3, 4))
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            failures.append(repr(exc))

    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(5, 1, 1)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=reader) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    assert failures == []
