"""Checkpoints of global arrays held in pieces: saved under one parallel layout, loaded bit for bit under another.

The layouts are functions of (rank, size): rows, columns or a 2-D grid of
blocks of every array (uneven where the size does not divide), with 0-d
arrays replicated on every rank. The same cases run on thread-ranks at world
sizes 1 to 4 and, marked ``mpi``, on the ranks of an mpiexec job.
"""
import contextlib
import doctest
import math
import os
import shutil
import signal
import sys
import tempfile
import threading

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import checkpoint
from axonhpc.checkpoint import Box, latest, load, load_slices, read_full, save, save_slices
from axonhpc.checkpoint import archive as archive_module
from axonhpc.checkpoint import directory as directory_module
from axonhpc.checkpoint import slice_load, sliced
from axonhpc.checkpoint.directory import INDEX, MAX_WORLD_SIZE
from axonhpc.checkpoint.format import encode
from axonhpc.checkpoint.io import read_saved, write_atomic
from axonhpc.checkpoint.sliced import INDEX_FORMAT, MAX_PIECES_PER_FILE, flat_range_boxes, plan_slices, slice_file
from axonhpc.errors import CheckpointError
from axonhpc.groups import ProcessGroup
from support.crash_child import expect_line, kill_when_written, start_child
from support.mpi_assert import collectively

try:
    import ml_dtypes
except ImportError:  # the bf16 extra is optional
    ml_dtypes = None

ONE = ProcessGroup.mock()


# ------------------------------------------------------------------------------------ arrays and layouts

def reference():
    """The global arrays every layout cuts: odd sizes, three dtypes, 0-d, 1-d and empty arrays.

    The floats hold NaN, -0.0 and infinities, so only a bit-exact round trip passes.
    """
    rng = np.random.default_rng(19)
    w = rng.standard_normal((7, 5))
    w[0, 0], w[3, 4], w[6, 2] = np.nan, -0.0, -np.inf
    v = rng.standard_normal(13).astype(np.float32)
    v[5] = np.float32(-0.0)
    return {
        "w": w,                                                          # float64 7 x 5
        "v": v,                                                          # float32, 13
        "i": rng.integers(-2**62, 2**62, size=(4, 6), dtype=np.int64),  # int64 4 x 6
        "step": np.array(123456789012, dtype=np.int64),                 # 0-d int64
        "scale": np.array(0.1, dtype=np.float32),                       # 0-d float32
        "empty": np.zeros((0, 3), dtype=np.float64),
    }


def grid(size):
    """A 2-D grid of ``size`` blocks: (1, 1), (1, 2), (1, 3), (2, 2)."""
    rows = max(d for d in range(1, int(math.isqrt(size)) + 1) if size % d == 0)
    return rows, size // rows


def layout_box(shape, layout, rank, size):
    """This rank's box of an array of ``shape`` under ``layout`` (``rows``, ``cols`` or ``blocks``)."""
    box = Box.full(shape)
    if len(shape) == 0:
        return box  # a 0-d array: every rank holds it (replicas)
    if len(shape) == 1 or layout == "rows":
        return box.split(0, rank, size)
    if layout == "cols":
        return box.split(1, rank, size)
    rows, cols = grid(size)
    return box.split(0, rank // cols, rows).split(1, rank % cols, cols)


def pieces_of(rank, size, layout, arrays=None):
    arrays = reference() if arrays is None else arrays
    out = {}
    for name, array in arrays.items():
        box = layout_box(array.shape, layout, rank, size)
        out[name] = (box, array[box.slices].copy())
    return out


def assert_bits(got, want, what=""):
    assert isinstance(got, np.ndarray), what
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert got.tobytes() == np.ascontiguousarray(want).tobytes(), what


def save_case(path, group, layout, extra=None):
    save_slices(path, pieces_of(group.rank, group.size, layout), group=group, extra=extra)


def load_case(path, group, layout):
    """Load this rank's boxes under ``layout`` and compare them with the reference, bit for bit."""
    want = reference()
    boxes = {name: layout_box(a.shape, layout, group.rank, group.size) for name, a in want.items()}
    got, extra = load_slices(path, boxes, group=group)
    assert extra == {"step": 3, "layout": "saved"}
    assert sorted(got) == sorted(want)
    for name, box in boxes.items():
        assert_bits(got[name], want[name][box.slices], f"{name} under {layout} on rank {group.rank}")


def read_full_case(path):
    got, extra = read_full(path)
    assert extra == {"step": 3, "layout": "saved"}
    want = reference()
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert_bits(got[name], array, name)


EXTRA = {"step": 3, "layout": "saved"}


# ------------------------------------------------------------------------------------ boxes

def test_split_cuts_as_array_split_and_composes():
    full = Box.full((7, 5))
    rows = [full.split(0, r, 3) for r in range(3)]
    assert [(b.offset, b.shape) for b in rows] == [((0, 0), (3, 5)), ((3, 0), (2, 5)), ((5, 0), (2, 5))]
    for parts in range(1, 10):  # more parts than rows: the last blocks are empty
        sizes = [full.split(0, r, parts).shape[0] for r in range(parts)]
        assert sizes == [len(a) for a in np.array_split(np.arange(7), parts)]
    block = full.split(0, 1, 3).split(1, 1, 2)  # block (1, 1) of a 3 x 2 grid
    assert block == Box((7, 5), (3, 3), (2, 2)) and block.stop == (5, 5) and block.size == 4
    g = np.arange(35).reshape(7, 5)
    assert g[block.slices].tolist() == [[18, 19], [23, 24]]
    assert Box.full(()).size == 1 and Box.full(()).slices == () and Box.full((0, 3)).size == 0


def test_intersections_and_positions_inside_another_box():
    a, b = Box((7, 5), (0, 0), (4, 3)), Box((7, 5), (2, 1), (5, 4))
    common = a.intersect(b)
    assert common == Box((7, 5), (2, 1), (2, 2)) and b.intersect(a) == common
    assert common.within(a) == (slice(2, 4), slice(1, 3)) and common.within(b) == (slice(0, 2), slice(0, 2))
    assert a.intersect(Box((7, 5), (4, 0), (3, 5))) is None  # touching is not overlapping
    assert Box.full(()).intersect(Box.full(())) == Box.full(())


@pytest.mark.parametrize("args,fragment", [
    (((7, 5), (5, 0), (3, 5)), "reaches beyond the global shape (7, 5) (it ends at (8, 5))"),
    (((7, 5), (0,), (7, 5)), "one offset and one extent per axis"),
    (((7, 5), (-1, 0), (1, 5)), "negative value"),
    (((7, 5), (0.5, 0), (1, 5)), "offset (0.5, 0) is not a sequence of integers"),
])
def test_malformed_boxes_are_refused(args, fragment):
    with pytest.raises(CheckpointError) as info:
        Box(*args)
    assert fragment in str(info.value)
    with pytest.raises(CheckpointError, match="cannot take block 3 of 3 along axis 0"):
        Box.full((7,)).split(0, 3, 3)
    assert Box(np.array([7, 5]), (np.int64(1), 0), (2, 5)).global_shape == (7, 5)  # numpy integers accepted


def test_plan_writes_each_distinct_box_once_by_its_lowest_holder():
    full = Box.full((6, 4))
    top, bottom = full.split(0, 0, 2), full.split(0, 1, 2)
    table = [
        [("w", "<f8", top), ("b", "<f4", Box.full((4,)))],
        [("w", "<f8", bottom), ("b", "<f4", Box.full((4,)))],
        [("w", "<f8", top), ("b", "<f4", Box.full((4,))), ("only2", "<i8", Box.full(()))],
        [("w", "<f8", bottom), ("b", "<f4", Box.full((4,))), ("e", "<f8", Box((0, 2), (0, 0), (0, 2)))],
    ]
    writes, arrays = plan_slices(table)
    assert writes == {0: ["b", "w"], 1: ["w"], 2: ["only2"]}
    assert arrays["w"] == {"shape": [6, 4], "dtype": "<f8", "boxes": [[0, [0, 0], [3, 4]], [1, [3, 0], [3, 4]]]}
    assert arrays["b"]["boxes"] == [[0, [0], [4]]] and arrays["only2"]["boxes"] == [[2, [], []]]
    assert arrays["e"] == {"shape": [0, 2], "dtype": "<f8", "boxes": []}  # nothing to write for an empty array


# ------------------------------------------------------------------------------------ round trips on threads

@pytest.mark.parametrize("save_layout,load_layout", [("rows", "cols"), ("blocks", "rows"), ("cols", "blocks")])
@pytest.mark.parametrize("save_size", [1, 2, 3, 4])
@pytest.mark.parametrize("load_size", [1, 2, 3, 4])
def test_saved_under_one_layout_loads_under_another(tmp_path, save_layout, load_layout, save_size, load_size):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: save_case(path, world.default_group, save_layout, EXTRA), world_size=save_size)
    ax.run_local(lambda world: load_case(path, world.default_group, load_layout), world_size=load_size)
    load_case(path, ONE, load_layout)  # one process, through load_slices
    read_full_case(path)               # one process, no group at all
    names = sorted(os.listdir(path))
    assert names[0] == INDEX and all(n.startswith("slices-") and n.endswith(f"-of-{save_size:05d}.npz")
                                     for n in names[1:])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left


