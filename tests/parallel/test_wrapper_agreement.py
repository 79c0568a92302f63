"""Parallel wrappers compare their models across ranks when they are built; FSDP refuses a wrong optimizer.

The cases (``wrapper_agreement_cases``) run on thread ranks at world sizes 1
to 4 and on MPI ranks under mpiexec. The other tests here check that the
common case costs one exchange per wrapper, the pieces on their own, and
that DDP and FSDP fall back to private memory when ``/dev/shm`` is too small.
"""
import threading

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.backends import shm as shm_backend
from axonhpc.errors import ConfigurationError, UsageError
from axonhpc.groups import agreement
from axonhpc.parallel import same_model
from support.mpi_assert import collectively
from support.runner import case_tests
from support.wrapper_agreement_cases import CASES


test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES)


def test_agreeing_ranks_cost_one_small_exchange_per_wrapper(monkeypatch):
    """Same models: each wrapper (a TP block too, not one per layer) runs one compare, which finds no difference."""
    calls = {}
    lock = threading.Lock()
    real = agreement.compare

    def counting(group, ok, text, same, gather=None):
        seen = real(group, ok, text, same, gather)
        with lock:
            calls.setdefault(threading.get_ident(), []).append((group.name, seen))
        return seen

    monkeypatch.setattr(agreement, "compare", counting)
    n = 3
    counts = {}

    def build(world):
        mine = calls.setdefault(threading.get_ident(), [])

        def count(label, make):
            start = len(mine)
            make()
            with lock:
                counts.setdefault(label, set()).add(tuple(name for name, _ in mine[start:]))
            assert all(seen is None for _, seen in mine[start:])

        model = nn.Sequential(nn.Linear(4, 6, seed=0), nn.Tanh(), nn.Linear(6, 2, seed=1))
        count("ddp", lambda: ax.DDP(model, bucket_size_mb=25))
        count("zero", lambda: ax.ZeroRedundancyOptimizer(optim.SGD, model.parameters(), lr=0.1))
        count("fsdp", lambda: ax.FSDP(nn.Sequential(nn.Linear(4, 6, seed=0), nn.Linear(6, 2, seed=1))))
        count("column", lambda: ax.ColumnParallelLinear(4, 2 * n, seed=0))
        count("mlp", lambda: ax.TensorParallelMLP(4, 2 * n, seed=0))
        count("attention", lambda: ax.TensorParallelAttention(4 * n, n, seed=0))
        stages = [nn.Sequential(nn.Linear(4, 4, seed=s)) for s in range(n)]
        count("pipeline", lambda: ax.Pipeline.from_modules(stages))
        mesh = world.mesh(dp=n)
        count("pipeline x dp", lambda: ax.Pipeline.from_modules([nn.Sequential(nn.Linear(4, 2, seed=0))],
                                                               group=mesh.pp, dp_group=mesh.dp))

    ax.run_local(build, world_size=n)
    assert counts == {"ddp": {("world",)}, "zero": {("world",)}, "fsdp": {("world",)}, "column": {("world",)},
                      "mlp": {("world",)}, "attention": {("world",)}, "pipeline": {("world",)},
                      "pipeline x dp": {("mesh.dp",)}}  # a pipeline group of one rank compares nothing


def test_one_rank_raises_its_own_problem_without_an_exchange():
    group = ax.ProcessGroup.mock()
    same_model.check_same_model(group, "X", ["a:float32:(2,)"])
    with pytest.raises(ConfigurationError, match="mine"):
        same_model.check_same_model(group, "X", [], ConfigurationError("mine"))


def test_parameter_lines_describe_name_dtype_and_shape():
    model = nn.Sequential(nn.Linear(3, 2, dtype=np.float64, seed=0))
    assert same_model.parameter_lines(model.named_parameters()) == ["0.weight:float64:(2, 3)", "0.bias:float64:(2,)"]


