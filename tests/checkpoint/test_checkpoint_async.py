"""Checkpoints saved in the background (``checkpoint.background``) and the trainer's ``async_checkpoints``.

The cases are functions of a world and a ``Gate`` (which can hold a rank's
writer thread, or make its write fail like a full disk), run on threads at
world sizes 1 to 4 and, marked ``mpi``, on MPI ranks. Nothing here measures
time: "the next save waits for the last" is checked by the order of events,
with the first write held until another thread lets it go.
"""
import glob
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
import zipfile
from collections import defaultdict

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.checkpoint import (Box, clean_interrupted, latest, load, load_per_rank, load_sharded, load_slices,
                                read_full, save, save_per_rank, save_sharded, save_slices)
from axonhpc.checkpoint import background, directory
from axonhpc.checkpoint.background import AsyncCheckpointer, host_copy
from axonhpc.checkpoint.sliced import flat_range_boxes, slice_file
from axonhpc.errors import CheckpointError, ConfigurationError
from axonhpc.groups import ProcessGroup
from test_checkpoint_crash import B_ARRAYS, B_BYTES, B_ELEMENTS, FRACTIONS, STATES, assert_is_a
from test_checkpoint_sliced import flat_pieces, flat_reference
from support import runner, scratch  # not runner's names: CASES below is every global named case_*
from support.crash_child import expect_line, kill_when_written, start_child
from support.trainer_cases import full_parameters, make_data, train

try:
    import ml_dtypes
except ImportError:  # the bf16 extra is optional
    ml_dtypes = None

ONE = ProcessGroup.mock()


# ------------------------------------------------------------------------------------ helpers

class Gate:
    """Stands between the checkpointer and its local writes: holds, fails and counts them per (path, rank)."""

    def __init__(self, monkeypatch):
        self.lock = threading.Lock()
        self.held = {}  # (path, rank) -> Event the writer thread waits for
        self.failing = {}  # file name -> OSError its write_atomic raises
        self.active = defaultdict(int)  # rank -> writer threads running now
        self.most = defaultdict(int)  # rank -> most writer threads ever running at once
        self.finished = set()  # (path, rank) whose write has ended
        real_file, real_member, real_atomic = background.write_file, background.write_member, directory.write_atomic

        def write_file(path, state, pg):
            return self._run((path, pg.rank), real_file, path, state, pg)

        def write_member(path, token, rank, name, state):
            return self._run((path, rank), real_member, path, token, rank, name, state)

        def write_atomic(path, entries):
            problem = self.failing.get(os.path.basename(path))
            if problem is not None:
                with open(f"{path}.tmp-gate", "wb") as f:  # half a file, as a full disk leaves one
                    f.write(b"PK\x03\x04 half")
                os.unlink(f"{path}.tmp-gate")
                raise problem
            return real_atomic(path, entries)

        monkeypatch.setattr(background, "write_file", write_file)
        monkeypatch.setattr(background, "write_member", write_member)
        monkeypatch.setattr(directory, "write_atomic", write_atomic)

    def hold(self, path, rank):
        """Make the write of ``path`` on ``rank`` wait; returns the Event that lets it go."""
        event = threading.Event()
        self.held[(os.fspath(path), rank)] = event
        return event

    def fail(self, name, problem):
        """Make every write of the file ``name`` raise ``problem``."""
        self.failing[name] = problem

    def _run(self, key, real, *args):
        rank = key[1]
        with self.lock:
            self.active[rank] += 1
            self.most[rank] = max(self.most[rank], self.active[rank])
        try:
            event = self.held.get(key)
            if event is not None:
                assert event.wait(120), f"the write of {key} was never released"
            return real(*args)
        finally:
            with self.lock:
                self.active[rank] -= 1
                self.finished.add(key)


@pytest.fixture
def gate(monkeypatch):
    return Gate(monkeypatch)


def shared_dir(world):
    """``support.scratch.shared_dir`` with this module's prefix."""
    return scratch.shared_dir(world, "axonhpc-async-")