def test_seven_by_five_over_three_uneven_rows_then_two_by_two_blocks(tmp_path):
    path = str(tmp_path / "ckpt")
    g = np.arange(35, dtype=np.float64).reshape(7, 5) + 0.25
    boxes = [Box.full((7, 5)).split(0, r, 3) for r in range(3)]
    assert [b.shape for b in boxes] == [(3, 5), (2, 5), (2, 5)]
    ax.run_local(lambda world: save_slices(path, {"g": (boxes[world.rank], g[boxes[world.rank].slices])}),
                 world_size=3)

    def load_block(world):
        box = Box.full((7, 5)).split(0, world.rank // 2, 2).split(1, world.rank % 2, 2)
        got, _ = load_slices(path, {"g": box})
        return box, got["g"]

    for box, got in ax.run_local(load_block, world_size=4):
        assert_bits(got, g[box.slices])
    assert [box.shape for box, _ in ax.run_local(load_block, world_size=4)] == [(4, 3), (4, 2), (3, 3), (3, 2)]


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes (axonhpc[bf16]) not installed")
def test_bfloat16_pieces_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    g = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(ml_dtypes.bfloat16)
    ax.run_local(lambda world: save_slices(path, {"g": (Box.full(g.shape).split(1, world.rank, 2),
                                                        g[:, 2 * world.rank:2 * world.rank + 2])}), world_size=2)
    got, _ = read_full(path)
    assert got["g"].dtype == g.dtype and got["g"].tobytes() == g.tobytes()


def test_the_three_tuple_form_and_numpy_scalars_are_pieces_too(tmp_path):
    path = str(tmp_path / "ckpt")
    g = np.arange(10, dtype=np.int64)
    ax.run_local(lambda world: save_slices(path, {"g": ((10,), (5 * world.rank,), g[5 * world.rank:][:5]),
                                                  "lr": ((), (), np.float64(0.5))}), world_size=2)
    got, extra = read_full(path, names=["lr", "g"])
    assert_bits(got["g"], g)
    assert extra is None
    assert got["lr"].shape == () and got["lr"].dtype == np.float64 and float(got["lr"]) == 0.5


def test_destinations_are_filled_in_place(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: save_case(path, world.default_group, "rows", EXTRA), world_size=3)
    want = reference()

    def body(world):
        box = layout_box((7, 5), "cols", world.rank, 2)
        dest = np.full(box.shape, 7.0)
        flat = np.zeros(13, dtype=np.float32)
        got, extra = load_slices(path, {"w": (box, dest), "v": ((13,), (0,), flat)})
        assert got["w"] is dest and got["v"] is flat and extra == EXTRA
        assert_bits(dest, want["w"][box.slices])
        assert_bits(flat, want["v"])

    ax.run_local(body, world_size=2)


def test_device_pieces_are_saved_from_the_host_and_device_destinations_filled(tmp_path, monkeypatch):
    from support.strict_cupy import DeviceArray, StrictCupy, device

    monkeypatch.setitem(sys.modules, "cupy", StrictCupy())
    path = str(tmp_path / "ckpt")
    g = reference()["w"]

    def save_device(world):
        box = Box.full(g.shape).split(0, world.rank, 2)
        save_slices(path, {"w": (box, device(g[box.slices]))})

    ax.run_local(save_device, world_size=2)

    def load_device(world):
        box = Box.full(g.shape).split(1, world.rank, 3)
        dest = device(np.zeros(box.shape))
        got, _ = load_slices(path, {"w": (box, dest)})
        assert got["w"] is dest and type(dest) is DeviceArray
        assert_bits(dest.get(), g[box.slices])

    ax.run_local(load_device, world_size=3)


def test_a_device_piece_that_cannot_be_copied_to_the_host_fails_the_save_on_every_rank(tmp_path, monkeypatch):
    from support.strict_cupy import StrictCupy, UnreadableDeviceArray, device

    monkeypatch.setitem(sys.modules, "cupy", StrictCupy())
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=2)
    g = reference()["w"]

    def body(world):
        box = Box.full(g.shape).split(0, world.rank, 2)
        array = UnreadableDeviceArray(g[box.slices].copy()) if world.rank == 1 else device(g[box.slices])
        save_slices(path, {"w": [(box, array)]})

    messages = _messages(body, 2)
    assert f"writing {slice_file(1, 2)} of {path!r} failed on group rank 1: MemoryError: cannot allocate" \
        in messages[1], messages[1]
    assert "failed on group ranks [1]" in messages[0], messages[0]
    _still_a(path, tmp_path)


# ------------------------------------------------------------------------------------ replicas and stages

def test_replicas_are_written_once_by_the_lowest_rank(tmp_path):
    """dp=2 x tp=2: ranks 0, 1 (replica 0) and 2, 3 (replica 1) hold the same two row blocks."""
    path = str(tmp_path / "ckpt")
    g = np.arange(42, dtype=np.float64).reshape(6, 7)

    def body(world):
        dp, tp = divmod(world.rank, 2)
        box = Box.full(g.shape).split(0, tp, 2)
        bias = np.full(7, 1.0 + dp)  # the replicas differ here on purpose: rank 0's is the one written
        save_slices(path, {"w": (box, g[box.slices]), "bias": (Box.full((7,)), bias)}, extra={"dp": dp})

    ax.run_local(body, world_size=4)
    assert sorted(os.listdir(path)) == [INDEX, slice_file(0, 4), slice_file(1, 4)]
    first = load(os.path.join(path, slice_file(0, 4)), group=ONE)  # an ordinary checkpoint file
    second = load(os.path.join(path, slice_file(1, 4)), group=ONE)
    assert sorted(first) == ["bias", "w"] and sorted(second) == ["w"]
    assert_bits(first["w"], g[:3])
    assert_bits(second["w"], g[3:])
    assert_bits(first["bias"], np.full(7, 1.0))
    index = load(os.path.join(path, INDEX), group=ONE)
    assert index["arrays"]["w"]["boxes"] == [[0, [0, 0], [3, 7]], [1, [3, 0], [3, 7]]]
    assert index["arrays"]["bias"]["boxes"] == [[0, [0], [7]]] and index["extra"] == {"dp": 0}
    assert index["format"] == INDEX_FORMAT and index["world_size"] == 4
    got, _ = read_full(path)
    assert_bits(got["w"], g)
    assert_bits(got["bias"], np.full(7, 1.0))


def test_pipeline_stages_hold_different_names(tmp_path):
    """Four stages, one layer each, saved on 4 ranks; loaded as 2 stages of 2 layers and in one process."""
    path = str(tmp_path / "ckpt")
    layers = {f"layer{k}.weight": np.full((3, 2), float(k)) for k in range(4)}

    def save_stage(world):
        name = f"layer{world.rank}.weight"
        save_slices(path, {name: (Box.full((3, 2)), layers[name])})

    ax.run_local(save_stage, world_size=4)
    assert sorted(os.listdir(path)) == [INDEX] + [slice_file(r, 4) for r in range(4)]

    def load_two(world):
        mine = {f"layer{k}.weight": Box.full((3, 2)) for k in (2 * world.rank, 2 * world.rank + 1)}
        got, _ = load_slices(path, mine)
        for name, array in got.items():
            assert_bits(array, layers[name])
        return sorted(got)

    assert ax.run_local(load_two, world_size=2) == [["layer0.weight", "layer1.weight"],
                                                     ["layer2.weight", "layer3.weight"]]


