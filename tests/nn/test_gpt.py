"""TransformerBlock, GPT and activation checkpointing: gradients, causality, tying, training, devices."""
import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.data import TextCorpus
from axonhpc.errors import BackwardBeforeForwardError, ShapeError, UnsupportedDtypeError
from test_nn_gradcheck import ATOL, RTOL, gradcheck, numeric_grad, randomize_parameters
from support.strict_cupy import DeviceArray, StrictCupy


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def _tiny_gpt(**kw):
    args = dict(vocab_size=7, context=4, width=4, heads=2, layers=2, mlp_ratio=2, dtype=np.float64, seed=5)
    args.update(kw)
    return nn.GPT(**args)


def _loss_and_grads(model, tokens, targets):
    """Cross-entropy over every position; returns the loss and copies of the gradients (in parameter order)."""
    loss_fn = nn.CrossEntropyLoss()
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert model.backward(loss_fn.backward().reshape(logits.shape)) is None
    return loss, [p.grad.copy() for p in model.parameters()]


@pytest.mark.parametrize("causal", [True, False])
def test_transformer_block_gradcheck(rng, causal):
    block = nn.TransformerBlock(6, 2, mlp_ratio=2, causal=causal, dtype=np.float64, seed=1)
    randomize_parameters(block, rng, scale=0.4)
    gradcheck(block, rng.standard_normal((2, 3, 6)), rng)


def test_transformer_block_gradcheck_with_dropout(rng):
    block = nn.TransformerBlock(4, 1, mlp_ratio=2, dropout=0.3, dtype=np.float64, seed=2)
    randomize_parameters(block, rng, scale=0.4)
    dropouts = [m for m in block.modules() if isinstance(m, nn.Dropout)]
    assert len(dropouts) == 2

    def same_masks():
        for i, d in enumerate(dropouts):
            d.manual_seed(10 + i)

    gradcheck(block, rng.standard_normal((2, 3, 4)), rng, before_forward=same_masks)


@pytest.mark.parametrize("tie_weights", [False, True])
def test_gpt_gradcheck(rng, tie_weights):
    model = _tiny_gpt(tie_weights=tie_weights)
    randomize_parameters(model, rng, scale=0.4)
    tokens = np.array([[1, 6, 3, 3], [0, 2, 5, 1]])
    assert gradcheck(model, tokens, rng, check_input=False) is None


def test_gpt_shorter_sequence_and_parameter_names():
    model = _tiny_gpt()
    logits = model(np.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 7) and logits.dtype == np.float64
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"] and names[-1] == "head.weight"
    assert "blocks.1.mlp.2.weight" in names


def test_gpt_rejects_bad_tokens():
    model = _tiny_gpt()
    with pytest.raises(ShapeError, match="context=4"):
        model(np.zeros((2, 5), dtype=np.int64))  # longer than context 4
    with pytest.raises(ShapeError):
        model(np.zeros(4, dtype=np.int64))
    with pytest.raises(UnsupportedDtypeError):
        model(np.zeros((1, 4)))
    with pytest.raises(BackwardBeforeForwardError):
        _tiny_gpt(tie_weights=True).backward(np.zeros((1, 4, 7)))


def test_causal_masking_future_tokens_do_not_change_earlier_logits(rng):
    model = _tiny_gpt(context=6, layers=3)
    randomize_parameters(model, rng, scale=0.5)
    tokens = rng.integers(0, 7, (2, 6))
    base = model(tokens)
    for t in range(6):
        changed = tokens.copy()
        changed[:, t] = (changed[:, t] + 1) % 7
        out = model(changed)
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert not np.allclose(out[:, t:], base[:, t:])


def test_tied_weights_share_one_parameter_and_sum_both_gradients(rng):
    model = _tiny_gpt(tie_weights=True)
    randomize_parameters(model, rng, scale=0.4)
    assert "head" not in dict(model.named_children())
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and names.count("tok_emb.weight") == 1
    tokens, targets = np.array([[1, 6, 3, 3], [0, 2, 5, 1]]), np.array([[6, 3, 3, 0], [2, 5, 1, 4]])
    loss, grads = _loss_and_grads(model, tokens, targets)
    w = model.tok_emb.weight
    loss_fn = nn.CrossEntropyLoss()

    def f():
        logits = model(tokens)
        return loss_fn(logits.reshape(-1, 7), targets.reshape(-1))

    np.testing.assert_allclose(grads[0], numeric_grad(f, w.data), rtol=RTOL, atol=ATOL)
    # Rows never looked up (4) still get a gradient through the head: the tied sum is really there.
    assert np.any(grads[0][4] != 0)
    calls = []
    w.register_grad_hook(lambda p: calls.append(p))
    _loss_and_grads(model, tokens, targets)
    assert len(calls) == 2  # one per use: head, then lookup