def sample_state(rank):
    """A state of every kind of value a checkpoint holds, different on each rank."""
    rng = np.random.default_rng(10 + rank)
    state = {
        "w": rng.standard_normal((33, 7)).astype(np.float32),
        "fortran": np.asfortranarray(rng.standard_normal((4, 5))),
        "strided": rng.integers(-9, 9, (6, 8))[::2, 1::3],
        "zero_d": np.array(rank + 0.5), "empty": np.zeros((3, 0)), "flags": rng.random(5) > 0.5,
        "complex": (rng.standard_normal(3) + 1j).astype(np.complex64),
        "scalar": np.float32(1.5), "step": 12 + rank, "huge": 2**100 + rank, "lr": 1e-3, "nan": float("nan"),
        "name": "résumé", "none": None, "nested": [1, (2.0, np.arange(4, dtype=np.int16)), {"x": [np.ones(2)]}],
    }
    if ml_dtypes is not None:
        state["bf16"] = rng.standard_normal(6).astype(ml_dtypes.bfloat16)
    return state


def assert_same_tree(got, want, where="state"):
    assert type(got) is type(want), (where, got, want)
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same_tree(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{where}[{i}]")
    elif isinstance(want, (np.ndarray, np.generic)):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), where
    elif isinstance(want, float) and want != want:
        assert got != got, where
    else:
        assert got == want, where


def _meta_without_save(data):
    """A ``__meta__`` entry's JSON without the save token, which differs from save to save by design."""
    meta = json.loads(np.load(io.BytesIO(data)).tobytes())
    meta.pop("save", None)
    return meta