# ------------------------------------------------------------------------------------ reading only what is needed

def _recording(monkeypatch):
    """Record, per thread, the files opened and the entries read."""
    opened, entries = {}, {}
    real_open, real_read = slice_load.open_archive, archive_module.Archive.read

    def open_archive(path, source):
        opened.setdefault(threading.get_ident(), []).append(os.path.basename(path))
        return real_open(path, source)

    def read(self, name, *args, **kwargs):
        entries.setdefault(threading.get_ident(), []).append(name)
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(slice_load, "open_archive", open_archive)
    monkeypatch.setattr(archive_module.Archive, "read", read)
    return opened, entries


def test_a_load_opens_only_the_files_it_needs(tmp_path, monkeypatch):
    """Saved as a 2 x 2 grid of blocks; each of 2 row-ranks needs the two blocks of its half."""
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: save_case(path, world.default_group, "blocks", EXTRA), world_size=4)
    opened, _ = _recording(monkeypatch)

    def body(world):
        box = Box.full((7, 5)).split(0, world.rank, 2)
        got, _ = load_slices(path, {"w": box})
        assert_bits(got["w"], reference()["w"][box.slices])
        return sorted(opened[threading.get_ident()])

    assert ax.run_local(body, world_size=2) == [[slice_file(0, 4), slice_file(1, 4)],
                                                [slice_file(2, 4), slice_file(3, 4)]]


def test_unneeded_files_may_be_missing_needed_ones_may_not(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: save_case(path, world.default_group, "rows", EXTRA), world_size=4)
    for r in (1, 2, 3):
        os.remove(os.path.join(path, slice_file(r, 4)))  # rows 2..6 are gone; rows 0..1 are in file 0
    got, extra = load_slices(path, {"w": Box((7, 5), (0, 1), (2, 3)), "v": Box((13,), (0,), (4,))}, group=ONE)
    assert_bits(got["w"], reference()["w"][0:2, 1:4])
    assert extra == EXTRA
    with pytest.raises(CheckpointError) as info:
        load_slices(path, {"w": Box((7, 5), (1, 0), (2, 5))}, group=ONE)  # row 2 is in file 1
    assert f"cannot read slice file {slice_file(1, 4)!r}" in str(info.value) and path in str(info.value)


def test_a_load_reads_only_the_entries_it_needs(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save_case(path, ONE, "rows", EXTRA)  # one file holding every array
    _, entries = _recording(monkeypatch)
    got, _ = load_slices(path, {"v": Box.full((13,))}, group=ONE)
    assert_bits(got["v"], reference()["v"])
    read = entries[threading.get_ident()]
    assert read.count("__meta__") == 2 and len(read) == 3, read  # the index's and the file's metadata, one array


# ------------------------------------------------------------------------------------ errors when saving

def _messages(body, world_size):
    """Run ``body`` on thread-ranks; each returns the CheckpointError it raised (or fails)."""
    def run(world):
        with pytest.raises(CheckpointError) as info:
            body(world)
        return str(info.value)

    return ax.run_local(run, world_size=world_size)


def _bad_save(path, change):
    g = reference()["w"]

    def body(world):
        pieces = {"w": (layout_box((7, 5), "rows", world.rank, world.world_size),
                        g[layout_box((7, 5), "rows", world.rank, world.world_size).slices])}
        change(world.rank, pieces)
        save_slices(path, pieces, extra={"which": "B"})

    return body


def _saved_a(path, world_size=3):
    ax.run_local(lambda world: save_case(path, world.default_group, "rows", {"step": 3, "layout": "saved"}),
                 world_size=world_size)


def _still_a(path, tmp_path):
    read_full_case(path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left


@pytest.mark.parametrize("case,fragments", [
    ("shape", ["the ranks disagree on the global shape of 'w': group ranks [0, 1] say (7, 5), "
               "group rank 2 says (7, 6)"]),
    ("dtype", ["the ranks disagree on the dtype of 'w': group ranks [0, 2] say <f8, group rank 1 says <f4"]),
    ("hole", ["the pieces of 'w' (global shape (7, 5)) do not cover it exactly once: position (5, 0) is in no box"]),
    ("overlap", ["do not cover it exactly once: the boxes at offset (0, 0) of shape (4, 5) and at offset (3, 0) "
                 "of shape (2, 5) overlap"]),
    ("piece", ["a piece was refused on group rank 1: piece 'w': the array has shape (2, 4), its box (2, 5)"]),
    ("object", ["group rank 2: piece 'names': arrays of dtype object cannot be checkpointed"]),
])
def test_a_bad_layout_raises_the_same_error_on_every_rank_before_writing(tmp_path, case, fragments):
    path = str(tmp_path / "ckpt")
    _saved_a(path)

    def change(rank, pieces):
        box, array = pieces["w"]
        if case == "shape" and rank == 2:
            pieces["w"] = ((7, 6), box.offset, array)
        if case == "dtype" and rank == 1:
            pieces["w"] = (box, array.astype(np.float32))
        if case == "hole" and rank == 2:
            del pieces["w"]
        if case == "overlap" and rank == 0:
            pieces["w"] = (Box((7, 5), (0, 0), (4, 5)), reference()["w"][:4])
        if case == "piece" and rank == 1:
            pieces["w"] = (box, array[:, :4])
        if case == "object" and rank == 2:
            pieces["names"] = (Box.full((2,)), np.array(["a", None], dtype=object))

    messages = _messages(_bad_save(path, change), 3)
    assert len(set(messages)) == 1, messages  # the same message on every rank
    for fragment in fragments:
        assert fragment in messages[0], messages[0]
    assert messages[0].startswith(f"saving checkpoint {path!r}: nothing was written")
    _still_a(path, tmp_path)


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _saved_a(path)
    real = directory_module.write_atomic

    def write_atomic(target, entries):
        if os.path.basename(target) == slice_file(1, 3):
            raise OSError(28, "No space left on device")
        return real(target, entries)

    monkeypatch.setattr(directory_module, "write_atomic", write_atomic)
    messages = _messages(lambda world: save_case(path, world.default_group, "cols", {"which": "B"}), 3)
    assert "No space left on device" in messages[1] and "failed on group ranks [1]" in messages[0], messages
    _still_a(path, tmp_path)


# ------------------------------------------------------------------------------------ errors when loading

@pytest.mark.parametrize("wanted,fragments", [
    ({"nope": Box.full((2,))}, ["holds no array 'nope' (it holds 6: ['empty', 'i', 'scale', 'step', 'v', 'w'])"]),
    ({"w": Box.full((7, 6))}, ["array 'w' has global shape (7, 5) in the checkpoint; the requested global shape "
                               "is (7, 6)"]),
    ({"w": (Box.full((7, 5)), np.zeros((7, 5), np.float32))}, ["array 'w' is float64 in the checkpoint; the "
                                                               "destination is float32"]),
    ({"w": ((7, 5), (5, 0), np.zeros((3, 5)))}, ["box at offset (5, 0) of shape (3, 5) reaches beyond the global "
                                                 "shape (7, 5)"]),
    ({"w": (Box.full((7, 5)), np.zeros((7, 5)).T.copy())}, ["the array has shape (5, 7), its box (7, 5)"]),
])
def test_a_bad_request_on_one_rank_fails_on_every_rank_and_changes_nothing(tmp_path, wanted, fragments):
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=2)

    def body(world):
        dest = np.full((7, 3), 9.0)
        mine = wanted if world.rank == 1 else {"w": (Box((7, 5), (0, 0), (7, 3)), dest)}
        with pytest.raises(CheckpointError) as info:
            load_slices(path, mine)
        assert np.all(dest == 9.0)  # rank 0 could read its part, but nothing changed
        return str(info.value)

    messages = ax.run_local(body, world_size=3)
    for fragment in fragments:
        assert fragment in messages[1], messages[1]
    for r in (0, 2):
        assert messages[r].startswith(f"loading checkpoint {path!r} failed on group ranks [1] (see the error "
                                      f"raised there), so no rank uses it: group rank 1: CheckpointError: ")
        assert all(fragment in messages[r] for fragment in fragments), messages[r]  # the reason reaches every rank


def test_read_full_names_a_missing_array_and_a_missing_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=1)
    with pytest.raises(CheckpointError, match=r"holds no array 'W' \(it holds 6"):
        read_full(path, names=["W"])
    with pytest.raises(CheckpointError, match="no such file|No such file"):
        read_full(str(tmp_path / "absent"))
    other = str(tmp_path / "per-rank")
    checkpoint.save_per_rank(other, {"w": np.zeros(2)}, group=ONE)
    with pytest.raises(CheckpointError, match="is not a checkpoint of format 'axonhpc.sliced/2'"):
        read_full(other)


