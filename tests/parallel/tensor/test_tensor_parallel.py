"""Tensor parallelism equals the dense layers: threads as ranks (1-4) and MPI ranks."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn
from axonhpc.errors import ConfigurationError, ShapeError
from axonhpc.parallel.tensor import partition_range
from support.runner import case_tests
from support.tp_cases import CASES, FFN, HIDDEN


test_tp_case_local, test_tp_case_mpi = case_tests(CASES)


def test_partition_range():
    assert [partition_range(12, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert partition_range(0, 1, 2) == (0, 0)
    with pytest.raises(ConfigurationError, match=r"features=10 must be .* group size 4 \(10 % 4 = 2\)"):
        partition_range(10, 0, 4)
    with pytest.raises(ConfigurationError, match="rank 4 is not in a group of size 4"):
        partition_range(12, 4, 4)


@pytest.mark.parametrize("layer", ["column", "row"])
def test_init_makes_the_same_generator_calls_as_linear(layer):
    # Same Generator in, same values out, and the Generator left in the same
    # state: the draws are the same calls in the same order.
    g_dense, g_tp = np.random.default_rng(9), np.random.default_rng(9)
    dense = nn.Linear(HIDDEN, FFN, seed=g_dense)
    cls = ax.ColumnParallelLinear if layer == "column" else ax.RowParallelLinear
    tp = cls(HIDDEN, FFN, group=ax.ProcessGroup.mock(), seed=g_tp)
    assert tp.weight.dtype == np.float32 and tp.bias.dtype == np.float32
    np.testing.assert_array_equal(tp.weight.data, dense.weight.data)
    np.testing.assert_array_equal(tp.bias.data, dense.bias.data)
    assert g_dense.random() == g_tp.random()


def test_without_bias():
    group = ax.ProcessGroup.mock()
    col = ax.ColumnParallelLinear(HIDDEN, FFN, group=group, bias=False, dtype=np.float64, seed=3)
    row = ax.RowParallelLinear(FFN, HIDDEN, group=group, bias=False, dtype=np.float64, seed=4)
    assert col.bias is None and [n for n, _ in row.named_parameters()] == ["weight"]
    dense = nn.Linear(HIDDEN, FFN, bias=False, dtype=np.float64, seed=3)
    np.testing.assert_array_equal(col.weight.data, dense.weight.data)
    x = np.random.default_rng(0).standard_normal((4, HIDDEN))
    np.testing.assert_allclose(row(col(x)), row(dense(x)), rtol=1e-14)


def test_wrong_input_width():
    group = ax.ProcessGroup.mock()
    col = ax.ColumnParallelLinear(HIDDEN, FFN, group=group, seed=0)
    with pytest.raises(ShapeError, match=rf"got input of shape \(2, 5\); the last axis must be {HIDDEN}"):
        col(np.zeros((2, 5), dtype=np.float32))
    row = ax.RowParallelLinear(FFN, HIDDEN, group=group, seed=0)
    with pytest.raises(ShapeError, match=rf"the last axis must be {FFN}"):
        row(np.zeros((2, 5), dtype=np.float32))


def test_float32_mlp_matches_dense():
    def case(world):
        tp = ax.TensorParallelMLP(HIDDEN, FFN, seed=1)
        dense = ax.TensorParallelMLP.dense_equivalent(HIDDEN, FFN, seed=1)
        x = np.random.default_rng(2).standard_normal((5, HIDDEN)).astype(np.float32)
        y = tp(x)
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, dense(x), rtol=1e-5, atol=1e-6)
        g = np.ones_like(y)
        np.testing.assert_allclose(tp.backward(g), dense.backward(g), rtol=1e-5, atol=1e-6)

    ax.run_local(case, world_size=2)


@pytest.mark.parametrize("layer", ["mlp", "attention"])
def test_autocast_float16_matches_dense_under_autocast(layer):
    """Under nn.autocast the column and row layers compute in float16 like nn.Linear, with float32 masters.

    Column outputs are the dense layer's columns bit for bit; the row layer sums float16 partial products
    over the group (in float32, rounded once), so results agree to float16 rounding."""
    def case(world):
        if layer == "mlp":
            tp = ax.TensorParallelMLP(HIDDEN, FFN, seed=1)
            dense = ax.TensorParallelMLP.dense_equivalent(HIDDEN, FFN, seed=1)
            x = np.random.default_rng(2).standard_normal((5, HIDDEN)).astype(np.float32)
        else:
            tp = ax.TensorParallelAttention(24, 4, causal=True, seed=3)
            dense = ax.TensorParallelAttention.dense_equivalent(24, 4, causal=True, seed=3)
            x = np.random.default_rng(2).standard_normal((2, 5, 24)).astype(np.float32)
        with nn.autocast("float16"):
            y, want = tp(x), dense(x)
        assert y.dtype == np.float16 and want.dtype == np.float16
        np.testing.assert_allclose(y, want, rtol=1e-2, atol=2e-3)
        g = np.random.default_rng(4).standard_normal(y.shape).astype(np.float32)
        dx, want_dx = tp.backward(g), dense.backward(g)
        assert dx.dtype == np.float32
        np.testing.assert_allclose(dx, want_dx, rtol=1e-2, atol=2e-3)
        for p in tp.parameters():
            assert p.data.dtype == np.float32 and p.grad.dtype == np.float32
        for (name, p), q in zip(tp.named_parameters(), dense.parameters()):  # the same order
            full = ax.all_gather(p.grad)  # every rank's block, stacked
            if full.shape[1:] != q.grad.shape:  # sharded: row layers split their weight's columns
                axis = 1 if name.endswith("weight") and ("fc2" in name or "out_proj" in name) else 0
                full = np.concatenate(list(full), axis=axis)
            else:
                full = full[0]
            want_g = q.grad
            assert np.abs(full - want_g).max() <= 2e-2 * np.abs(want_g).max() + 1e-5, name

    ax.run_local(case, world_size=2)


def test_attention_costs_one_all_reduce_each_way(monkeypatch):
    from collections import Counter
    import threading

    from axonhpc.parallel.tensor import attention, linear

    calls = []
    real = linear.all_reduce

    def counting(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)

    for module in (linear, attention):  # every all-reduce of the layers goes through these two names
        monkeypatch.setattr(module, "all_reduce", counting)
    phases = []

    def case(world):
        attn = ax.TensorParallelAttention(24, 12, dtype=np.float64, seed=0)
        me = threading.get_ident()
        x = np.random.default_rng(1).standard_normal((2, 3, 24))
        before = calls.count(me)
        y = attn(x)
        forward = calls.count(me) - before
        attn.backward(np.ones_like(y))
        phases.append((forward, calls.count(me) - before - forward))

    ax.run_local(case, world_size=2)
    assert phases == [(1, 1), (1, 1)], phases
    assert len(Counter(calls)) == 2


def test_attention_init_makes_the_same_generator_calls_as_dense():
    g_dense, g_tp = np.random.default_rng(9), np.random.default_rng(9)
    dense = nn.MultiHeadAttention(24, 4, seed=g_dense)
    tp = ax.TensorParallelAttention(24, 4, group=ax.ProcessGroup.mock(), seed=g_tp)
    assert tp.q_proj.weight.dtype == np.float32
    for (name, a), (_, b) in zip(tp.named_parameters(), dense.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)
    assert g_dense.random() == g_tp.random()


def test_attention_without_bias_and_wrong_input():
    group = ax.ProcessGroup.mock()
    tp = ax.TensorParallelAttention(24, 4, group=group, bias=False, causal=True, dtype=np.float64, seed=3)
    dense = nn.MultiHeadAttention(24, 4, bias=False, causal=True, dtype=np.float64, seed=3)
    assert [n for n, _ in tp.named_parameters()] == [n for n, _ in dense.named_parameters()]
    x = np.random.default_rng(0).standard_normal((2, 5, 24))
    np.testing.assert_allclose(tp(x), dense(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ShapeError, match=r"expects input \(B, T, 24\), got \(2, 24\)"):
        tp(np.zeros((2, 24)))
