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


def train_pair(world, kind, loss_name):
    """Train the TP MLP on this rank and the dense MLP alike; both see the whole batch."""
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
            model.backward(loss_fn.backward())
            opt.step()
        close(losses[0], losses[1], f"loss at step {step}")
    return tp, dense


def case_training_parity_sgd(world):
    tp, dense = train_pair(world, "sgd", "mse")
    check_mlp_shards(tp, dense, world, f"after {STEPS} SGD steps")


def case_training_parity_adam(world):
    tp, dense = train_pair(world, "adam", "cross_entropy")
    check_mlp_shards(tp, dense, world, f"after {STEPS} Adam steps")


def tp_dp_parity(world, kind, loss_name):
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
        ddp.backward(loss_fn.backward())
        opts[0].step()
        ref_loss = nn.MSELoss() if loss_name == "mse" else nn.CrossEntropyLoss()
        opts[1].zero_grad()
        ref_loss(dense(x), y)
        dense.backward(ref_loss.backward())
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


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