# ------------------------------------------------------------------------------------ crafted indexes

def rewrite_index(path, index):
    """Replace the index of the directory ``path`` by ``index``, keeping its save token (a crafter can copy it)."""
    token = read_saved(os.path.join(path, INDEX))[2]
    write_atomic(os.path.join(path, INDEX), encode(index, save=token))


def _crafted(tmp_path, change, names=None):
    """A 2-rank row checkpoint (rows 0-3 in file 0, 4-6 in file 1) whose index ``change(index)`` rewrote.

    Returns:
        The message of the CheckpointError ``read_full(path, names)`` raises.
    """
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=2)
    index = load(os.path.join(path, INDEX), group=ONE)
    change(index)
    rewrite_index(path, index)
    with pytest.raises(CheckpointError) as info:
        read_full(path, names)
    message = str(info.value)
    assert path in message
    return message


def _w(index):
    return index["arrays"]["w"]


def _resplit(index):
    """Rows 0-2 and 3-6: a layout that covers the array, but not the one the files hold."""
    _w(index)["boxes"] = [[0, [0, 0], [3, 5]], [1, [3, 0], [4, 5]]]


@pytest.mark.parametrize("change,fragment", [
    (lambda i: i.update(world_size="../../etc/passwd"), "world_size='../../etc/passwd'; expected an integer"),
    (lambda i: i.update(world_size=0), "world_size=0; expected an integer from 1"),
    (lambda i: i.update(world_size=MAX_WORLD_SIZE + 1), f"world_size={MAX_WORLD_SIZE + 1}; expected"),
    (lambda i: i.update(arrays=["w"]), "arrays='list'; expected a dict"),
    (lambda i: i["arrays"].update(w="slices-00000-of-00002.npz"), "arrays['w']='slices-00000-of-00002.npz'"),
    (lambda i: _w(i).update(shape=[7, -5]), "arrays['w'].shape=[7, -5]; expected a list of 2 integers"),
    (lambda i: _w(i).update(shape=[7, True]), "arrays['w'].shape=[7, True]"),
    (lambda i: _w(i).update(shape=[1] * 65), "expected a list of at most 64 integers"),
    (lambda i: _w(i).update(dtype="|O"), "dtype '|O' is not a dtype a checkpoint stores"),
    (lambda i: _w(i).update(dtype="../../etc/passwd"), "dtype '../../etc/passwd' is not a dtype"),
    (lambda i: _w(i).update(boxes="../../etc/passwd"), "arrays['w'].boxes='../../etc/passwd'; expected a list"),
    (lambda i: _w(i)["boxes"][1].__setitem__(0, 2), "arrays['w'].boxes[1] file rank=[2]; expected a list of 1 "
                                                    "integers from 0 to 1"),
    (lambda i: _w(i)["boxes"][1].__setitem__(0, -1), "file rank=[-1]"),
    (lambda i: _w(i)["boxes"][1].__setitem__(0, "../../etc/passwd"), "file rank=['../../etc/passwd']"),
    (lambda i: _w(i)["boxes"][1].__setitem__(1, [4, 2**70]), "arrays['w'].boxes[1] offset=[4, "),
    (lambda i: _w(i)["boxes"][1].__setitem__(1, [6, 0]), "arrays['w'].boxes[1]=[1, [6, 0], [3, 5]]; expected a "
                                                         "box inside the global shape (7, 5)"),
    (lambda i: _w(i)["boxes"][1].__setitem__(0, 0), "expected a box inside the global shape (7, 5), one per file"),
    (lambda i: _w(i)["boxes"].pop(), "the saved boxes of 'w' do not cover the requested offset (0, 0) shape (7, 5) "
                                     "exactly once: position (4, 0) is in no box"),
    (lambda i: _w(i)["boxes"][1][2].__setitem__(0, 2), "position (6, 0) is in no box"),
    (lambda i: _w(i)["boxes"][0][2].__setitem__(0, 5), "the boxes at offset (0, 0) of shape (5, 5) and at offset "
                                                       "(4, 0) of shape (3, 5) overlap"),
    (_resplit, "'slices-00000-of-00002.npz' holds 'w' as float64 of shape (4, 5); the index says float64 of "
               "shape (3, 5)"),
    (lambda i: _w(i).update(dtype="<i8"), "holds 'w' as float64 of shape (4, 5); the index says int64"),
])
def test_a_crafted_index_is_refused(tmp_path, change, fragment):
    message = _crafted(tmp_path, change)
    assert fragment in message, message


def test_an_index_claiming_more_bytes_than_a_file_holds_is_refused_before_allocating(tmp_path):
    def change(index):
        index["arrays"]["big"] = {"shape": [1 << 40], "dtype": "<f8", "boxes": [[0, [0], [1 << 40]]]}

    message = _crafted(tmp_path, change, names=["big"])
    assert f"places {8 << 40} bytes of arrays in 'slices-00000-of-00002.npz', which holds" in message


def test_file_names_come_from_integers_and_stay_inside_the_directory(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=2)
    elsewhere = str(tmp_path / "elsewhere")
    _saved_a(elsewhere, world_size=2)
    index = load(os.path.join(path, INDEX), group=ONE)
    index["arrays"]["w"]["file"] = "../elsewhere/slices-00000-of-00002.npz"  # ignored: names are computed
    rewrite_index(path, index)
    read_full_case(path)
    target = os.path.join(path, slice_file(1, 2))
    os.remove(target)
    os.symlink(os.path.join(elsewhere, slice_file(1, 2)), target)
    with pytest.raises(CheckpointError) as info:
        read_full(path)
    assert "'slices-00001-of-00002.npz' resolves to" in str(info.value)
    assert "outside the checkpoint directory" in str(info.value)


def test_a_slice_file_with_a_flipped_byte_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=1)
    file = os.path.join(path, slice_file(0, 1))
    data = bytearray(open(file, "rb").read())
    data[data.find(reference()["i"].tobytes()) + 17] ^= 0x01
    open(file, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"state\['i'\]"):
        read_full(path)
    got, _ = read_full(path, names=["w"])  # the other entries of the file still read: each has its own checksum
    assert_bits(got["w"], reference()["w"])


def test_a_slice_file_with_an_entry_added_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved_a(path, world_size=1)
    file = os.path.join(path, slice_file(0, 1))
    with np.load(file) as stored:
        entries = {name: stored[name] for name in stored.files}
    entries["a99"] = np.zeros(3)
    np.savez(file, **entries)
    with pytest.raises(CheckpointError, match=r"entries \['a99'\] are not described by the metadata"):
        read_full(path, names=["w"])


# ------------------------------------------------------------------------------------ killed mid-save

CHILD = r"""
import sys
import numpy as np
from axonhpc.checkpoint import Box, save_slices
from axonhpc.groups import ProcessGroup

path = sys.argv[1]
ONE = ProcessGroup.mock()
a = np.arange(35, dtype=np.float64).reshape(7, 5)
save_slices(path, {"w": (Box.full((7, 5)), a)}, group=ONE, extra={"which": "A"})
print("A saved", flush=True)
big = {f"p{i}": (Box.full((1 << 19,)), np.full(1 << 19, float(i))) for i in range(16)}
save_slices(path, big, group=ONE, extra={"which": "B"})
print("B saved", flush=True)
"""
B_BYTES = 16 * (1 << 19) * 8