def test_checkpointed_blocks_give_bit_identical_loss_and_gradients():
    tokens = np.random.default_rng(0).integers(0, 7, (3, 4))
    targets = np.random.default_rng(1).integers(0, 7, (3, 4))
    plain = _tiny_gpt(dropout=0.25, layers=3)
    wrapped = _tiny_gpt(dropout=0.25, layers=3)
    for i, block in enumerate(list(wrapped.blocks)):
        setattr(wrapped.blocks, str(i), nn.checkpoint(block))
    assert isinstance(wrapped.blocks[0], nn.Checkpoint)
    for step in range(3):  # several steps: the dropout generators advance identically
        loss_a, grads_a = _loss_and_grads(plain, tokens, targets)
        loss_b, grads_b = _loss_and_grads(wrapped, tokens, targets)
        assert loss_a == loss_b
        assert len(grads_a) == len(grads_b)
        for a, b in zip(grads_a, grads_b):
            assert np.array_equal(a, b)
        # Masks really differ from step to step (dropout is on).
        if step == 0:
            first = grads_a
        else:
            assert not all(np.array_equal(a, b) for a, b in zip(first, grads_a))
    drops_a = [m for m in plain.modules() if isinstance(m, nn.Dropout)]
    drops_b = [m for m in wrapped.modules() if isinstance(m, nn.Dropout)]
    assert len(drops_a) == len(drops_b) == 7
    for da, db in zip(drops_a, drops_b):  # recomputation consumed no randomness
        assert da._rng.bit_generator.state == db._rng.bit_generator.state


def test_checkpointed_block_holds_fewer_cached_bytes():
    x = np.random.default_rng(0).standard_normal((4, 16, 8))
    block = nn.TransformerBlock(8, 2, dropout=0.1, dtype=np.float64, seed=0)
    block(x)
    plain_bytes = nn.cached_nbytes(block)
    block.backward(np.ones_like(x))
    wrapped = nn.checkpoint(block)
    wrapped(x)
    kept = nn.cached_nbytes(wrapped)
    assert kept == x.nbytes  # only the input
    assert plain_bytes > 10 * kept
    assert nn.cached_nbytes(block) == 0
    wrapped.backward(np.ones_like(x))
    assert nn.cached_nbytes(wrapped) == 0


def test_checkpoint_backward_without_forward_raises():
    wrapped = nn.checkpoint(nn.Linear(2, 2, seed=0))
    with pytest.raises(BackwardBeforeForwardError):
        wrapped.backward(np.ones((1, 2), dtype=np.float32))


@pytest.mark.parametrize("make_opt", [
    lambda ps: optim.SGD(ps, lr=0.5, momentum=0.9),
    lambda ps: optim.Adam(ps, lr=1e-2),
])
def test_training_on_stdlib_text_reduces_the_loss(make_opt):
    corpus = TextCorpus(max_bytes=200_000, seed=0)
    model = nn.GPT(256, 16, 16, 2, 1, dtype=np.float64, seed=0)
    opt = make_opt(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    batches = corpus.batches("train", 8, 16, seed=0)
    losses = []
    for _ in range(15):
        x, y = next(batches)
        opt.zero_grad()
        logits = model(x)
        losses.append(loss_fn(logits.reshape(-1, 256), y.reshape(-1)))
        model.backward(loss_fn.backward().reshape(logits.shape))
        opt.step()
    assert losses[0] > np.log(256) - 0.5
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses


@pytest.fixture
def fake_cupy(monkeypatch):
    module = StrictCupy()
    monkeypatch.setitem(__import__("sys").modules, "cupy", module)
    return module


@pytest.mark.parametrize("tie_weights", [False, True])
def test_gpt_on_device_stand_in_matches_host(fake_cupy, tie_weights):
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, 11, (2, 5)), rng.integers(0, 11, (2, 5))

    def build():
        model = nn.GPT(11, 6, 8, 2, 2, dropout=0.2, tie_weights=tie_weights, seed=3)
        model.blocks.append(nn.checkpoint(nn.TransformerBlock(8, 2, dropout=0.2, seed=4)))
        return model

    host, device = build(), build().to("cuda")
    assert all(isinstance(p.data, DeviceArray) for p in device.parameters())
    results = []
    for model, put in ((host, np.asarray), (device, fake_cupy.asarray)):
        opt = optim.Adam(model.parameters(), lr=1e-2)
        loss_fn = nn.CrossEntropyLoss()
        run = []
        for _ in range(3):
            opt.zero_grad()
            logits = model(put(tokens))
            run.append(loss_fn(logits.reshape(-1, 11), put(targets).reshape(-1)))
            model.backward(loss_fn.backward().reshape(logits.shape))
            opt.step()
        results.append(run)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    for (name, a), b in zip(host.named_parameters(), device.parameters()):
        assert isinstance(b.grad, DeviceArray), name
        if name.endswith("k_proj.bias"):
            continue  # a gradient of rounding noise that Adam scales up (see test_nn_array_module)
        np.testing.assert_allclose(a.data, b.data.get(), rtol=1e-5, atol=1e-6, err_msg=name)
