"""Tensor-parallel cases, written once, run on threads (plain pytest) and on MPI ranks.

Every case builds a tensor-parallel layer over the world's group and the dense
single-process layer from the same seed, feeds both the same data, and checks
that outputs, input gradients and each rank's weight/bias gradients equal the
matching slices of the dense layer's (float64, 1e-12). Feature sizes are
multiples of 12 so that every world size from 1 to 4 divides them.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import ConfigurationError, NotAMemberError

HIDDEN = 12
FFN = 24
BATCH = 8  # divisible by the dp size 2 of the TP x DP case
STEPS = 5
TOL = 1e-12


def close(actual, expected, what, tol=TOL):
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)


def block(n, rank, size):
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def data(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def case_column_parallel_matches_dense(world):
    r, p = world.rank, world.world_size
    for gather_output in (False, True):
        dense = nn.Linear(HIDDEN, FFN, dtype=np.float64, seed=11)
        tp = ax.ColumnParallelLinear(HIDDEN, FFN, gather_output=gather_output, dtype=np.float64, seed=11)
        rows = block(FFN, r, p)
        assert tp.weight.shape == (FFN // p, HIDDEN) and tp.bias.shape == (FFN // p,)
        # Shards are exact slices of the same full draw, not merely close.
        np.testing.assert_array_equal(tp.weight.data, dense.weight.data[rows])
        np.testing.assert_array_equal(tp.bias.data, dense.bias.data[rows])
        x = data((2, 3, HIDDEN), 1)  # a leading batch of two axes
        g = data((2, 3, FFN), 2)
        y_dense = dense(x)
        gx_dense = dense.backward(g)
        y = tp(x)
        gx = tp.backward(g if gather_output else g[..., rows])
        close(y, y_dense if gather_output else y_dense[..., rows], f"output, gather_output={gather_output}")
        close(gx, gx_dense, f"input gradient, gather_output={gather_output}")
        close(tp.weight.grad, dense.weight.grad[rows], "weight gradient")
        close(tp.bias.grad, dense.bias.grad[rows], "bias gradient")


def case_row_parallel_matches_dense(world):
    r, p = world.rank, world.world_size
    for input_is_parallel in (True, False):
        dense = nn.Linear(FFN, HIDDEN, dtype=np.float64, seed=12)
        tp = ax.RowParallelLinear(FFN, HIDDEN, input_is_parallel=input_is_parallel, dtype=np.float64, seed=12)
        cols = block(FFN, r, p)
        assert tp.weight.shape == (HIDDEN, FFN // p) and tp.bias.shape == (HIDDEN,)
        np.testing.assert_array_equal(tp.weight.data, dense.weight.data[:, cols])
        np.testing.assert_array_equal(tp.bias.data, dense.bias.data)
        x = data((2, 3, FFN), 3)
        g = data((2, 3, HIDDEN), 4)
        y_dense = dense(x)
        gx_dense = dense.backward(g)
        y = tp(x[..., cols] if input_is_parallel else x)
        gx = tp.backward(g)
        close(y, y_dense, f"output, input_is_parallel={input_is_parallel}")
        close(gx, gx_dense[..., cols] if input_is_parallel else gx_dense,
              f"input gradient, input_is_parallel={input_is_parallel}")
        close(tp.weight.grad, dense.weight.grad[:, cols], "weight gradient")
        close(tp.bias.grad, dense.bias.grad, "bias gradient")


def check_mlp_shards(tp, dense, world, what, tol=TOL, grads=False):
    """Each rank's fc1/fc2 shard (or its gradient) equals the slice of the dense MLP's."""
    r, p = world.rank, world.world_size
    rows = block(FFN, r, p)
    attr = "grad" if grads else "data"
    close(getattr(tp.fc1.weight, attr), getattr(dense[0].weight, attr)[rows], f"{what}: fc1.weight", tol)
    close(getattr(tp.fc1.bias, attr), getattr(dense[0].bias, attr)[rows], f"{what}: fc1.bias", tol)
    close(getattr(tp.fc2.weight, attr), getattr(dense[2].weight, attr)[:, rows], f"{what}: fc2.weight", tol)
    close(getattr(tp.fc2.bias, attr), getattr(dense[2].bias, attr), f"{what}: fc2.bias", tol)


def case_mlp_matches_dense(world):
    tp = ax.TensorParallelMLP(HIDDEN, FFN, dtype=np.float64, seed=5)
    dense = ax.TensorParallelMLP.dense_equivalent(HIDDEN, FFN, dtype=np.float64, seed=5)
    assert [n for n, _ in tp.named_parameters()] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    check_mlp_shards(tp, dense, world, "initial values", tol=0)
    x = data((BATCH, HIDDEN), 6)
    g = data((BATCH, HIDDEN), 7)
    close(tp(x), dense(x), "MLP output")
    close(tp.backward(g), dense.backward(g), "MLP input gradient")
    check_mlp_shards(tp, dense, world, "gradients", grads=True)


def make_optimizer(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return optim.Adam(params, lr=1e-2)


def batch(step):
    rng = np.random.default_rng(200 + step)
    x = rng.standard_normal((BATCH, HIDDEN))
    return x, rng.standard_normal((BATCH, HIDDEN)), rng.integers(0, HIDDEN, BATCH)


def train_pair(world, kind, loss_name, input_grad=True, clip=None):
    """Train the TP MLP on this rank and the dense MLP alike; both see the whole batch.

    ``input_grad=False``: both backwards skip d loss / d x (fc1's product, and its all-reduce in TP).
    ``clip=(max_norm, norm_type)``: ``ax.clip_grad_norm`` on the TP MLP, ``optim.clip_grad_norm`` on the dense
    one, before each step; the norms must agree."""
    tp = ax.TensorParallelMLP(HIDDEN, FFN, dtype=np.float64, seed=21)
    dense = ax.TensorParallelMLP.dense_equivalent(HIDDEN, FFN, dtype=np.float64, seed=21)
    opts = [make_optimizer(kind, m.parameters()) for m in (tp, dense)]
    for step in range(STEPS):
        x, target, labels = batch(step)
        losses = []
        for model, opt in zip((tp, dense), opts):
            loss_fn = nn.MSELoss() if loss_name == "mse" else nn.CrossEntropyLoss()
            opt.zero_grad()
            losses.append(loss_fn(model(x), target if loss_name == "mse" else labels))
            grad_in = model.backward(loss_fn.backward(), input_grad=input_grad)
            assert (grad_in is None) == (not input_grad)
            if clip is not None:
                norm = (ax.clip_grad_norm(model, *clip) if model is tp
                        else optim.clip_grad_norm(model.parameters(), *clip))
                losses.append(norm)
            opt.step()
        if clip is None:
            close(losses[0], losses[1], f"loss at step {step}")
        else:  # [loss, norm] of the TP model, then of the dense one
            close(losses[0], losses[2], f"loss at step {step}")
            assert losses[3] > clip[0], "the step must clip"
            close(losses[1], losses[3], f"gradient norm at step {step}")
    return tp, dense


def case_training_parity_sgd(world):
    tp, dense = train_pair(world, "sgd", "mse")
    check_mlp_shards(tp, dense, world, f"after {STEPS} SGD steps")


def case_training_parity_adam(world):
    tp, dense = train_pair(world, "adam", "cross_entropy", input_grad=False)
    check_mlp_shards(tp, dense, world, f"after {STEPS} Adam steps")


def case_clip_grad_norm_counts_each_element_once(world):
    # Each rank's shards of fc1 and fc2.weight, and the replicated fc2.bias once: the dense model's norm
    # (2, 1 and inf), and after clipping the same parameters.
    for clip in ((0.05, 2.0), (0.2, 1.0), (0.01, float("inf"))):
        tp, dense = train_pair(world, "sgd", "mse", clip=clip)
        check_mlp_shards(tp, dense, world, f"after {STEPS} clipped SGD steps {clip}")


def tp_dp_parity(world, kind, loss_name, clip=None):
    mesh = world.mesh(dp=2, tp=2)
    dp_rank = mesh.coords.dp
    # Replica 1 starts from other values on purpose: DDP's sync_parameters must
    # copy the shard of dp rank 0 that has the same tp coordinate. The seed is
    # still shared inside each tp group, as the replicated fc2 bias requires.
    tp = ax.TensorParallelMLP(HIDDEN, FFN, group=mesh.tp, dtype=np.float64, seed=31 if dp_rank == 0 else 77)
    ddp = ax.DDP(tp, group=mesh.dp)
    dense = ax.TensorParallelMLP.dense_equivalent(HIDDEN, FFN, dtype=np.float64, seed=31)
    opts = [make_optimizer(kind, ddp.parameters()), make_optimizer(kind, dense.parameters())]
    rows = block(BATCH, dp_rank, 2)
    for step in range(STEPS):
        x, target, labels = batch(step)
        y = target if loss_name == "mse" else labels
        loss_fn = nn.MSELoss() if loss_name == "mse" else nn.CrossEntropyLoss()
        opts[0].zero_grad()
        loss_fn(ddp(x[rows]), y[rows])
        ddp.backward(loss_fn.backward(), input_grad=kind == "sgd")  # adam: without fc1's input gradient
        norm = None if clip is None else ax.clip_grad_norm(ddp, *clip)
        opts[0].step()
        ref_loss = nn.MSELoss() if loss_name == "mse" else nn.CrossEntropyLoss()
        opts[1].zero_grad()
        ref_loss(dense(x), y)
        dense.backward(ref_loss.backward())
        if clip is not None:
            close(norm, optim.clip_grad_norm(dense.parameters(), *clip), f"gradient norm at step {step}")
        opts[1].step()
    rows_ffn = block(FFN, mesh.coords.tp, 2)
    close(tp.fc1.weight.data, dense[0].weight.data[rows_ffn], "fc1.weight")
    close(tp.fc1.bias.data, dense[0].bias.data[rows_ffn], "fc1.bias")
    close(tp.fc2.weight.data, dense[2].weight.data[:, rows_ffn], "fc2.weight")
    close(tp.fc2.bias.data, dense[2].bias.data, "fc2.bias")


def case_tp_x_dp_sgd_mse(world):
    if world.world_size != 4:  # the mesh is dp=2 x tp=2
        return
    tp_dp_parity(world, "sgd", "mse")


def case_tp_x_dp_adam_cross_entropy(world):
    if world.world_size != 4:
        return
    tp_dp_parity(world, "adam", "cross_entropy")


def case_tp_x_dp_clipped(world):
    if world.world_size != 4:
        return
    tp_dp_parity(world, "sgd", "mse", clip=(0.05, 2.0))


def case_seed_none_agrees_across_the_group(world):
    # Without a seed, group rank 0's entropy is broadcast, so the replicated
    # bias (and the full weight the shards come from) is the same on every rank.
    first = ax.RowParallelLinear(FFN, HIDDEN, dtype=np.float64)
    second = ax.RowParallelLinear(FFN, HIDDEN, dtype=np.float64)
    for row in (first, second):
        biases = ax.all_gather(row.bias.data)
        for k in range(world.world_size):
            np.testing.assert_array_equal(biases[k], biases[0])
    assert not np.array_equal(first.bias.data, second.bias.data)  # fresh entropy each time


def case_divisibility_errors(world):
    p = world.world_size
    if p == 1:  # every size divides among one rank
        assert ax.ColumnParallelLinear(HIDDEN, 13, seed=0).weight.shape == (13, HIDDEN)
        assert ax.RowParallelLinear(13, HIDDEN, seed=0).weight.shape == (HIDDEN, 13)
        return
    # 13 is indivisible by 2, 3 and 4; the error comes before any communication
    # (seed=None would broadcast), so every rank raises on its own.
    with pytest.raises(ConfigurationError, match=rf"out_features=13 must be .* group size {p} \(13 % {p} = 1\)"):
        ax.ColumnParallelLinear(HIDDEN, 13)
    with pytest.raises(ConfigurationError, match=rf"in_features=13 must be .* group size {p} \(13 % {p} = 1\)"):
        ax.RowParallelLinear(13, HIDDEN)
    with pytest.raises(ConfigurationError, match=rf"ffn_hidden=13 must be .* group size {p}"):
        ax.TensorParallelMLP(HIDDEN, 13)
    sub = world.new_group([0])
    if world.rank != 0:
        with pytest.raises(NotAMemberError, match="ColumnParallelLinear"):
            ax.ColumnParallelLinear(HIDDEN, FFN, group=sub, seed=0)
    else:
        assert ax.ColumnParallelLinear(HIDDEN, FFN, group=sub, seed=0).weight.shape == (FFN, HIDDEN)


# Attention: 12 heads, so every world size from 1 to 4 divides them; head_dim 2.
EMBED = 24
HEADS = 12
ATTN_STEPS = 3
ATTN_PARAMS = ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
               "out_proj.weight", "out_proj.bias"]


def attention_slice(name, rank, size):
    """The index of rank's shard in the dense attention's parameter ``name``."""
    features = block(EMBED, rank, size)  # heads [r*H/P, (r+1)*H/P) are features [r*E/P, (r+1)*E/P)
    if name == "out_proj.weight":
        return (slice(None), features)
    if name == "out_proj.bias":
        return (slice(None),)
    return (features,)


def check_attention_shards(tp, dense, world, what, tol=TOL, grads=False, skip=()):
    """Each rank's q/k/v/out shard (or its gradient) equals the slice of the dense attention's."""
    attr = "grad" if grads else "data"
    dense_params = dict(dense.named_parameters())
    tp_params = dict(tp.named_parameters())
    assert list(tp_params) == list(dense_params) == ATTN_PARAMS
    for name in ATTN_PARAMS:
        if name in skip:
            continue
        expected = getattr(dense_params[name], attr)[attention_slice(name, world.rank, world.world_size)]
        actual = getattr(tp_params[name], attr)
        if tol == 0:
            np.testing.assert_array_equal(actual, expected, err_msg=f"{what}: {name}")
        else:
            close(actual, expected, f"{what}: {name}", tol)


def randomise_biases(tp, dense, world, seed):
    """Give the (zero-initialised) biases the same non-zero values, so their use is tested too."""
    for name, param in dense.named_parameters():
        if name.endswith("bias"):
            param.data[...] = data(param.shape, seed)
            seed += 1
    dense_params = dict(dense.named_parameters())
    for name, param in tp.named_parameters():
        if name.endswith("bias"):
            param.data[...] = dense_params[name].data[attention_slice(name, world.rank, world.world_size)]


def case_attention_matches_dense(world):
    p = world.world_size
    for causal in (False, True):
        tp = ax.TensorParallelAttention(EMBED, HEADS, causal=causal, dtype=np.float64, seed=41)
        dense = nn.MultiHeadAttention(EMBED, HEADS, causal=causal, dtype=np.float64, seed=41)
        assert tp.num_heads_per_rank == HEADS // p and tp.q_proj.weight.shape == (EMBED // p, EMBED)
        assert tp.out_proj.weight.shape == (EMBED, EMBED // p)
        # Shards are exact slices of the dense layer's draw, not merely close.
        check_attention_shards(tp, dense, world, f"initial values, causal={causal}", tol=0)
        randomise_biases(tp, dense, world, 50)
        x = data((2, 5, EMBED), 42)
        g = data((2, 5, EMBED), 43)
        y_dense = dense(x)
        gx_dense = dense.backward(g)
        close(tp(x), y_dense, f"attention output, causal={causal}")
        close(tp.backward(g), gx_dense, f"attention input gradient, causal={causal}")
        check_attention_shards(tp, dense, world, f"gradients, causal={causal}", grads=True)


def case_attention_training_parity_adam(world):
    tp = ax.TensorParallelAttention(EMBED, HEADS, causal=True, dtype=np.float64, seed=44)
    dense = ax.TensorParallelAttention.dense_equivalent(EMBED, HEADS, causal=True, dtype=np.float64, seed=44)
    opts = [optim.Adam(m.parameters(), lr=1e-2) for m in (tp, dense)]
    for step in range(ATTN_STEPS):
        rng = np.random.default_rng(300 + step)
        x, target = rng.standard_normal((3, 4, EMBED)), rng.standard_normal((3, 4, EMBED))
        losses = []
        for model, opt in zip((tp, dense), opts):
            loss_fn = nn.MSELoss()
            opt.zero_grad()
            losses.append(loss_fn(model(x), target))
            model.backward(loss_fn.backward())
            opt.step()
        close(losses[0], losses[1], f"attention loss at step {step}")
    # The key bias's gradient is exactly zero (softmax ignores a shift shared by all keys), so
    # both copies hold Adam-amplified round-off near 0 that need not agree to 1e-12.
    check_attention_shards(tp, dense, world, f"after {ATTN_STEPS} Adam steps", skip=("k_proj.bias",))
    assert np.abs(tp.k_proj.bias.data).max() < 1e-9 and np.abs(dense.k_proj.bias.data).max() < 1e-9


def case_attention_seed_none_agrees_across_the_group(world):
    # Without a seed the shards still come from one full draw: gathered, they form
    # q weights and an out_proj weight that every rank agrees on.
    tp = ax.TensorParallelAttention(EMBED, HEADS, dtype=np.float64)
    q_full = np.concatenate(list(ax.all_gather(tp.q_proj.weight.data)), axis=0)
    fulls = ax.all_gather(q_full)
    for k in range(world.world_size):
        np.testing.assert_array_equal(fulls[k], fulls[0])
    assert len(np.unique(q_full.round(12))) == q_full.size  # no rank's shard repeats another's


def case_attention_divisibility_errors(world):
    p = world.world_size
    with pytest.raises(ConfigurationError, match=r"num_heads dividing embed_dim.*embed_dim=24, num_heads=5"):
        ax.TensorParallelAttention(EMBED, 5, seed=0)
    if p == 1:
        assert ax.TensorParallelAttention(26, 13, seed=0).num_heads_per_rank == 13
        return
    # 13 heads are indivisible by 2, 3 and 4; raised before any communication.
    with pytest.raises(ConfigurationError, match=rf"num_heads=13 must be .* group size {p} \(13 % {p} = 1\)"):
        ax.TensorParallelAttention(26, 13)


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