def _kill_mid_save(path, fraction):
    child = start_child(CHILD, path)
    try:
        expect_line(child, b"A saved\n")
    except AssertionError:
        child.kill()
        raise
    return kill_when_written(child, f"{path}.tmp-*/slices-*.tmp-*", fraction * B_BYTES, strict=False)[0]


@pytest.mark.timeout(180)
def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    killed = 0
    for fraction in (0.25, 0.75):
        run = tmp_path / f"run-{fraction}"
        run.mkdir()
        path = str(run / "ckpt-000001")
        code = _kill_mid_save(path, fraction)
        got, extra = read_full(path)
        if code == 0:  # the save won the race: B, whole
            assert extra == {"which": "B"} and len(got) == 16
            continue
        assert code == -signal.SIGKILL, code
        killed += 1
        assert extra == {"which": "A"} and sorted(got) == ["w"]
        assert_bits(got["w"], np.arange(35, dtype=np.float64).reshape(7, 5))
        assert latest(str(run)) == path
        assert sorted(os.listdir(path)) == [INDEX, slice_file(0, 1)]
    assert killed >= 1  # at least one kill landed mid-save


# ------------------------------------------------------------------------------------ flat ranges (FSDP shards)

def _fewest_boxes(shape, start, stop):
    """Brute force: the fewest flat-contiguous boxes that make up ``[start, stop)`` of a C-order flattening."""
    def is_box(lo, hi):
        cells = np.array(np.unravel_index(np.arange(lo, hi), shape)).reshape(len(shape), -1)
        return int(np.prod(cells.max(axis=1) - cells.min(axis=1) + 1)) == hi - lo

    best = {stop: 0}
    for lo in range(stop - 1, start - 1, -1):
        best[lo] = min(best[hi] + 1 for hi in range(lo + 1, stop + 1) if is_box(lo, hi))
    return best[start]


@pytest.mark.parametrize("global_shape,offset,shape", [
    ((9,), (2,), (5,)),
    ((5, 7), (1, 2), (3, 4)),
    ((4, 3, 7), (1, 0, 2), (2, 3, 4)),            # the (2, 3, 4) block inside a larger array
    ((2, 3, 4), (0, 0, 0), (2, 3, 4)),            # a whole array
    ((3, 4, 5, 2), (0, 1, 1, 0), (2, 2, 3, 2)),
    ((2, 3, 2, 4), (1, 0, 1, 1), (1, 3, 1, 2)),   # axes of extent 1
])
def test_flat_ranges_are_the_fewest_boxes_holding_the_elements_in_flat_order(global_shape, offset, shape):
    block = Box(global_shape, offset, shape)
    g = np.arange(int(np.prod(global_shape))).reshape(global_shape)
    local = g[block.slices].ravel()
    ndim = len(shape)
    for start in range(block.size + 1):
        for stop in range(start, block.size + 1):
            pieces = flat_range_boxes(block, start, stop)
            values = [g[piece.slices].ravel() for piece, _, _ in pieces]
            got = np.concatenate(values).tolist() if values else []
            assert got == local[start:stop].tolist(), (start, stop, pieces)
            at = start
            for piece, a, b in pieces:
                assert (a, b) == (at, at + piece.size) and piece.size > 0, (start, stop, pieces)
                assert piece.global_shape == global_shape and piece.intersect(block) == piece
                assert local[a:b].tolist() == g[piece.slices].ravel().tolist()
                at = b
            assert at == stop
            assert len(pieces) <= 2 * ndim - 1
            if stop > start:
                assert len(pieces) == _fewest_boxes(shape, start, stop), (start, stop, pieces)


def test_flat_range_edge_cases_and_refusals():
    whole = Box((7, 5), (0, 0), (7, 5))
    assert flat_range_boxes(whole, 0, 35) == [(whole, 0, 35)]
    assert flat_range_boxes(whole, 5, 15) == [(Box((7, 5), (1, 0), (2, 5)), 5, 15)]
    assert flat_range_boxes(whole, 7, 7) == []
    scalar = Box.full(())
    assert flat_range_boxes(scalar, 0, 1) == [(scalar, 0, 1)] and flat_range_boxes(scalar, 1, 1) == []
    empty = Box.full((0, 3))
    assert flat_range_boxes(empty, 0, 0) == []
    assert flat_range_boxes(whole, np.int64(2), np.int32(4)) == [(Box((7, 5), (0, 2), (1, 2)), 2, 4)]
    block = Box((7, 5), (1, 2), (3, 3))
    for start, stop in ((3, 2), (-1, 4), (0, 10), (0, 1 << 70)):
        with pytest.raises(CheckpointError) as info:
            flat_range_boxes(block, start, stop)
        assert (f"the range [{start}, {stop}) is not inside the 9 elements of the block at offset (1, 2) of shape "
                f"(3, 3)") in str(info.value)
    with pytest.raises(CheckpointError, match="start 1.5 and stop 3 must be integers"):
        flat_range_boxes(block, 1.5, 3)
    with pytest.raises(CheckpointError, match="expected a Box, got tuple"):
        flat_range_boxes(((7, 5), (0, 0), (7, 5)), 0, 1)
    with pytest.raises(CheckpointError, match=r"the range \[0, 1\) is not inside the 0 elements"):
        flat_range_boxes(empty, 0, 1)


def test_the_flat_range_docstring_example_holds():
    finder = doctest.DocTestFinder()
    tests = finder.find(sliced.flat_range_boxes, "flat_range_boxes", globs={"np": np, "Box": Box,
                                                                            "flat_range_boxes": flat_range_boxes})
    assert len(tests) == 1 and len(tests[0].examples) == 5
    runner = doctest.DocTestRunner()
    runner.run(tests[0])
    assert runner.summarize(verbose=False) == doctest.TestResults(failed=0, attempted=5)