def assert_same_files(a, b):
    """Two checkpoint files hold the same entries byte for byte (only the zip timestamps and the save tokens may differ)."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        assert za.namelist() == zb.namelist()
        for name in za.namelist():
            if name == "__meta__.npy":
                assert _meta_without_save(za.read(name)) == _meta_without_save(zb.read(name)), (a, b, name)
            else:
                assert za.read(name) == zb.read(name), (a, b, name)


def assert_same_directories(a, b):
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        assert_same_files(os.path.join(a, name), os.path.join(b, name))


def leftovers(path):
    return sorted(glob.glob(f"{path}.tmp-*") + glob.glob(f"{path}.old-*"))


# ------------------------------------------------------------------------------------ cases

def case_round_trip_is_the_sync_save_bit_for_bit(world, gate):
    mine = sample_state(world.rank)
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        save(os.path.join(d, "sync.npz"), mine)
        save_per_rank(os.path.join(d, "sync"), mine, extra={"step": 3, "rng": np.arange(4, dtype=np.uint64)})
        saver.save(os.path.join(d, "async.npz"), mine)
        saver.save_per_rank(os.path.join(d, "async"), mine, extra={"step": 3, "rng": np.arange(4, dtype=np.uint64)})
        assert saver.wait() == os.path.join(d, "async") and saver.pending is None
        assert_same_tree(load(os.path.join(d, "async.npz")), sample_state(0))  # group rank 0 writes the file
        state, extra = load_per_rank(os.path.join(d, "async"))
        assert_same_tree(state, mine)
        assert extra["step"] == 3 and extra["rng"].tolist() == [0, 1, 2, 3]
        if world.rank == 0:
            assert_same_files(os.path.join(d, "sync.npz"), os.path.join(d, "async.npz"))
            assert_same_directories(os.path.join(d, "sync"), os.path.join(d, "async"))
            assert sorted(os.listdir(d)) == ["async", "async.npz", "sync", "sync.npz"]  # nothing left over


def case_the_caller_may_change_its_arrays_right_after_save(world, gate):
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        for kind in ("file", "directory"):
            path = os.path.join(d, kind)
            writer = 0 if kind == "file" else world.rank
            w = np.arange(1000, dtype=np.float64) + world.rank
            state = {"w": w, "items": [np.ones(3)], "meta": {"step": 1}}
            release = gate.hold(path, writer) if world.rank == writer else None  # nothing is written before ...
            (saver.save if kind == "file" else saver.save_per_rank)(path, state)
            # ... training goes on: the arrays change in place, the containers change too.
            w[:] = -1.0
            state["items"][0] *= 7
            state["items"].append(np.zeros(2))
            state["meta"]["step"] = 99
            state["new"] = "added after save"
            if release is not None:
                release.set()
            saver.wait()
            got = load(path) if kind == "file" else load_per_rank(path)[0]
            assert sorted(got) == ["items", "meta", "w"] and got["meta"] == {"step": 1}
            assert len(got["items"]) == 1 and got["items"][0].tolist() == [1.0, 1.0, 1.0]
            assert got["w"].tolist() == list(np.arange(1000.0) + (0 if kind == "file" else world.rank))


def case_the_next_save_waits_for_the_last(world, gate):
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        for kind in ("file", "directory"):
            first, second = os.path.join(d, f"{kind}-1"), os.path.join(d, f"{kind}-2")
            start = saver.save if kind == "file" else saver.save_per_rank
            writer = 0 if kind == "file" else world.rank
            release = gate.hold(first, writer) if world.rank == writer else None
            start(first, {"n": np.full(10, 1.0)})
            assert saver.pending == first
            if kind == "directory":
                assert not os.path.exists(first) and latest(d, f"{kind}-*") is None  # not in place before wait
            events = []

            def let_go():
                events.append("first write released")
                release.set()

            timer = threading.Timer(0.2, let_go) if release is not None else None
            if timer is not None:
                timer.start()
            start(second, {"n": np.full(10, 2.0)})  # blocks until the first is written and finished
            events.append("second save started")
            if timer is not None:
                timer.join()
                assert events == ["first write released", "second save started"], events
                assert (first, writer) in gate.finished
            assert saver.pending == second
            assert os.path.exists(os.path.join(first, "index.npz") if kind == "directory" else first)
            saver.wait()
        assert all(n <= 1 for n in gate.most.values()), dict(gate.most)  # never two writes of one rank at once


def case_poll_finishes_only_when_every_rank_has_written(world, gate):
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        saver.save_per_rank(os.path.join(d, "ckpt-1"), {"v": np.full(3, 1.0)})
        saver.wait()
        last = world.world_size - 1
        # only the last rank's write is slow
        release = gate.hold(os.path.join(d, "ckpt-2"), last) if world.rank == last else None
        saver.save_per_rank(os.path.join(d, "ckpt-2"), {"v": np.full(3, 2.0)})
        assert saver.poll() is False  # every rank agrees: not yet, whether its own write is done or not
        assert saver.pending == os.path.join(d, "ckpt-2") and latest(d) == os.path.join(d, "ckpt-1")
        if release is not None:
            release.set()
        polls = 1
        while not saver.poll():  # the verdict is agreed, so every rank leaves this loop after the same poll
            polls += 1
            time.sleep(0.005)
        assert saver.pending is None and saver.poll() is False
        assert latest(d) == os.path.join(d, "ckpt-2")
        assert load_per_rank(os.path.join(d, "ckpt-2"))[0]["v"].tolist() == [2.0] * 3
        counts = ax.all_gather(np.array([polls]))
        assert len(set(counts.reshape(-1).tolist())) == 1, counts


def case_a_failed_write_raises_the_same_error_on_every_rank(world, gate):
    last = world.world_size - 1
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        # A file in a directory that does not exist (rank 0 writes it).
        saver.save(os.path.join(d, "missing", "ckpt.npz"), {"w": np.zeros(2)})
        with pytest.raises(CheckpointError) as info:
            saver.wait()
        assert "failed on group rank 0" in str(info.value) and "FileNotFoundError" in str(info.value)
        messages = [str(info.value)]
        # A directory whose last rank meets a full disk, and one whose last rank holds a value no checkpoint can.
        path = os.path.join(d, "ckpt-7")
        save_per_rank(path, {"which": "previous", "r": world.rank})
        gate.fail(f"rank-{last:05d}-of-{world.world_size:05d}.npz", OSError(28, "No space left on device"))
        for state, reason in (({"which": "new"}, "No space left on device"),
                              ({"which": "new", "bad": {1, 2} if world.rank == last else 0}, "state['bad']")):
            saver.save_per_rank(path, state)
            with pytest.raises(CheckpointError) as info:
                saver.wait()
            text = str(info.value)
            assert f"failed on group ranks [{last}]" in text and reason in text, text
            assert saver.pending is None
            messages.append(text)
            gate.failing.clear()
            ax.barrier()
            assert leftovers(path) == [] and sorted(os.listdir(d)) == ["ckpt-7"]  # no partial checkpoint
            assert load_per_rank(path)[0] == {"which": "previous", "r": world.rank}
        text = "\n".join(messages).encode()
        assert len(text) < 16384
        table = ax.all_gather(np.frombuffer(text.ljust(16384), dtype=np.uint8).copy())
        assert all(row.tobytes() == table[0].tobytes() for row in table), "the ranks raised different errors"
        saver.save_per_rank(path, {"which": "after"})  # a failure does not stop the next save
        saver.wait()
        assert load_per_rank(path)[0] == {"which": "after"}


def case_an_error_in_the_with_block_abandons_the_save_without_communicating(world, gate):
    with shared_dir(world) as d:
        path = os.path.join(d, "ckpt-5")
        with pytest.raises(RuntimeError, match="boom"):
            with AsyncCheckpointer() as saver:
                saver.save_per_rank(path, {"w": np.ones(4)})
                raise RuntimeError("boom")  # on every rank here; on one rank, a collective would hang
        assert saver.pending is None and (os.path.join(d, "ckpt-5"), world.rank) in gate.finished
        ax.barrier()
        left = leftovers(path)
        assert latest(d) is None and not os.path.exists(path) and len(left) == 1, left
        ax.barrier()
        if world.rank == 0:
            assert clean_interrupted(d) == [f"removed {os.path.basename(left[0])}"]


def case_sharded_saves_match_the_sync_save(world, gate):
    trainer = train(world, "fsdp", epochs=1, kind="adam")
    fsdp, opt = trainer.setup.wrapper, trainer.setup.optimizer
    with shared_dir(world) as d, AsyncCheckpointer(fsdp.group) as saver:
        save_sharded(os.path.join(d, "sync"), fsdp, opt, extra={"epoch": 1})
        saver.save_sharded(os.path.join(d, "async"), fsdp, opt, extra={"epoch": 1})
        before = full_parameters(trainer)
        trainer.fit(make_data(), 2, batch_size=4)  # the model and optimizer move on while the shards are written
        saver.wait()
        if world.rank == 0:
            assert_same_directories(os.path.join(d, "sync"), os.path.join(d, "async"))
        assert load_sharded(os.path.join(d, "async"), fsdp, opt) == {"epoch": 1}
        after = full_parameters(trainer)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        if world.world_size > 1:
            sub = world.new_group([0])
            if sub.is_member:
                with pytest.raises(ConfigurationError, match="works on ranks"):
                    AsyncCheckpointer(sub).save_sharded(os.path.join(d, "x"), fsdp, opt)


def case_trainer_async_checkpoints_resume_bit_for_bit(world, gate):
    for strategy in ("ddp", "zero1", "fsdp", "pipeline"):
        options = {"num_microbatches": 2} if strategy == "pipeline" else {}
        uninterrupted = train(world, strategy, kind="adam", **options)
        final = {}
        with shared_dir(world) as d:
            for mode in ("sync", "async"):
                directory_ = os.path.join(d, mode)

                def stop_at_5(trainer, step, loss):
                    if step == 5 and trainer.rank == world.world_size - 1:  # one rank only, like a signal
                        trainer.request_stop()

                common = dict(kind="adam", checkpoint_dir=directory_, checkpoint_every=2,
                              async_checkpoints=mode == "async", **options)
                first = train(world, strategy, on_step=stop_at_5, **common)
                assert first.preempted and first.global_step == 5
                assert (first._writer is not None) == (mode == "async")
                resumed = train(world, strategy, **common)
                assert not resumed.preempted and resumed.global_step == uninterrupted.global_step
                got, want = full_parameters(resumed), full_parameters(uninterrupted)
                for name in want:
                    np.testing.assert_array_equal(got[name], want[name], err_msg=f"{strategy} {mode} {name}")
                ax.barrier()
                names = sorted(os.listdir(directory_))
                checkpoints = [n for n in names if n.startswith("ckpt-")]
                assert names == checkpoints + ["metrics.jsonl"] and len(checkpoints) == 3, names  # pruned, no leftovers
                assert all(os.path.isfile(os.path.join(directory_, n, "index.npz")) for n in checkpoints)
                final[mode] = checkpoints
            assert final["sync"] == final["async"]
            if world.rank == 0:  # the same checkpoints, entry for entry
                for name in final["sync"]:
                    assert_same_directories(os.path.join(d, "sync", name), os.path.join(d, "async", name))


ROWS = np.arange(18, dtype=np.float32).reshape(6, 3) / 4


def slice_state(rank, size):
    """``save_slices`` pieces: FSDP-like flat ranges of tensor-parallel column blocks (several boxes per rank),
    uneven row blocks, and a 0-d array every rank holds (replicas: rank 0 writes it)."""
    pieces = flat_pieces(rank, size, "tpflat")
    rows = Box.full(ROWS.shape).split(0, rank, size)
    pieces["rows"] = (rows, ROWS[rows.slices].copy())
    pieces["step"] = (Box.full(()), np.array(41, dtype=np.int64))
    return pieces


def assert_slice_state(path, world):
    """The checkpoint at ``path`` holds ``slice_state``'s arrays: loaded under columns and read whole."""
    want = dict(flat_reference(), rows=ROWS, step=np.array(41, dtype=np.int64))
    boxes = {name: Box.full(g.shape) if g.ndim == 0 else Box.full(g.shape).split(g.ndim - 1, world.rank,
                                                                                  world.world_size)
             for name, g in want.items()}
    got, _ = load_slices(path, boxes)
    for name, box in boxes.items():
        assert_same_tree(got[name], np.asarray(want[name][box.slices]), f"{name} on rank {world.rank}")
    whole, extra = read_full(path)
    for name, g in want.items():
        assert_same_tree(whole[name], g, name)
    return extra


