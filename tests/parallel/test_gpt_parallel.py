"""ParallelGPT: every dp x tp x pp layout of 1-4 ranks trains like one process (threads and MPI ranks)."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn
from axonhpc.errors import ConfigurationError, ModelMismatchError
from axonhpc.parallel.gpt import TensorParallelBlock, gpt_part, parameter_boxes, stage_blocks
from support.gpt_parallel_cases import CONFIG, batches, check_layout, layouts, parallel_run
from support.mpi_assert import collectively


@pytest.mark.parametrize("layout", [lay for n in (1, 2, 3, 4) for lay in layouts(n)], ids=str)
def test_every_layout_matches_one_process_on_threads(layout):
    dp, tp, pp = layout
    ax.run_local(lambda world: check_layout(world, dp, tp, pp), world_size=dp * tp * pp)


@pytest.mark.parametrize("layout,options", [
    ((2, 2, 1), dict(fsdp=True)),
    ((4, 1, 1), dict(fsdp=True, microbatches=3)),
    ((1, 1, 2), dict(schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2)),
    ((2, 1, 2), dict(schedule="gpipe", microbatches=3)),
    ((1, 2, 2), dict(checkpoint_activations=True)),
    ((2, 2, 1), dict(fsdp=True, checkpoint_activations=True)),
    ((1, 1, 1), dict(microbatches=4)),
], ids=str)
def test_fsdp_schedules_microbatches_and_activation_checkpointing_match(layout, options):
    dp, tp, pp = layout
    ax.run_local(lambda world: check_layout(world, dp, tp, pp, **options), world_size=dp * tp * pp)


@pytest.mark.mpi(min_size=1)
def test_every_layout_matches_one_process_on_mpi_ranks(mpi_world):
    for dp, tp, pp in layouts(mpi_world.world_size):
        collectively(mpi_world, lambda: check_layout(mpi_world, dp, tp, pp))


@pytest.mark.mpi(min_size=2)
def test_fsdp_with_tensor_parallel_and_checkpointing_on_mpi_ranks(mpi_world):
    n = mpi_world.world_size
    tp = 2 if n % 2 == 0 else 1
    collectively(mpi_world, lambda: check_layout(mpi_world, n // tp, tp, 1, fsdp=True, checkpoint_activations=True))


@pytest.mark.parametrize("layout,options", [
    ((1, 1, 1), dict(microbatches=3)),
    ((2, 2, 1), {}),
    ((2, 1, 2), dict(schedule="gpipe", microbatches=3)),
    ((1, 2, 2), dict(checkpoint_activations=True)),
    ((3, 1, 1), dict(fsdp=True)),
    ((1, 1, 2), dict(schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2)),
], ids=str)
def test_dropout_draws_the_one_process_masks_on_every_layout(layout, options):
    dp, tp, pp = layout
    config = dict(dropout=0.3)
    ax.run_local(lambda world: check_layout(world, dp, tp, pp, config=config, **options), world_size=dp * tp * pp)


def test_dropout_masks_depend_on_the_sample_not_on_the_rank():
    x = batches(1)[0][0]

    def fn(world):
        model = ax.ParallelGPT(world.mesh(dp=2, tp=2), **dict(CONFIG, dropout=0.5))
        nn.key_dropout_by_sample(model.module, 0, 0)  # every rank the same samples, keyed alike
        logits = model.engine(x)
        model.module.stash_activations()
        return logits

    outs = ax.run_local(fn, world_size=4)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    one = nn.GPT(**dict(CONFIG, dropout=0.5))
    nn.key_dropout_by_sample(one, 0, 0)
    np.testing.assert_allclose(one(x), outs[0], rtol=1e-12)
    nn.key_dropout_by_sample(one, 1, 0)
    assert not np.allclose(one(x), outs[0])  # another step: other masks


def test_activation_checkpointing_is_bit_identical_and_holds_less():
    data, held = batches(), batches(1, seed=99)[0]

    def run(checkpointing):
        def fn(world):
            losses, held_loss, model = parallel_run(world, 1, 2, 2, data, held, microbatches=4,
                                                    checkpoint_activations=checkpointing)
            return losses, held_loss, model.peak_activation_bytes, {n: p.data.copy() for n, p in model.named_parameters()}
        return ax.run_local(fn, world_size=4)

    plain, ckpt = run(False), run(True)
    for (l0, h0, b0, p0), (l1, h1, b1, p1) in zip(plain, ckpt):
        assert l0 == l1 and h0 == h1
        assert all(np.array_equal(p0[n], p1[n]) for n in p0)
        assert 0 < b1 < b0 / 3, (b0, b1)


def test_stage_blocks_split_evenly_and_refuse_empty_stages():
    assert stage_blocks(4, 1) == [(0, 4)]
    assert stage_blocks(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert stage_blocks(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigurationError, match="3 blocks cannot be split into 4 pipeline stages"):
        stage_blocks(3, 4)


def test_the_parts_of_one_seed_are_the_whole_model():
    whole = dict(nn.GPT(**CONFIG).named_parameters())
    seen = {}
    for s in range(3):
        part = gpt_part(**CONFIG, stage=s, num_stages=3)
        for name, (dense, shape, offset) in parameter_boxes(part).items():
            assert dense == name and offset == (0,) * len(shape)
            seen[name] = dict(part.named_parameters())[name].data
    assert sorted(seen) == sorted(whole)
    assert all(np.array_equal(seen[n], whole[n].data) for n in whole)


def test_a_part_without_embedding_takes_and_returns_activations():
    first = gpt_part(**CONFIG, stage=0, num_stages=2)
    last = gpt_part(**CONFIG, stage=1, num_stages=2)
    whole = nn.GPT(**CONFIG)
    x = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, CONFIG["context"]))
    h = first(x)
    assert h.shape == (2, CONFIG["context"], CONFIG["width"])
    np.testing.assert_array_equal(last(h), whole(x))
    g = np.ones((2, CONFIG["context"], CONFIG["vocab_size"]))
    dh = last.backward(g)
    assert dh.shape == h.shape and first.backward(dh) is None
    whole.backward(g)
    grads = dict(whole.named_parameters())
    for part in (first, last):
        for name, p in part.named_parameters():
            np.testing.assert_array_equal(p.grad, grads[name].grad)


def test_tied_weights_need_both_ends_in_one_part():
    with pytest.raises(ConfigurationError, match="tie_weights needs the embedding and the head in the same part"):
        gpt_part(**dict(CONFIG, tie_weights=True), stage=0, num_stages=2)


def test_a_seed_is_required_and_fsdp_inside_a_pipeline_is_refused():
    with pytest.raises(ConfigurationError, match="needs a seed"):
        gpt_part(**dict(CONFIG, seed=None))

    def fsdp_in_pipeline(world):
        with pytest.raises(ConfigurationError, match=r"fsdp=True inside pipeline stages \(pp=2"):
            ax.ParallelGPT(world.mesh(pp=2), **CONFIG, fsdp=True)

    ax.run_local(fsdp_in_pipeline, world_size=2)


def test_tensor_parallel_block_is_the_dense_block_split():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 24))
    g = rng.standard_normal((2, 5, 24))
    dense = nn.TransformerBlock(24, 6, mlp_ratio=2, dtype=np.float64, seed=4)
    want_y = dense(x)
    want_dx = dense.backward(g)
    grads = dict(dense.named_parameters())

    def fn(world):
        block = TensorParallelBlock(24, 6, group=world.default_group, mlp_ratio=2, dtype=np.float64, seed=4)
        np.testing.assert_allclose(block(x), want_y, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(block.backward(g), want_dx, rtol=1e-12, atol=1e-13)
        params = dict(block.named_parameters())
        for name, (dense_name, shape, offset) in parameter_boxes(block).items():
            index = tuple(slice(o, o + k) for o, k in zip(offset, params[name].data.shape))
            assert grads[dense_name].data.shape == shape
            np.testing.assert_array_equal(params[name].data, grads[dense_name].data[index])
            np.testing.assert_allclose(params[name].grad, grads[dense_name].grad[index], rtol=1e-11, atol=1e-13)

    ax.run_local(fn, world_size=3)


def test_tensor_parallel_blocks_that_differ_are_refused_on_every_rank():
    def fn(world):
        with pytest.raises(ModelMismatchError, match="TensorParallelBlock"):
            TensorParallelBlock(24, 6, group=world.default_group, mlp_ratio=2 + world.rank, seed=1)

    ax.run_local(fn, world_size=2)


def test_tensor_parallel_block_refuses_heads_the_group_does_not_divide():
    def fn(world):
        with pytest.raises(ConfigurationError, match="heads=6 must be a non-negative multiple of the tensor-parallel "
                                                     "group size 4"):
            TensorParallelBlock(24, 6, group=world.default_group, seed=1)

    ax.run_local(fn, world_size=4)