def flat_bounds(n, size, skew=1):
    """Uneven cut points of ``n`` elements over ``size`` ranks: rank r's share grows with r (skew 1) or shrinks."""
    weights = [r + 1 if skew > 0 else size - r for r in range(size)]
    return [n * sum(weights[:k]) // sum(weights) for k in range(size + 1)]


def flat_reference():
    """2-d, 3-d and 1-d arrays for the flat layouts; NaN and -0.0 so only a bit-exact round trip passes."""
    rng = np.random.default_rng(23)
    w = rng.standard_normal((7, 5))
    w[1, 1], w[5, 3] = np.nan, -0.0
    return {"w": w, "t": rng.integers(-2**30, 2**30, size=(3, 4, 5)).astype(np.int32),
            "b": np.array([1.5, -2.5], dtype=np.float32)}


def flat_blocks(shape, layout):
    """The blocks whose flattening a flat layout cuts: the array, or its 2 tensor-parallel column blocks."""
    if layout == "tpflat" and len(shape) >= 2:
        return [Box.full(shape).split(1, t, 2) for t in range(2)]
    return [Box.full(shape)]


def flat_ranges(shape, layout, rank, size, skew=1):
    """This rank's ``(block, start, stop)`` of each block: its contiguous range of the block's flattening."""
    out = []
    for block in flat_blocks(shape, layout):
        bounds = flat_bounds(block.size, size, skew)
        out.append((block, bounds[rank], bounds[rank + 1]))
    return out


def flat_pieces(rank, size, layout, arrays=None):
    """The pieces of FSDP-like flat shards: views of each shard, reshaped to the boxes of its range."""
    arrays = flat_reference() if arrays is None else arrays
    out = {}
    for name, g in arrays.items():
        out[name] = []
        for block, start, stop in flat_ranges(g.shape, layout, rank, size):
            shard = g[block.slices].ravel()[start:stop].copy()  # what the rank holds: one flat buffer
            out[name] += [(piece, shard[a - start:b - start].reshape(piece.shape))
                          for piece, a, b in flat_range_boxes(block, start, stop)]
    return out


def load_flat_case(path, group, layout):
    """Load this rank's part under ``layout``: ``rows`` / ``cols`` boxes, or ``flat`` ranges into a 1-d buffer."""
    want = flat_reference()
    if layout in ("rows", "cols"):
        boxes = {name: layout_box(g.shape, layout, group.rank, group.size) for name, g in want.items()}
        got, extra = load_slices(path, boxes, group=group)
        for name, box in boxes.items():
            assert_bits(got[name], want[name][box.slices], f"{name} under {layout} on rank {group.rank}")
        return extra
    wanted, buffers, expected = {}, {}, {}
    for name, g in want.items():
        ranges = flat_ranges(g.shape, "flat", group.rank, group.size, skew=-1)  # another cut than the save's
        start, stop = ranges[0][1], ranges[0][2]
        buffers[name] = np.full(stop - start, 7, dtype=g.dtype)  # a flat shard, filled in place
        expected[name] = g.ravel()[start:stop]
        wanted[name] = [(piece, buffers[name][a - start:b - start].reshape(piece.shape))
                        for piece, a, b in flat_range_boxes(Box.full(g.shape), start, stop)]
    got, extra = load_slices(path, wanted, group=group)
    for name in want:
        assert isinstance(got[name], list) and len(got[name]) == len(wanted[name])
        for array, (_, view) in zip(got[name], wanted[name]):
            assert array is view and np.shares_memory(view, buffers[name])
        assert_bits(buffers[name], expected[name], f"{name} as a flat shard on rank {group.rank}")
    return extra


def test_plan_numbers_the_pieces_a_rank_writes_several_of():
    full = Box.full((6, 4))
    a, b = Box((6, 4), (0, 0), (1, 4)), Box((6, 4), (1, 0), (1, 2))  # rank 0: row 0 and half of row 1
    c, d = Box((6, 4), (1, 2), (1, 2)), Box((6, 4), (2, 0), (4, 4))  # rank 1: the rest
    empty = Box((6, 4), (6, 0), (0, 4))
    table = [
        [("w", "<f8", a), ("w", "<f8", empty), ("w", "<f8", b), ("s", "<i8", Box.full(()))],
        [("w", "<f8", c), ("w", "<f8", d), ("s", "<i8", Box.full(()))],
        [("w", "<f8", a), ("w", "<f8", c), ("v", "<f4", Box.full((3,)))],  # replicas only: nothing of w to write
        [("w", "<f8", d), ("w", "<f8", empty), ("w", "<f8", empty)],      # d is rank 1's; empty boxes may repeat
    ]
    writes, arrays = plan_slices(table)
    assert writes == {0: ["s", "w#0", "w#1"], 1: ["w#0", "w#1"], 2: ["v"]}
    assert arrays["w"]["boxes"] == [[0, [0, 0], [1, 4], 0], [0, [1, 0], [1, 2], 1], [1, [1, 2], [1, 2], 0],
                                    [1, [2, 0], [4, 4], 1]]
    assert arrays["s"]["boxes"] == [[0, [], []]] and arrays["v"]["boxes"] == [[2, [0], [3]]]
    # Rank 1 gives two boxes but writes one (the other is rank 0's): the plain key and entry.
    writes, arrays = plan_slices([[("w", "<f8", full.split(0, 0, 2))], [("w", "<f8", full.split(0, 0, 2)),
                                                                        ("w", "<f8", full.split(0, 1, 2))]])
    assert writes == {0: ["w"], 1: ["w"]} and arrays["w"]["boxes"] == [[0, [0, 0], [3, 4]], [1, [3, 0], [3, 4]]]
    writes, arrays = plan_slices([[("w", "<f8", Box((4096,), (i,), (1,))) for i in range(4096)]])  # the bound: allowed
    assert writes[0][-1] == "w#4095" and arrays["w"]["boxes"][-1] == [0, [4095], [1], 4095]


@pytest.mark.parametrize("table,fragment", [
    ([[("w", "<f8", Box((4,), (0,), (2,))), ("w", "<f8", Box((4,), (0,), (2,))), ("w", "<f8", Box((4,), (2,), (2,)))]],
     "group rank 0 gives the box at offset (0,) of shape (2,) of 'w' twice (as its pieces 0 and 1)"),
    ([[("w", "<f8", Box((4,), (0,), (3,))), ("w", "<f8", Box((4,), (2,), (2,)))]],
     "the pieces of 'w' (global shape (4,)) do not cover it exactly once: the boxes at offset (0,) of shape (3,) "
     "and at offset (2,) of shape (2,) overlap"),
    ([[("w", "<f8", Box((4,), (0,), (2,))), ("w", "<f8", Box((5,), (2,), (2,)))]],
     "the ranks disagree on the global shape of 'w': group rank 0 says (4,), group rank 0 says (5,)"),
    ([[("w", "<f8", Box((4,), (0,), (2,))), ("w", "<f8", Box((4,), (2,), (2,))), ("w#1", "<f8", Box.full(()))]],
     "group rank 0 writes several boxes of 'w', stored in its file as 'w#<i>', and a box of 'w#1': both would be "
     "stored under the key 'w#1'; rename 'w#1'"),
    ([[], [("w", "<f8", Box((5000,), (i,), (1,))) for i in range(4097)]],
     "group rank 1 gives 'w' in 4097 pieces, more than MAX_PIECES_PER_FILE = 4096 (of one name from one rank)"),
])
def test_plan_refuses_a_box_twice_overlapping_pieces_a_key_collision_and_too_many_pieces(table, fragment):
    with pytest.raises(CheckpointError) as info:
        plan_slices(table)
    assert fragment in str(info.value), str(info.value)
    assert MAX_PIECES_PER_FILE == 4096


@pytest.mark.parametrize("layout", ["flat", "tpflat"])
@pytest.mark.parametrize("save_size", [1, 2, 3, 4])
@pytest.mark.parametrize("load_size", [1, 2, 3, 4])
def test_flat_shards_load_under_rows_columns_and_other_flat_shards(tmp_path, layout, save_size, load_size):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: save_slices(path, flat_pieces(world.rank, world.world_size, layout), extra=EXTRA),
                 world_size=save_size)
    for load_layout in ("rows", "cols", "flat"):
        extras = ax.run_local(lambda world: load_flat_case(path, world.default_group, load_layout),
                              world_size=load_size)
        assert extras == [EXTRA] * load_size
    got, _ = read_full(path)
    for name, g in flat_reference().items():
        assert_bits(got[name], g, name)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_flat_shards_over_three_uneven_ranks_are_stored_as_numbered_pieces(tmp_path):
    path = str(tmp_path / "ckpt")
    g = flat_reference()["w"]
    assert flat_bounds(35, 3) == [0, 5, 17, 35]  # row 0; rows 1-2 and 2 of row 3; the rest
    ax.run_local(lambda world: save_slices(path, {"w": flat_pieces(world.rank, 3, "flat")["w"]}), world_size=3)
    index = load(os.path.join(path, INDEX), group=ONE)
    assert index["format"] == INDEX_FORMAT and index["arrays"]["w"]["boxes"] == [
        [0, [0, 0], [1, 5]],                                # one box: the plain entry and key
        [1, [1, 0], [2, 5], 0], [1, [3, 0], [1, 2], 1],     # several: numbered in flat order
        [2, [3, 2], [1, 3], 0], [2, [4, 0], [3, 5], 1]]
    files = [load(os.path.join(path, slice_file(r, 3)), group=ONE) for r in range(3)]
    assert [sorted(f) for f in files] == [["w"], ["w#0", "w#1"], ["w#0", "w#1"]]
    assert_bits(files[1]["w#1"], g[3:4, 0:2])
    assert_bits(files[2]["w#0"], g[3:4, 2:5])