def case_slices_are_the_sync_save_bit_for_bit(world, gate):
    n = world.world_size
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        extra = {"step": 3, "rng": np.arange(4, dtype=np.uint64)}
        sync, async_ = os.path.join(d, "sync"), os.path.join(d, "async")
        save_slices(sync, slice_state(world.rank, n), extra=extra)
        saver.save_slices(async_, slice_state(world.rank, n), extra=extra)
        assert saver.pending == async_
        assert saver.wait() == async_ and saver.pending is None
        got = assert_slice_state(async_, world)
        assert got["step"] == 3 and got["rng"].tolist() == [0, 1, 2, 3]
        index = load(os.path.join(async_, "index.npz"))
        assert any(len(entry) == 4 for entry in index["arrays"]["w"]["boxes"])  # several pieces of w per file
        replicas = os.path.join(d, "replicas")  # every rank holds the whole array: only rank 0 has a file
        saver.save_slices(replicas, {"rows": (Box.full(ROWS.shape), ROWS)}, extra=None, copy=False)
        saver.wait()
        assert_same_tree(read_full(replicas)[0]["rows"], ROWS)
        if world.rank == 0:
            assert_same_directories(sync, async_)
            assert sorted(os.listdir(replicas)) == ["index.npz", slice_file(0, n)]
            assert sorted(os.listdir(d)) == ["async", "replicas", "sync"]  # nothing left over


