"""A GPT on every dp x tp x pp layout against one process: the cases, as functions of a World.

Threads (tests/parallel/test_gpt_parallel.py) and mpiexec ranks run the same functions.
The model is tiny and float64, so parity is checked to 1e-10 relative.
"""
import numpy as np

import axonhpc as ax
from axonhpc import nn, optim

# heads = 12 and 4 * width = 96 are divisible by every tp size 1..4; 4 blocks allow up to 4 stages.
CONFIG = dict(vocab_size=11, context=6, width=24, heads=12, layers=4, mlp_ratio=4, dtype=np.float64, seed=7)
GLOBAL_BATCH = 12  # divisible by dp * microbatches for dp in 1..4 and microbatches in 1..3
STEPS = 3
LR = 1e-2
RTOL = 1e-10


def layouts(n):
    """Every (dp, tp, pp) with dp * tp * pp == n."""
    return [(d, t, n // (d * t)) for d in range(1, n + 1) for t in range(1, n + 1)
            if n % (d * t) == 0]


def batches(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    v, t = CONFIG["vocab_size"], CONFIG["context"]
    return [(rng.integers(0, v, (GLOBAL_BATCH, t)), rng.integers(0, v, (GLOBAL_BATCH, t))) for _ in range(steps)]


def reference(data, eval_batch, **config):
    """One process, nn.GPT: the loss of every step, then the loss of ``eval_batch`` after the last update."""
    model = nn.GPT(**dict(CONFIG, **config))
    opt = optim.AdamW(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        nn.key_dropout_by_sample(model, step)  # as ParallelGPT keys its parts
        losses.append(loss_fn(model(x), y))
        model.backward(loss_fn.backward())
        opt.step()
    model.eval()
    held = loss_fn(model(eval_batch[0]), eval_batch[1])
    return losses, held, dict(model.named_parameters())


def parallel_run(world, dp, tp, pp, data, eval_batch, microbatches=None, config=None, **options):
    """The same training on a mesh of ``world``: (losses, held-out loss, model), every rank."""
    mesh = world.mesh(dp=dp, tp=tp, pp=pp)
    b = GLOBAL_BATCH // dp
    m = microbatches or next(k for k in (2 * pp, pp, 1) if b % k == 0)
    model = ax.ParallelGPT(mesh, **dict(CONFIG, **(config or {})), num_microbatches=m, **options)
    opt = optim.AdamW(model.parameters(), lr=LR)
    d = mesh.coords.dp
    losses = []
    for x, y in data:
        model.zero_grad()
        losses.append(model.train_step(x[d * b:(d + 1) * b], y[d * b:(d + 1) * b]))
        opt.step()
    model.eval()
    held = model.loss(eval_batch[0][d * b:(d + 1) * b], eval_batch[1][d * b:(d + 1) * b])
    return losses, held, model


def relative_error(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want) / np.abs(want)))


def slices_match(model, dense_params, atol=1e-9):
    """Every local parameter equals its slice of the one-process model's (after training): the worst difference."""
    worst = 0.0
    for name, entry in model.parameter_boxes().items():
        shape, offset, p = entry[:3]
        full = dense_params[name].data
        assert full.shape == shape, (name, full.shape, shape)
        if len(entry) == 4:  # FSDP: a range of the flattened block sits in the flat shard
            local_shape, start, stop, at = entry[3]
            block = full[tuple(slice(o, o + k) for o, k in zip(offset, local_shape))]
            got, want = p.data[at:at + stop - start], block.ravel()[start:stop]
        else:
            got, want = p.data, full[tuple(slice(o, o + k) for o, k in zip(offset, p.data.shape))]
        worst = max(worst, float(np.max(np.abs(want - got))))
    assert worst < atol, worst
    return worst


def check_layout(world, dp, tp, pp, config=None, **options):
    """Losses, held-out loss and parameters of one layout against the one-process run."""
    data = batches()
    eval_batch = batches(1, seed=99)[0]
    ref_losses, ref_held, ref_params = reference(data, eval_batch, **(config or {}))
    losses, held, model = parallel_run(world, dp, tp, pp, data, eval_batch, config=config, **options)
    assert relative_error(losses, ref_losses) < RTOL, (dp, tp, pp, losses, ref_losses)
    assert relative_error([held], [ref_held]) < RTOL, (dp, tp, pp, held, ref_held)
    slices_match(model, ref_params)
    return losses