def test_a_list_of_one_piece_and_an_empty_list_are_pieces_too(tmp_path):
    path = str(tmp_path / "ckpt")
    g = np.arange(12, dtype=np.int16).reshape(3, 4)

    def body(world):
        box = Box.full(g.shape).split(0, world.rank, 2)
        pieces = {"g": [(box, g[box.slices])], "h": [] if world.rank else [(Box.full((2,)), np.ones(2))]}
        save_slices(path, pieces)

    ax.run_local(body, world_size=2)
    index = load(os.path.join(path, INDEX), group=ONE)
    assert index["arrays"]["g"]["boxes"] == [[0, [0, 0], [2, 4]], [1, [2, 0], [1, 4]]]
    assert index["arrays"]["h"]["boxes"] == [[0, [0], [2]]]
    got, _ = load_slices(path, {"g": [Box((3, 4), (1, 1), (2, 2)), Box.full((3, 4))], "h": []}, group=ONE)
    assert got["h"] == [] and len(got["g"]) == 2
    assert_bits(got["g"][0], g[1:3, 1:3])
    assert_bits(got["g"][1], g)


def _flat_saved(path, world_size=3):
    ax.run_local(lambda world: save_slices(path, flat_pieces(world.rank, world.world_size, "flat"), extra=EXTRA),
                 world_size=world_size)


def test_a_list_request_reads_each_needed_entry_once(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _flat_saved(path)
    opened, entries = _recording(monkeypatch)
    g = flat_reference()["w"]
    boxes = [Box((7, 5), (1, 0), (1, 5)), Box((7, 5), (1, 1), (2, 3)), Box((7, 5), (1, 0), (3, 5))]  # overlapping
    got, _ = load_slices(path, {"w": boxes}, group=ONE)
    for box, array in zip(boxes, got["w"]):
        assert_bits(array, g[box.slices])
    # rows 1-3 are file 1's w#0 (rows 1-2) and w#1 (row 3, columns 0-1), and file 2's w#0 (row 3, columns 2-4)
    assert sorted(opened[threading.get_ident()]) == [slice_file(1, 3), slice_file(2, 3)]
    read = entries[threading.get_ident()]
    assert read.count("__meta__") == 3 and len(read) == 6, read  # the index's and 2 files' metadata, 3 pieces


def test_overlapping_requests_are_not_taken_for_a_file_too_small(tmp_path):
    """The size check counts each saved entry once, however many wanted boxes it serves."""
    path = str(tmp_path / "ckpt")
    g = np.arange(64 * 64, dtype=np.float64).reshape(64, 64)
    save_slices(path, {"g": (Box.full(g.shape), g)}, group=ONE)
    assert os.path.getsize(os.path.join(path, slice_file(0, 1))) < 2 * g.nbytes
    got, _ = load_slices(path, {"g": [Box.full(g.shape)] * 3}, group=ONE)
    for array in got["g"]:
        assert_bits(array, g)


def test_a_checkpoint_written_before_pieces_were_numbered_still_loads(tmp_path):
    """Written by hand, file by file, as the first version of the format was: one box per file and name."""
    path = str(tmp_path / "ckpt")
    os.mkdir(path)
    g = np.arange(35, dtype=np.float64).reshape(7, 5) - 0.5
    save(os.path.join(path, slice_file(0, 2)), {"g": g[:4], "s": np.array(3, dtype=np.int64)}, group=ONE)
    save(os.path.join(path, slice_file(1, 2)), {"g": g[4:]}, group=ONE)
    save(os.path.join(path, INDEX), {"format": "axonhpc.sliced/1", "world_size": 2, "extra": {"step": 9},
                                     "arrays": {"g": {"shape": [7, 5], "dtype": "<f8",
                                                      "boxes": [[0, [0, 0], [4, 5]], [1, [4, 0], [3, 5]]]},
                                                "s": {"shape": [], "dtype": "<i8", "boxes": [[0, [], []]]}}},
         group=ONE)
    got, extra = read_full(path)
    assert extra == {"step": 9} and int(got["s"]) == 3
    assert_bits(got["g"], g)
    buffer = np.zeros(20)
    wanted = [(piece, buffer[a - 10:b - 10].reshape(piece.shape))
              for piece, a, b in flat_range_boxes(Box.full((7, 5)), 10, 30)]
    got, _ = ax.run_local(lambda world: load_slices(path, {"g": wanted if world.rank == 0 else Box.full((7, 5))}),
                          world_size=2)[0]
    assert_bits(buffer, g.ravel()[10:30])


@pytest.mark.parametrize("case,fragments", [
    ("twice", ["group rank 1 gives the box at offset (2, 0) of shape (1, 5) of 'w' twice (as its pieces 0 and 3)"]),
    ("overlap", ["the pieces of 'w' (global shape (7, 5)) do not cover it exactly once: the boxes at offset (3, 0) of "
                 "shape (1, 5) and at offset (3, 3) of shape (2, 2) overlap"]),
    ("many", ["a piece was refused on group rank 0: piece 'w': a list of 4097 pieces, more than MAX_PIECES_PER_FILE "
              "= 4096 (of one name from one rank)"]),
    ("item", ["a piece was refused on group rank 2: piece 'w' [2]: the array has shape (1, 2), its box (2, 2)"]),
    ("form", ["a piece was refused on group rank 1: piece 'w' [0]: expected (Box, array) or (global_shape, offset, "
              "array), got list"]),
    ("key", ["group rank 0 writes several boxes of 'w', stored in its file as 'w#<i>', and a box of 'w#0': both "
             "would be stored under the key 'w#0'; rename 'w#0'"]),
])
def test_bad_lists_of_pieces_raise_the_same_error_on_every_rank_before_writing(tmp_path, case, fragments):
    """Rows 0-1, 2-4 and 5-6 over 3 ranks, each given as a list of one piece per row; then one rank's list spoilt."""
    path = str(tmp_path / "ckpt")
    _saved_a(path)
    g = reference()["w"]

    def body(world):
        rows = range(*[(0, 2), (2, 5), (5, 7)][world.rank])
        pieces = {"w": [(Box((7, 5), (r, 0), (1, 5)), g[r:r + 1]) for r in rows]}
        mine = pieces["w"]
        if case == "twice" and world.rank == 1:
            mine.append(mine[0])
        if case == "overlap" and world.rank == 1:  # two pieces of one rank
            mine.append((Box((7, 5), (3, 3), (2, 2)), g[3:5, 3:5]))
        if case == "many" and world.rank == 0:
            mine += [(Box((7, 5), (0, 0), (0, 5)), g[:0])] * 4095
        if case == "item" and world.rank == 2:
            mine.append((Box((7, 5), (0, 0), (2, 2)), g[:1, :2]))
        if case == "form" and world.rank == 1:
            mine[0] = [mine[0][0], mine[0][1]]
        if case == "key" and world.rank == 0:
            pieces["w#0"] = (Box.full((1,)), np.zeros(1))
        save_slices(path, pieces, extra={"which": "B"})

    messages = _messages(body, 3)
    assert len(set(messages)) == 1, messages
    for fragment in fragments:
        assert fragment in messages[0], messages[0]
    assert messages[0].startswith(f"saving checkpoint {path!r}: nothing was written")
    _still_a(path, tmp_path)


def test_a_bad_list_request_on_one_rank_fails_on_every_rank_and_changes_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    _flat_saved(path)

    def body(world):
        buffer = np.full(35, 9.0)
        wanted = [(piece, buffer[a:b].reshape(piece.shape))
                  for piece, a, b in flat_range_boxes(Box.full((7, 5)), 0, 35)]
        if world.rank == 1:
            wanted.append((Box.full((7, 5)), np.zeros((7, 5), dtype=np.float32)))
        if world.rank == 2:
            readonly = np.zeros((7, 5))
            readonly.flags.writeable = False
            wanted.append((Box.full((7, 5)), readonly))
        with pytest.raises(CheckpointError) as info:
            load_slices(path, {"w": wanted})
        assert np.all(buffer == 9.0)  # rank 0 could read its part, but nothing changed
        return str(info.value)

    messages = ax.run_local(body, world_size=3)
    assert "array 'w' is float64 in the checkpoint; the destination is float32" in messages[1], messages[1]
    assert "wanted 'w' [1]: the destination array is read-only" in messages[2], messages[2]
    assert messages[0].startswith(f"loading checkpoint {path!r} failed on group ranks [1, 2] (see the error raised "
                                  f"there), so no rank uses it: group rank 1: CheckpointError: ")
    assert "the destination is float32" in messages[0] and "read-only" in messages[0], messages[0]


def _crafted_flat(tmp_path, change):
    """The 3-rank flat checkpoint of ``w`` (boxes as in the test above) with its index rewritten by ``change``."""
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: save_slices(path, {"w": flat_pieces(world.rank, 3, "flat")["w"]}), world_size=3)
    index = load(os.path.join(path, INDEX), group=ONE)
    change(index["arrays"]["w"]["boxes"])
    rewrite_index(path, index)
    with pytest.raises(CheckpointError) as info:
        read_full(path)
    message = str(info.value)
    assert path in message
    return message