def case_slices_the_caller_may_change_its_pieces_right_after_save(world, gate):
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        path = os.path.join(d, "ckpt")
        pieces = slice_state(world.rank, world.world_size)
        extra = {"step": 1, "items": [np.ones(2)]}
        release = gate.hold(path, world.rank)  # nothing is written before ...
        saver.save_slices(path, pieces, extra=extra)
        # ... training goes on: the flat shards behind the pieces change in place, the extra too.
        for value in pieces.values():
            for _, array in value if isinstance(value, list) else [value]:
                array[...] = -7
        extra["step"] = 99
        extra["items"][0] *= 5
        pieces.clear()
        release.set()
        saver.wait()
        got = assert_slice_state(path, world)
        assert got["step"] == 1 and got["items"][0].tolist() == [1.0, 1.0]


def case_a_refused_slices_save_raises_at_the_call_on_every_rank(world, gate):
    n, last = world.world_size, world.world_size - 1
    with shared_dir(world) as d, AsyncCheckpointer() as saver:
        path = os.path.join(d, "ckpt")
        saver.save_slices(path, slice_state(world.rank, n), extra={"which": "previous"})
        pieces = slice_state(world.rank, n)
        if world.rank == last:  # two pieces of one rank overlap
            pieces["w"].append((Box((7, 5), (0, 0), (7, 5)), flat_reference()["w"]))
        with pytest.raises(CheckpointError) as info:
            saver.save_slices(path, pieces, extra={"which": "new"})  # finishes the previous save, then refuses
        text = str(info.value)
        assert text.startswith(f"saving checkpoint {path!r}: nothing was written, the pieces of 'w' (global shape "
                               f"(7, 5)) do not cover it exactly once: the boxes at offset"), text
        assert "overlap" in text and saver.pending is None
        ax.barrier()
        assert leftovers(path) == [] and sorted(os.listdir(d)) == ["ckpt"]
        assert assert_slice_state(path, world) == {"which": "previous"}
        messages = [text]
        # A write that fails in the thread is raised at wait, on every rank, leaving the previous checkpoint.
        gate.fail(slice_file(last, n), OSError(28, "No space left on device"))
        saver.save_slices(path, slice_state(world.rank, n), extra={"which": "new"})
        with pytest.raises(CheckpointError) as info:
            saver.wait()
        text = str(info.value)
        assert f"failed on group ranks [{last}]" in text and "No space left on device" in text, text
        messages.append(text)
        gate.failing.clear()
        ax.barrier()
        assert leftovers(path) == [] and assert_slice_state(path, world) == {"which": "previous"}
        table = ax.all_gather(np.frombuffer("\n".join(messages).encode().ljust(8192), dtype=np.uint8).copy())
        assert all(row.tobytes() == table[0].tobytes() for row in table), "the ranks raised different errors"
        saver.save_slices(path, slice_state(world.rank, n), extra={"which": "after"})  # the next save works
        saver.wait()
        assert assert_slice_state(path, world) == {"which": "after"}


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}


