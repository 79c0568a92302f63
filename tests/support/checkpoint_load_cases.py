"""Refused checkpoint loads, written once, run on threads (plain pytest, 1-4 ranks) and on MPI ranks.

Each case builds a checkpoint that must not load, and checks that every rank
raises (none is left waiting) and that no rank changed anything:

- a sharded FSDP checkpoint whose optimizer state is of another optimizer;
- a directory stitched from two saves: the last rank's file copied in from an
  older checkpoint of the same layout (per-rank, sharded and sliced
  directories, written now or in the background). Every rank's error names
  the file and both save tokens.
"""
import os
import shutil

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import checkpoint, nn, optim
from axonhpc.checkpoint import AsyncCheckpointer, Box
from axonhpc.checkpoint.directory import INDEX
from axonhpc.checkpoint.io import read_saved
from axonhpc.errors import CheckpointError, StateDictError
from support import scratch
from support.ddp_cases import make_data, make_model, shard


def shared_dir(world):
    """``support.scratch.shared_dir`` with this module's prefix."""
    return scratch.shared_dir(world, "axonhpc-refused-")


def _step(fsdp, opt, world, step):
    n, r = world.world_size, world.rank
    loss_fn = nn.CrossEntropyLoss()
    opt.zero_grad()
    x, y = make_data(step)
    loss_fn(fsdp(shard(x, r, n)), shard(y, r, n))
    fsdp.backward(loss_fn.backward())
    opt.step()


def _stitch(world, older, newer, name):
    """Copy ``name`` of the ``older`` save over the one in ``newer`` (rank 0, the others waiting); both tokens."""
    ax.barrier()
    tokens = None
    if world.rank == 0:
        tokens = (read_saved(os.path.join(older, name))[2], read_saved(os.path.join(newer, INDEX))[2])
        shutil.copy(os.path.join(older, name), os.path.join(newer, name))
    ax.barrier()
    return tokens


def _assert_refused_everywhere(world, message, name, tokens):
    """Every rank's error names the stitched file and, on rank 0 (which read them), both save tokens."""
    assert name in message and "mixes files of different saves" in message, message
    if tokens is not None:
        assert tokens[0] != tokens[1] and all(len(t) == 32 and t in message for t in tokens), (tokens, message)


def _fsdp(world, seed):
    return ax.FSDP(make_model(seed=seed), group=world.default_group)


def _shards(fsdp):
    return [p.data.copy() for p in fsdp.parameters()]


def case_sharded_checkpoint_of_another_optimizer_changes_nothing(world):
    """SGD state loaded into Adam: StateDictError on every rank, and the model and Adam exactly as they were."""
    with shared_dir(world) as d:
        path = os.path.join(d, "ckpt")
        saved = _fsdp(world, 0)
        sgd = optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
        _step(saved, sgd, world, 0)
        checkpoint.save_sharded(path, saved, sgd, extra={"step": 1})
        fsdp = _fsdp(world, 40)
        adam = optim.Adam(fsdp.parameters(), lr=1e-3)
        _step(fsdp, adam, world, 1)
        shards, opt_state = _shards(fsdp), adam.state_dict()
        with pytest.raises(StateDictError, match="optimizer state does not fit this optimizer") as info:
            checkpoint.load_sharded(path, fsdp, adam)
        assert "hyperparameters ['dampening', 'lr', 'momentum'" in str(info.value), str(info.value)
        for got, want in zip(_shards(fsdp), shards):
            np.testing.assert_array_equal(got, want)
        assert adam.lr == 1e-3 and adam.state_dict()["hyperparameters"] == opt_state["hyperparameters"]
        for got, want in zip(adam.state_dict()["state"], opt_state["state"]):
            assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def case_stitched_per_rank_directory_is_refused_on_every_rank(world):
    last = world.world_size - 1
    name = checkpoint.directory.rank_file(last, world.world_size)
    with shared_dir(world) as d:
        for step in (4, 6):
            checkpoint.save_per_rank(os.path.join(d, f"ckpt-{step}"), {"w": np.full(3, float(step))},
                                     extra={"step": step})
        with AsyncCheckpointer() as saver:  # the background writer records the token too
            saver.save_per_rank(os.path.join(d, "ckpt-8"), {"w": np.full(3, 8.0)}, extra={"step": 8})
        for older, newer in (("ckpt-4", "ckpt-6"), ("ckpt-6", "ckpt-8")):
            tokens = _stitch(world, os.path.join(d, older), os.path.join(d, newer), name)
            with pytest.raises(CheckpointError) as info:
                checkpoint.load_per_rank(os.path.join(d, newer))
            _assert_refused_everywhere(world, str(info.value), name, tokens)
        state, extra = checkpoint.load_per_rank(os.path.join(d, "ckpt-4"))  # an intact directory still loads
        assert extra == {"step": 4} and np.all(state["w"] == 4.0)


def case_stitched_sharded_directory_is_refused_on_every_rank(world):
    name = checkpoint.sharded.shard_file(world.world_size - 1, world.world_size)
    with shared_dir(world) as d:
        saved = _fsdp(world, 0)
        opt = optim.SGD(saved.parameters(), lr=0.1)
        for step in (4, 6):
            _step(saved, opt, world, step)
            checkpoint.save_sharded(os.path.join(d, f"fsdp-{step}"), saved, opt, extra={"step": step})
        tokens = _stitch(world, os.path.join(d, "fsdp-4"), os.path.join(d, "fsdp-6"), name)
        fsdp = _fsdp(world, 40)
        fresh = optim.SGD(fsdp.parameters(), lr=0.1)
        shards = _shards(fsdp)
        with pytest.raises(CheckpointError) as info:
            checkpoint.load_sharded(os.path.join(d, "fsdp-6"), fsdp, fresh)
        _assert_refused_everywhere(world, str(info.value), name, tokens)
        for got, want in zip(_shards(fsdp), shards):
            np.testing.assert_array_equal(got, want)
        assert checkpoint.load_sharded(os.path.join(d, "fsdp-4"), fsdp, fresh) == {"step": 4}


def case_stitched_sliced_directory_is_refused_on_every_rank(world):
    n, r = world.world_size, world.rank
    name = checkpoint.sliced.slice_file(n - 1, n)
    rows = Box.full((4 * n, 3))
    with shared_dir(world) as d:
        for step in (4, 6):
            block = np.full((4, 3), float(step))
            checkpoint.save_slices(os.path.join(d, f"s-{step}"), {"w": (rows.split(0, r, n), block)},
                                   extra={"step": step})
        tokens = _stitch(world, os.path.join(d, "s-4"), os.path.join(d, "s-6"), name)
        dest = np.full((4, 3), -1.0)  # only the last rank reads the stitched file: the others hear of it
        with pytest.raises(CheckpointError) as info:
            checkpoint.load_slices(os.path.join(d, "s-6"), {"w": (rows.split(0, r, n), dest)})
        _assert_refused_everywhere(world, str(info.value), name, tokens)
        assert np.all(dest == -1.0)


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}