def _swap_pieces(boxes):
    boxes[1][3], boxes[2][3] = 1, 0


@pytest.mark.parametrize("change,fragment", [
    (lambda b: b[1].__setitem__(3, MAX_PIECES_PER_FILE), "arrays['w'].boxes[1] piece=[4096]; expected a list of 1 "
                                                         "integers from 0 to 4095"),
    (lambda b: b[1].__setitem__(3, -1), "arrays['w'].boxes[1] piece=[-1]"),
    (lambda b: b[1].__setitem__(3, True), "arrays['w'].boxes[1] piece=[True]"),
    (lambda b: b[1].__setitem__(3, "0"), "arrays['w'].boxes[1] piece=['0']"),
    (lambda b: b[2].__setitem__(3, 0), "arrays['w'].boxes[2]=[1, [3, 0], [1, 2], 0]; expected a box inside the "
                                       "global shape (7, 5), one per file, or numbered pieces"),
    (lambda b: b[2].pop(), "arrays['w'].boxes[2]=[1, [3, 0], [1, 2]]; expected a box inside"),  # mixed kinds
    (lambda b: b[0].append(0) or b.insert(1, [0, [0, 0], [1, 5]]), "arrays['w'].boxes[1]=[0, [0, 0], [1, 5]]"),
    (lambda b: b[1].append(0), "arrays['w'].boxes[1]=[1, [1, 0], [2, 5], 0, 0]; expected [file rank, offset, "
                               "shape] or [file rank, offset, shape, piece]"),
    (lambda b: b.extend([b[0]] * (3 * MAX_PIECES_PER_FILE)),
     "arrays['w'].boxes=[[0, [0, 0], [1, 5]], [1, [1, 0], [2, 5], 0], [1, [3, 0], [1, 2], 1], [2, [3, 2]...; "
     "expected a list of at most 12288 boxes"),
    (_swap_pieces, "'slices-00001-of-00003.npz' holds 'w#1' as float64 of shape (1, 2); the index says float64 of "
                   "shape (2, 5)"),
    (lambda b: b[4].__setitem__(3, 5), "holds ['w#5'] not exactly once, as the index says it does"),
    (lambda b: b[0].append(0), "holds ['w#0'] not exactly once"),  # file 0 holds 'w', not a numbered piece
])
def test_a_crafted_index_of_numbered_pieces_is_refused(tmp_path, change, fragment):
    message = _crafted_flat(tmp_path, change)
    assert fragment in message, message


# ------------------------------------------------------------------------------------ on MPI ranks

@contextlib.contextmanager
def _shared_checkpoint_path():
    """A checkpoint path in a directory rank 0 makes for every rank, removed by rank 0 once every rank is done."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    directory = comm.bcast(tempfile.mkdtemp(prefix="axonhpc-sliced-") if comm.rank == 0 else None, root=0)
    try:
        yield os.path.join(directory, "ckpt")
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.mpi(min_size=1)
def test_mpi_save_on_all_ranks_load_under_other_layouts_on_each_smaller_group(mpi_world):
    with _shared_checkpoint_path() as path:
        collectively(mpi_world, lambda: save_case(path, mpi_world.default_group, "rows", EXTRA))
        for m in range(1, mpi_world.world_size + 1):
            group = mpi_world.new_group(list(range(m)))
            for layout in ("cols", "blocks", "rows"):
                collectively(mpi_world, lambda: load_case(path, group, layout) if group.is_member else None)
        collectively(mpi_world, lambda: read_full_case(path))
        n = mpi_world.world_size
        assert sorted(os.listdir(path)) == [INDEX] + [slice_file(r, n) for r in range(n)]


@pytest.mark.mpi(min_size=2)
def test_mpi_replicas_are_written_once(mpi_world):
    g = np.arange(30, dtype=np.int64).reshape(6, 5)
    n, rank = mpi_world.world_size, mpi_world.rank
    with _shared_checkpoint_path() as path:
        def save_replicated():
            box = Box.full(g.shape).split(1, rank % 2, 2)  # two column blocks, each held by every other rank
            save_slices(path, {"g": (box, g[box.slices]), "b": (Box.full((3,)), np.full(3, rank))})

        collectively(mpi_world, save_replicated)
        assert sorted(os.listdir(path)) == [INDEX, slice_file(0, n), slice_file(1, n)]
        got, _ = read_full(path)
        assert_bits(got["g"], g)
        assert_bits(got["b"], np.zeros(3, dtype=got["b"].dtype))


@pytest.mark.mpi(min_size=2)
def test_mpi_errors_are_raised_on_every_rank(mpi_world):
    n, rank = mpi_world.world_size, mpi_world.rank
    with _shared_checkpoint_path() as path:
        def disagree():
            box = layout_box((7, 5), "rows", rank, n)
            shape = (7, 6) if rank == n - 1 else (7, 5)
            with pytest.raises(CheckpointError) as info:
                save_slices(path, {"w": (shape, box.offset, reference()["w"][box.slices])})
            others = "group rank 0 says (7, 5)" if n == 2 else f"group ranks {list(range(n - 1))} say (7, 5)"
            assert f"the ranks disagree on the global shape of 'w': {others}, group rank {n - 1} says (7, 6)" \
                in str(info.value)
            assert not os.path.exists(path)

        collectively(mpi_world, disagree)
        collectively(mpi_world, lambda: save_case(path, mpi_world.default_group, "rows", EXTRA))

        def missing_on_one_rank():
            wanted = {"w": Box.full((7, 5))} if rank else {"missing": Box.full((1,))}
            with pytest.raises(CheckpointError) as info:
                load_slices(path, wanted)
            expected = "holds no array 'missing'" if rank == 0 else "failed on group ranks [0]"
            assert expected in str(info.value)

        collectively(mpi_world, missing_on_one_rank)


@pytest.mark.mpi(min_size=1)
def test_mpi_flat_shards_load_under_other_layouts_on_each_smaller_group(mpi_world):
    n = mpi_world.world_size
    with _shared_checkpoint_path() as path:
        for layout in ("flat", "tpflat"):
            collectively(mpi_world, lambda: save_slices(path, flat_pieces(mpi_world.rank, n, layout), extra=EXTRA))
            for m in range(1, n + 1):
                group = mpi_world.new_group(list(range(m)))
                for load_layout in ("cols", "flat"):
                    collectively(mpi_world, lambda: load_flat_case(path, group, load_layout) if group.is_member
                                 else None)

            def whole():
                got, extra = read_full(path)
                assert extra == EXTRA
                for name, g in flat_reference().items():
                    assert_bits(got[name], g, name)

            collectively(mpi_world, whole)


@pytest.mark.mpi(min_size=2)
def test_mpi_a_box_given_twice_is_refused_on_every_rank(mpi_world):
    n, rank = mpi_world.world_size, mpi_world.rank
    last = flat_pieces(n - 1, n, "flat")["w"]  # the last rank's pieces of w (every rank can compute them)
    with _shared_checkpoint_path() as path:
        def twice():
            pieces = flat_pieces(rank, n, "flat")
            if rank == n - 1:
                pieces["w"].append(pieces["w"][0])
            with pytest.raises(CheckpointError) as info:
                save_slices(path, pieces)
            box = last[0][0]
            assert str(info.value) == (f"saving checkpoint {path!r}: nothing was written, group rank {n - 1} gives "
                                       f"the box at offset {box.offset} of shape {box.shape} of 'w' twice (as its "
                                       f"pieces 0 and {len(last)})")
            assert not os.path.exists(path)

        collectively(mpi_world, twice)
