"""The pieces of elastic recovery on thread ranks: buddy copies follow their source, the gathered state is whole.

The recovery itself (a real SIGKILL under Open MPI with ULFM) is in test_elastic.py.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import optim
from axonhpc.checkpoint.model_slices import fill_model_state, state_pieces
from axonhpc.elastic import BuddyCopies, Recovery, parse_failures
from axonhpc.elastic.buddy import shard_parameters
from axonhpc.elastic.state import describe_missing, gather_state
from axonhpc.errors import ConfigurationError

GPT = dict(vocab_size=32, context=8, width=16, heads=2, layers=2, dtype=np.float64, seed=3)


def _batch(step, dp, rank):
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, GPT["vocab_size"], size=(12, GPT["context"] + 1))
    share = tokens[rank::dp]
    return share[:, :-1], share[:, 1:]


def _train(model, opt, steps, dp, rank, buddy=None, first=0):
    for step in range(first, first + steps):
        model.zero_grad()
        model.train_step(*_batch(step, dp, rank))
        if buddy is not None:
            buddy.exchange()
        opt.step()
        if buddy is not None:
            buddy.step()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_buddy_copy_equals_its_sources_shards_and_optimizer_state_bit_for_bit(world_size):
    def body(world):
        mesh = world.mesh(dp=world.world_size)
        model = ax.ParallelGPT(mesh, fsdp=True, **GPT)
        opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        _train(model, opt, 2, world.world_size, mesh.coords.dp)  # state exists before the copies are made
        buddy = BuddyCopies(shard_parameters(model), opt, mesh.dp)
        _train(model, opt, 3, world.world_size, mesh.coords.dp, buddy)
        opt.lr = 5e-3  # a schedule's change reaches the copy at its next step
        _train(model, opt, 1, world.world_size, mesh.coords.dp, buddy)
        mine = [p.data.copy() for p in model.parameters()]
        state = [{k: np.array(v) for k, v in s.items()} for s in opt.state]
        theirs = [c.data.copy() for c in buddy.copies]
        copy_state = [{k: np.array(v) for k, v in s.items()} for s in buddy.copy_optimizer.state]
        return buddy.source, mine, state, theirs, copy_state, buddy.nbytes()

    out = ax.run_local(body, world_size=world_size)
    for rank, (source, _, _, theirs, copy_state, nbytes) in enumerate(out):
        assert source == (rank - 1) % world_size
        _, mine, state, _, _, _ = out[source]
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
        for s, c in zip(state, copy_state):
            assert sorted(s) == sorted(c)
            for key in s:
                np.testing.assert_array_equal(s[key], c[key])
        assert nbytes == 3 * sum(a.nbytes for a in mine)  # shards, exp_avg, exp_avg_sq


def _fsdp(world, dp):
    model = ax.ParallelGPT(world.mesh(dp=dp), fsdp=True, **GPT)
    return model, optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_survivors_pieces_and_a_buddy_copy_make_the_whole_state_that_goes_on_on_fewer_ranks(world_size):
    lost, keeper = 1, 2

    def before(world):
        model, opt = _fsdp(world, world.world_size)
        buddy = BuddyCopies(shard_parameters(model), opt, model.dp)
        _train(model, opt, 3, world.world_size, world.rank, buddy)
        pieces, described = state_pieces(model.parameter_boxes(), opt)
        if world.rank == lost:
            pieces = []  # what a dead rank held is gone
        copy = []
        if buddy.source == lost:
            copy = state_pieces(model.parameter_boxes(shard_rank=lost, shards=buddy.copies), buddy.copy_optimizer)[0]
        whole, missing = gather_state(world.default_group, pieces + copy)
        _, gap = gather_state(world.default_group, pieces)  # without the keeper's copy
        return whole, missing, gap, described, world.rank == keeper and bool(copy)

    out = ax.run_local(before, world_size=world_size)
    whole, missing, gap, described, _ = out[0]
    assert out[keeper][4], "the lost rank's keeper offers its copy"
    assert not missing and gap
    assert "elements" in describe_missing(gap)

    def after(world):  # the survivors' count, and one process: one more step from the gathered state
        model, opt = _fsdp(world, world.world_size)
        fill_model_state(model.parameter_boxes(), opt, whole, described)
        again, _ = gather_state(world.default_group, state_pieces(model.parameter_boxes(), opt)[0])
        _train_from(model, opt, 3, 4, world.world_size, world.rank)
        return again, {name: p.data.copy() for name, p in model.named_parameters()} if model.dp.size == 1 else None

    for again, _ in ax.run_local(after, world_size=world_size - 1):
        assert sorted(again) == sorted(whole)
        for key in whole:
            np.testing.assert_array_equal(again[key], whole[key])
    resumed = ax.run_local(after, world_size=1)[0][1]

    def uninterrupted(world):
        model, opt = _fsdp(world, 1)
        _train(model, opt, 4, 1, 0)
        return {name: p.data.copy() for name, p in model.named_parameters()}

    for name, value in ax.run_local(uninterrupted, world_size=1)[0].items():
        np.testing.assert_allclose(resumed[name], value, rtol=1e-10, atol=1e-10)  # parameters of size ~1


def _train_from(model, opt, first, last, dp, rank):
    model.step = first
    for step in range(first, last):
        model.zero_grad()
        model.train_step(*_batch(step, dp, rank))
        opt.step()


def test_buddy_copies_refuse_one_rank_and_device_arrays():
    def body(world):
        model = ax.ParallelGPT(world.mesh(dp=1), fsdp=True, **GPT)
        opt = optim.AdamW(model.parameters())
        with pytest.raises(ConfigurationError, match="at least 2 dp ranks"):
            BuddyCopies(shard_parameters(model), opt, world.default_group)
        assert shard_parameters(ax.ParallelGPT(world.mesh(dp=1), **GPT)) is None  # DDP: no shards

    ax.run_local(body, world_size=1)


def test_simulated_failures_are_read_and_refused_clearly():
    assert parse_failures("2:3") == [(2, 3, "forward")]
    assert parse_failures("1:3:backward, 3:3") == [(1, 3, "backward"), (3, 3, "forward")]
    assert parse_failures(None) == []
    assert parse_failures("3:0:spare") == [(3, 0, "spare")]
    assert parse_failures("1:3,2:3:split") == [(1, 3, "forward"), (2, 3, "split")]
    for bad in ("2", "a:3", "2:3:sideways", "-1:2", "1:2:3:4"):
        with pytest.raises(ConfigurationError, match="RANK:STEPS"):
            parse_failures(bad)
    line = Recovery([2], 4, 3, 3, 0.214).line()
    assert line == "recovered: lost rank 2 at step 4, continuing on 3 ranks (dp=3) in 0.21 s"
    assert Recovery([1, 3], 4, 2, 2, 1.0).line().startswith("recovered: lost ranks 1, 3 at step 4")


def test_elastic_training_needs_fault_tolerance():
    from axonhpc.elastic import ElasticTraining

    with pytest.raises(ConfigurationError, match="fault tolerance"):
        ElasticTraining(lambda world: None)
