"""Sharded FSDP checkpoints: save on N ranks, load on M (M = 1 .. N), train on, equal an uninterrupted run."""
import os
import shutil
import tempfile

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import checkpoint, nn
from support.ddp_cases import make_data, make_model, make_optimizer, shard, train_reference
from support.mpi_assert import collectively

SAVED_AT, TOTAL = 3, 6


def _train(fsdp, opt, group, start, stop):
    n, r = group.size, group.rank
    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, stop):
        opt.zero_grad()
        x, y = make_data(step)
        loss_fn(fsdp(shard(x, r, n)), shard(y, r, n))
        fsdp.backward(loss_fn.backward())
        opt.step()


def _save(path, group, strategy="full_shard"):
    fsdp = ax.FSDP(make_model(), group=group, sharding_strategy=strategy)
    opt = make_optimizer("adam", fsdp.parameters())
    _train(fsdp, opt, group, 0, SAVED_AT)
    checkpoint.save_sharded(path, fsdp, opt, extra={"step": SAVED_AT})
    return fsdp


def _resume(path, group, strategy="full_shard"):
    fsdp = ax.FSDP(make_model(seed=77), group=group, sharding_strategy=strategy)  # other values on purpose
    opt = make_optimizer("adam", fsdp.parameters())
    extra = checkpoint.load_sharded(path, fsdp, opt)
    assert extra == {"step": SAVED_AT}
    _train(fsdp, opt, group, extra["step"], TOTAL)
    full = fsdp.full_state_dict(rank0_only=False)
    for name, value in train_reference(np.float64, "adam", steps=TOTAL).state_dict().items():
        np.testing.assert_allclose(full[name], value, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("load_size", [1, 2, 3, 4])
def test_save_on_four_threads_load_on_m(tmp_path, load_size):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: _save(path, world.default_group), world_size=4)
    names = sorted(os.listdir(path))
    assert names == ["index.npz"] + [f"shard-{k:05d}-of-00004.npz" for k in range(4)]
    ax.run_local(lambda world: _resume(path, world.default_group), world_size=load_size)


def test_strategy_may_change_between_save_and_load(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: _save(path, world.default_group, "shard_grad_op"), world_size=3)
    ax.run_local(lambda world: _resume(path, world.default_group, "no_shard"), world_size=2)
    ax.run_local(lambda world: _resume(path, world.default_group, "hybrid_shard"), world_size=4)


def test_saving_again_replaces_the_directory_and_leaves_no_temporaries(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: _save(path, world.default_group), world_size=2)
    ax.run_local(lambda world: _save(path, world.default_group), world_size=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert "shard-00002-of-00003.npz" in os.listdir(path) and len(os.listdir(path)) == 4


def test_a_missing_shard_is_reported_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: _save(path, world.default_group), world_size=2)
    os.remove(os.path.join(path, "shard-00001-of-00002.npz"))

    def resume(world):
        fsdp = ax.FSDP(make_model(seed=77), group=world.default_group)
        opt = make_optimizer("adam", fsdp.parameters())
        before = [p.data.copy() for p in fsdp.parameters()]
        with pytest.raises(ax.errors.CheckpointError, match="no such file|failed on group ranks"):
            checkpoint.load_sharded(path, fsdp, opt)
        for p, q in zip(fsdp.parameters(), before):  # no rank changed anything, not even the one that could read
            np.testing.assert_array_equal(p.data, q)

    ax.run_local(resume, world_size=2)


def test_a_different_model_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: _save(path, world.default_group), world_size=2)
    other = ax.FSDP(nn.Sequential(nn.Linear(6, 3, dtype=np.float64)), group=ax.ProcessGroup.mock())
    with pytest.raises(ax.errors.CheckpointError, match=r"FSDP unit '0' holds 112 elements in the checkpoint, 21 in this model; parameters that differ: 0.weight: \(16, 6\) saved, \(3, 6\) here; 0.bias: \(16,\) saved, \(3,\) here"):
        checkpoint.load_sharded(path, other)


def test_a_model_with_another_unit_plan_or_an_older_index_is_named_by_its_parameters(tmp_path):
    from axonhpc.checkpoint.sharded import _unit_mismatch

    path = str(tmp_path / "ckpt")
    ax.run_local(lambda world: _save(path, world.default_group), world_size=2)
    model = make_model()
    other = ax.FSDP(model, group=ax.ProcessGroup.mock(), units=[model[0]])  # units '0' and the root
    with pytest.raises(ax.errors.CheckpointError, match=r"holds no FSDP unit '<root>' \(this model's holds 2.weight \(8, 16\)"):
        checkpoint.load_sharded(path, other)
    # An index written before the shapes were recorded: the unit's counts and this model's parameters.
    unit = other.units[0]
    text = _unit_mismatch("ck", {"units": {"0": 7}}, unit, 7)
    assert text == (f"'ck': FSDP unit '0' holds 7 elements in the checkpoint, {unit.numel} in this model "
                    f"(0.weight {unit.flat.layout.shapes[0]}, 0.bias {unit.flat.layout.shapes[1]}): a checkpoint "
                    f"of another model"), text


@pytest.mark.mpi(min_size=1)
def test_save_on_all_ranks_load_on_each_smaller_group(mpi_world):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    directory = comm.bcast(tempfile.mkdtemp(prefix="axonhpc-fsdp-ckpt-") if comm.rank == 0 else None, root=0)
    path = os.path.join(directory, "ckpt")
    try:
        collectively(mpi_world, lambda: _save(path, mpi_world.default_group))
        for m in range(1, mpi_world.world_size + 1):
            group = mpi_world.new_group(list(range(m)))

            def check():
                if group.is_member:
                    _resume(path, group)

            collectively(mpi_world, check)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