def test_a_moved_gradient_refuses_arithmetic_but_not_zeroing():
    from axonhpc.parallel.fsdp.flat_param import MovedGradient, moved

    marker = np.empty(0, dtype=np.float32).view(MovedGradient)
    marker.message = "use fsdp.parameters()"
    for op in (lambda g: 0.1 * g, lambda g: g - np.zeros(0, np.float32), lambda g: g.copy() * 2, np.isfinite):
        with pytest.raises(UsageError, match="use fsdp.parameters()"):
            op(marker)
    marker[...] = 0  # Optimizer.zero_grad and Parameter.zero_grad fill in place: allowed
    assert moved(marker) and moved(marker.copy()) and not moved(np.zeros(0))
    assert "use fsdp.parameters()" in repr(marker)


def test_an_fsdp_module_parameter_grad_is_the_marker_after_backward():
    model = nn.Sequential(nn.Linear(4, 3, seed=0))
    fsdp = ax.FSDP(model, group=ax.ProcessGroup.mock())
    loss_fn = nn.MSELoss()
    loss_fn(fsdp(np.ones((2, 4), np.float32)), np.zeros((2, 3), np.float32))
    fsdp.backward(loss_fn.backward())
    from axonhpc.parallel.fsdp.flat_param import moved

    assert all(moved(p.grad) for p in model.parameters())
    assert all(p.grad is not None and p.grad.size == p.data.size for p in fsdp.parameters())
    fsdp.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# -- /dev/shm too small: private memory instead ----------------------------------------------------

def _windows(pg):
    backend = getattr(pg.backend, "host", pg.backend)
    return len(getattr(backend, shm_backend._ARRAYS, None) or [])


def _small_dev_shm(monkeypatch):
    monkeypatch.setattr(shm_backend, "free_shm_bytes", lambda path=shm_backend.SHM_DIR: 1 << 16)


def _skip_without_shared_memory(pg):
    if not pg.on_one_node or ax.settings.shm_collectives == "off":
        pytest.skip("shared memory needs every rank on one node")


@pytest.mark.mpi(min_size=2)
def test_ddp_keeps_private_buckets_when_dev_shm_is_small(mpi_world, monkeypatch):
    pg = mpi_world.default_group
    _skip_without_shared_memory(pg)

    def make():
        return ax.DDP(nn.Sequential(nn.Linear(512, 600, seed=0)), bucket_size_mb=25)  # 1.2 MB of gradients

    def check():
        before = _windows(pg)
        _small_dev_shm(monkeypatch)
        try:
            ddp = make()  # refused on every rank alike: private buckets, no error
        finally:
            monkeypatch.undo()
        assert _windows(pg) == before
        for p in ddp.parameters():
            p.grad = np.full(p.shape, mpi_world.rank + 1.0, dtype=p.dtype)
        ddp.sync_gradients()
        for p in ddp.parameters():
            assert np.all(p.grad == (pg.size + 1) / 2)
        make()  # with room in /dev/shm the same DDP does take a window: the fallback above was needed
        assert _windows(pg) == before + 1

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
def test_fsdp_keeps_private_shards_when_dev_shm_is_small(mpi_world, monkeypatch):
    pg = mpi_world.default_group
    _skip_without_shared_memory(pg)

    def make():
        return ax.FSDP(nn.Sequential(nn.Linear(1536, 1024, seed=0)))  # 6.3 MB: at least 1.5 MiB of shard per rank

    def check():
        before = _windows(pg)
        _small_dev_shm(monkeypatch)
        try:
            fsdp = make()
        finally:
            monkeypatch.undo()
        assert _windows(pg) == before
        reference = nn.Sequential(nn.Linear(1536, 1024, seed=0)).state_dict()
        full = fsdp.state_dict()  # all-gathers from the private shards
        assert all(np.array_equal(full[k], reference[k]) for k in reference)
        make()
        assert _windows(pg) == before + 1

    collectively(mpi_world, check)