test_async_case_local, test_async_case_mpi = runner.case_tests(CASES, fixtures=["gate"],
                                                           threads_marks=[pytest.mark.timeout(300)])


# ------------------------------------------------------------------------------------ one process

def test_host_copy_owns_its_arrays_and_keeps_what_it_cannot_copy():
    w = np.arange(6.0).reshape(2, 3)
    odd = {1, 2}
    state = {"w": w, "t": (w.T, [w[:, 1]]), "odd": odd}
    copied = host_copy(state)
    w[:] = 0
    assert copied["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and copied["w"].flags.owndata
    assert copied["t"][0].flags.c_contiguous and copied["t"][0].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert copied["t"][1][0].tolist() == [1.0, 4.0] and copied["odd"] is odd  # refused later, naming the key
    kept = host_copy(state, copy=False)
    assert kept["w"] is w and kept is not state
    cyclic = {"a": []}
    cyclic["a"].append(cyclic)
    with pytest.raises(CheckpointError, match="contains itself"):
        with AsyncCheckpointer(ONE) as saver:
            saver.save(os.path.join(tempfile.gettempdir(), "never-written.npz"), cyclic)


def test_device_arrays_are_copied_to_the_host_before_save_returns(tmp_path, monkeypatch, gate):
    from support.strict_cupy import StrictCupy, device

    monkeypatch.setitem(sys.modules, "cupy", StrictCupy())
    x = device(np.arange(5.0))
    path = str(tmp_path / "ckpt.npz")
    release = gate.hold(path, 0)
    with AsyncCheckpointer(ONE) as saver:
        saver.save(path, {"x": x})
        x[...] = device(np.zeros(5))  # the device array changes before a byte is written
        release.set()
    got = load(path, group=ONE)["x"]
    assert type(got) is np.ndarray and got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


CHILD = r"""
import sys, time
import numpy as np
from axonhpc.checkpoint.background import AsyncCheckpointer
from axonhpc.groups import ProcessGroup

mode, path = sys.argv[1], sys.argv[2]
exec(sys.argv[3])  # defines state_a() and state_b()
saver = AsyncCheckpointer(ProcessGroup.mock())
start = saver.save if mode == "file" else saver.save_per_rank
start(path, state_a(), **({} if mode == "file" else {"extra": {"which": "A"}}))
saver.wait()
print("A saved", flush=True)
b = state_b()
start(path, b, **({} if mode == "file" else {"extra": {"which": "B"}}))
print("B started", flush=True)
for name in b["model"]:
    b["model"][name] += 100.0  # training goes on while the writer thread writes B
if mode == "unfinished":
    time.sleep(600)  # the files get written, but the save is never finished (no wait)
saver.wait()
print("B saved", flush=True)
"""


def _kill_while_writing(mode, path, fraction):
    """Run the child; SIGKILL it once its writer thread has written ``fraction`` of B. Returns what happened."""
    pattern = {"file": f"{path}.tmp-*", "directory": f"{path}.tmp-*/rank-*.tmp-*",
               "unfinished": f"{path}.tmp-*/rank-00000-of-00001.npz"}[mode]
    return _kill_child_when_written(start_child(CHILD, mode, path, STATES), pattern, fraction)


def _kill_child_when_written(child, pattern, fraction):
    """SIGKILL ``child`` once the file matching ``pattern`` holds ``fraction`` of B (after A is saved)."""
    try:
        expect_line(child, b"A saved\n")
        expect_line(child, b"B started\n")
    except AssertionError:
        child.kill()
        raise
    return kill_when_written(child, pattern, int(fraction * B_BYTES), settled_for=0.02 if fraction >= 1 else None)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["file", "directory", "unfinished"])
def test_sigkill_while_the_writer_thread_writes_leaves_the_previous_checkpoint(tmp_path, mode):
    """``unfinished``: killed after every file is written but before the save is finished (no index, no switch)."""
    killed, outcomes = 0, []
    for fraction in (FRACTIONS + [1.0]) if mode != "unfinished" else [1.0]:
        run = tmp_path / f"run-{fraction}"
        run.mkdir()
        path = str(run / ("ckpt-000001.npz" if mode == "file" else "ckpt-000001"))
        code, size = _kill_while_writing(mode, path, fraction)
        read = (lambda: load(path, group=ONE)) if mode == "file" else (lambda: load_per_rank(path, group=ONE)[0])
        if code == 0:  # the save completed before the kill: B whole, as it was when save returned
            state = read()
            assert state["which"] == "B" and len(state["model"]) == B_ARRAYS
            assert all(np.all(state["model"][f"p{i}"] == float(i)) for i in range(B_ARRAYS))
            outcomes.append(f"{fraction:.0%}: completed first")
            continue
        assert code == -signal.SIGKILL, code
        killed += 1
        assert_is_a(read())
        assert latest(str(run)) == path
        if mode != "file":
            assert load_per_rank(path, group=ONE)[1] == {"which": "A"}
            assert sorted(os.listdir(path)) == ["index.npz", "rank-00000-of-00001.npz"]
        left = leftovers(path)
        assert len(left) == 1, left
        assert clean_interrupted(str(run)) == [f"removed {os.path.basename(left[0])}"]
        assert_is_a(read())
        outcomes.append(f"{fraction:.0%}: killed at {size} bytes, A intact")
    print(f"\n{mode}: " + "; ".join(outcomes))
    assert killed >= (len(FRACTIONS) if mode != "unfinished" else 1), outcomes


def test_device_pieces_are_copied_to_the_host_before_save_slices_returns(tmp_path, monkeypatch, gate):
    from support.strict_cupy import StrictCupy, device

    monkeypatch.setitem(sys.modules, "cupy", StrictCupy())
    g = np.arange(12.0).reshape(3, 4)
    pieces = [(box, device(g[box.slices])) for box, _, _ in flat_range_boxes(Box.full(g.shape), 1, 12)]
    pieces.append((Box((3, 4), (0, 0), (1, 1)), device(g[:1, :1])))
    path = str(tmp_path / "ckpt")
    release = gate.hold(path, 0)
    with AsyncCheckpointer(ONE) as saver:
        saver.save_slices(path, {"g": pieces})
        for _, x in pieces:
            x[...] = device(np.zeros(x.shape))  # the device arrays change before a byte is written
        release.set()
    got, _ = read_full(path)
    assert type(got["g"]) is np.ndarray and got["g"].tolist() == g.tolist()
    assert len(load(os.path.join(path, "index.npz"), group=ONE)["arrays"]["g"]["boxes"]) == 3


def test_a_piece_that_cannot_be_copied_to_the_host_fails_the_save_at_wait_on_every_rank(tmp_path, monkeypatch):
    from support.strict_cupy import StrictCupy, UnreadableDeviceArray, device

    monkeypatch.setitem(sys.modules, "cupy", StrictCupy())
    path = str(tmp_path / "ckpt")
    g = np.arange(14.0).reshape(7, 2)

    def body(world):
        box = Box.full(g.shape).split(0, world.rank, 2)
        with AsyncCheckpointer() as saver:
            saver.save_slices(path, {"g": (box, device(g[box.slices]))}, extra={"which": "A"})
            array = UnreadableDeviceArray(g[box.slices].copy()) if world.rank == 1 else device(g[box.slices])
            saver.save_slices(path, {"g": [(box, array)]}, extra={"which": "B"})  # returns: the ranks go on
            assert saver.pending == path
            with pytest.raises(CheckpointError) as info:
                saver.wait()
            assert saver.pending is None
        return str(info.value)

    messages = ax.run_local(body, world_size=2)
    assert messages[0] == messages[1], messages
    assert "failed on group ranks [1]" in messages[0], messages[0]
    assert "copying its pieces to host memory: MemoryError: cannot allocate 56 bytes" in messages[0], messages[0]
    got, extra = read_full(path)
    assert extra == {"which": "A"} and got["g"].tolist() == g.tolist() and leftovers(path) == []


CHILD_SLICES = r"""
import sys, time
import numpy as np
from axonhpc.checkpoint import Box
from axonhpc.checkpoint.background import AsyncCheckpointer
from axonhpc.checkpoint.sliced import flat_range_boxes
from axonhpc.groups import ProcessGroup

mode, path, arrays, elements = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
saver = AsyncCheckpointer(ProcessGroup.mock())
saver.save_slices(path, {"w": (Box.full((7, 5)), np.arange(35.0).reshape(7, 5))}, extra={"which": "A"})
saver.wait()
print("A saved", flush=True)
shape, cut = (elements // 1024, 1024), elements // 3 + 100
shards = {f"p{i}": np.full(elements, float(i)) for i in range(arrays)}
# each array as a rank holding two flat ranges of it: four boxes, each a view of the shard
pieces = {name: [(box, shard[a:b].reshape(box.shape)) for lo, hi in ((0, cut), (cut, elements))
                 for box, a, b in flat_range_boxes(Box.full(shape), lo, hi)] for name, shard in shards.items()}
saver.save_slices(path, pieces, extra={"which": "B"})
print("B started", flush=True)
for shard in shards.values():
    shard += 100.0  # training goes on while the writer thread writes B
if mode == "unfinished":
    time.sleep(600)  # the file gets written, but the save is never finished (no wait)
saver.wait()
print("B saved", flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["writing", "unfinished"])
def test_sigkill_while_the_writer_thread_writes_slices_leaves_the_previous_checkpoint(tmp_path, mode):
    """``unfinished``: killed after the file is written but before the save is finished (no index, no switch)."""
    killed, outcomes = 0, []
    for fraction in (FRACTIONS + [1.0]) if mode == "writing" else [1.0]:
        run = tmp_path / f"run-{fraction}"
        run.mkdir()
        path = str(run / "ckpt-000001")
        child = start_child(CHILD_SLICES, mode, path, str(B_ARRAYS), str(B_ELEMENTS))
        pattern = f"{path}.tmp-*/slices-*.tmp-*" if mode == "writing" else f"{path}.tmp-*/slices-00000-of-00001.npz"
        code, size = _kill_child_when_written(child, pattern, fraction)
        got, extra = read_full(path)
        if code == 0:  # the save completed before the kill: B whole, as it was when save_slices returned
            assert extra == {"which": "B"} and len(got) == B_ARRAYS
            assert all(np.all(got[f"p{i}"] == float(i)) for i in range(B_ARRAYS))
            outcomes.append(f"{fraction:.0%}: completed first")
            continue
        assert code == -signal.SIGKILL, code
        killed += 1
        assert extra == {"which": "A"} and sorted(got) == ["w"]
        assert got["w"].tolist() == np.arange(35.0).reshape(7, 5).tolist()
        assert latest(str(run)) == path and sorted(os.listdir(path)) == ["index.npz", slice_file(0, 1)]
        left = leftovers(path)
        assert len(left) == 1, left
        assert clean_interrupted(str(run)) == [f"removed {os.path.basename(left[0])}"]
        assert read_full(path)[1] == {"which": "A"}
        outcomes.append(f"{fraction:.0%}: killed at {size} bytes, A intact")
    print(f"\n{mode}: " + "; ".join(outcomes))
    assert killed >= (len(FRACTIONS) if mode == "writing" else 1), outcomes
