"""The device path on real GPUs: collectives, NCCL, staging, DDP and FSDP parity on cupy arrays.

Everywhere without cupy and a CUDA device they skip. On a GPU node
(``bash scripts/gpu-check.sh`` runs all of this and says what was skipped):

    python -m pytest -m gpu --with-mpi tests/backends/test_gpu_collectives.py          # one rank
    axonhpc launch -n 2 -- scripts/mpi_pytest.py test-logs/gpu -m gpu tests/backends/test_gpu_collectives.py

(``scripts/mpi_pytest.py`` adds ``--with-mpi``, so the tests marked ``mpi``
run too; see docs/gpu.md for SLURM.) Multi-rank assertions are collective
(``mpi_assert.collectively``), so a failure on one rank fails every rank.

Two ranks on one GPU (a one-GPU node): NCCL refuses such a communicator, so
the tests that build one skip, saying which ranks share which GPU; the
``auto`` world then moves cupy arrays over MPI (staged), and the tests on it
run. Every skip is decided from facts gathered from every rank first, so all
ranks skip together and none waits in a collective for one that skipped.
"""
import importlib
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.backends.devices import device_facts
from axonhpc.backends.shared_device import device_identity, shared_devices
from support.mpi_assert import collectively


def _device_on_every_rank():
    """(usable here and on every rank of a running MPI job, why not): the same answer on every rank.

    Under ``scripts/mpi_pytest.py`` (and pytest-mpi's ``--with-mpi``) MPI is up before collection, so
    the ranks compare what each found; a rank without a device would otherwise skip alone and leave
    the others waiting in the first collective.
    """
    here = device_facts().devices > 0
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return here, "needs cupy and a CUDA device"
    found = MPI.COMM_WORLD.allgather(here)
    missing = [r for r, ok in enumerate(found) if not ok]
    return not missing, f"needs cupy and a CUDA device on every rank; ranks {missing} have none"


_usable, _why = _device_on_every_rank()
# cupy itself when a CUDA device is usable on every rank (the library's own probe), else None: skip.
cupy = importlib.import_module("cupy") if _usable else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy is None, reason=_why)]


def _skip_if_ranks_share_a_gpu(world):
    """Collective: skip on every rank when two ranks are bound to one GPU (NCCL refuses that)."""
    from mpi4py import MPI

    shared = shared_devices(MPI.COMM_WORLD.allgather(device_identity(cupy)), range(world.world_size))
    if shared:
        which = "; ".join(f"ranks {ranks} share {label}" for label, ranks in shared)
        pytest.skip(f"NCCL needs one GPU per rank: {which} (a node with one GPU per rank runs this)")


S = ax.ReduceOp.SUM
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8]


def _get(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _collective_suite(world, group=None):
    """Every collective on cupy arrays with closed-form results; raises on the first wrong value."""
    pg = group or world.default_group
    n, r = pg.size, pg.rank
    for dtype in DTYPES:
        x = cupy.full((3, 2), r + 1, dtype=dtype)
        ax.all_reduce(x, group=pg)
        assert isinstance(x, cupy.ndarray)
        np.testing.assert_allclose(_get(x).astype(np.float64), n * (n + 1) / 2, rtol=1e-2)
        for op, want in (("max", n), ("min", 1)):
            y = cupy.full(4, r + 1, dtype=dtype)
            ax.all_reduce(y, op, group=pg)
            assert _get(y).tolist() == [want] * 4
    f = cupy.full(5, float(r), dtype=cupy.float32)
    ax.all_reduce(f, "avg", group=pg)
    np.testing.assert_allclose(_get(f), (n - 1) / 2)
    i = cupy.full(2, r, dtype=cupy.int32)
    ax.all_reduce(i, "avg", group=pg)
    assert _get(i).tolist() == [sum(range(n)) // n] * 2
    b = cupy.arange(6, dtype=cupy.float64) * (r + 1)
    ax.broadcast(b, src=n - 1, group=pg)
    assert _get(b).tolist() == (np.arange(6.0) * n).tolist()
    g = ax.all_gather(cupy.asarray([r, 10 * r], dtype=cupy.int64), group=pg)
    assert isinstance(g, cupy.ndarray) and _get(g).tolist() == [[k, 10 * k] for k in range(n)]
    rs = ax.reduce_scatter(cupy.arange(2 * n, dtype=cupy.float32), group=pg)
    assert _get(rs).tolist() == [n * 2 * r, n * (2 * r + 1)]
    ga = ax.gather(cupy.asarray([r + 1], dtype=cupy.uint8), dst=0, group=pg)
    if r == 0:
        assert _get(ga).tolist() == [[k + 1] for k in range(n)]
    src = cupy.arange(3 * n, dtype=cupy.float32).reshape(n, 3) if r == 0 else None
    part = ax.scatter(src, 0, group=pg)
    assert isinstance(part, cupy.ndarray) and _get(part).tolist() == [3 * r, 3 * r + 1, 3 * r + 2]
    w = ax.all_reduce(cupy.ones(1000, dtype=cupy.float32), async_op=True, group=pg)
    w.wait()
    if n > 1:
        into = cupy.zeros(16, dtype=cupy.float32)
        works = [ax.irecv(into, (r - 1) % n, tag=4, group=pg),
                 ax.isend(cupy.full(16, float(r), dtype=cupy.float32), (r + 1) % n, tag=4, group=pg)]
        for work in works:
            work.wait()
        assert _get(into).tolist() == [float((r - 1) % n)] * 16
    for algorithm in ("ring", "rhd", "hierarchical"):
        z = cupy.arange(11, dtype=cupy.float64) + r
        ax.all_reduce(z, algorithm=algorithm, group=pg)
        assert _get(z).tolist() == (np.arange(11.0) * n + sum(range(n))).tolist()
    ax.barrier(group=pg)


# -- one rank ---------------------------------------------------------------------------------------
def test_this_rank_is_bound_to_a_device_and_info_says_which():
    facts = ax.info()
    assert facts["cupy"] and facts["cuda_devices"] >= 1
    assert facts["device"].startswith("cuda:")
    assert facts["cuda_aware_mpi"].startswith(("yes (", "no ("))


def test_pinned_staging_round_trip_reuses_its_buffers():
    from axonhpc.backends.staging import cupy_staging, run_staged
    from axonhpc.backends.base import CompletedWork

    staging = cupy_staging()
    x = cupy.arange(1000, dtype=cupy.float32)

    def host_double(buf, async_op):
        assert isinstance(buf, np.ndarray)
        buf *= 2
        return CompletedWork()

    before = staging.buffers.allocations
    for _ in range(5):
        run_staged(host_double, (x, False), (0,), (0,), staging).wait()
    assert _get(x).tolist() == (np.arange(1000.0) * 32).tolist()
    assert staging.buffers.allocations - before <= 1


# -- every rank (under mpiexec; also one rank without it) -------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_collective_suite_on_device_arrays(mpi_world):
    collectively(mpi_world, lambda: _collective_suite(mpi_world))


@pytest.mark.mpi(min_size=2)
def test_collective_suite_on_a_subgroup_and_a_split(mpi_world):
    # Each step is its own collective verdict, so every rank reaches every world-wide call (the group
    # creation, the split, the verdicts) in the same order: when the subgroup's members fail, the others
    # are not left waiting for them in the split.
    groups = {}
    collectively(mpi_world, lambda: groups.update(sub=mpi_world.new_group(list(range(0, mpi_world.world_size, 2)))))
    collectively(mpi_world, lambda: _collective_suite(mpi_world, groups["sub"]) if groups["sub"].is_member else None)
    collectively(mpi_world, lambda: groups.update(half=mpi_world.split(mpi_world.rank % 2)))
    collectively(mpi_world, lambda: _collective_suite(mpi_world, groups["half"]))


@pytest.mark.mpi(min_size=1)
def test_nccl_backend_directly(mpi_world):
    from mpi4py import MPI

    from axonhpc.backends.mpi import MPIBackend
    from axonhpc.backends.nccl import NCCLBackend

    _skip_if_ranks_share_a_gpu(mpi_world)

    def check():
        be = NCCLBackend(MPIBackend(MPI.COMM_WORLD))
        n, r = be.size, be.rank
        f = cupy.full(7, 2.0 * r, dtype=cupy.float32)
        be.all_reduce(f, ax.ReduceOp.AVG, False)  # ncclAvg on NCCL >= 2.10.3
        np.testing.assert_allclose(_get(f), n - 1)
        i = cupy.full(3, r, dtype=cupy.int64)
        be.all_reduce(i, ax.ReduceOp.AVG, False)  # SUM then floor division
        assert _get(i).tolist() == [sum(range(n)) // n] * 3
        h = cupy.full(9, 1.5, dtype=cupy.float16)
        be.all_reduce(h, S, False)  # NCCL reduces float16 natively
        assert _get(h).tolist() == [1.5 * n] * 9
        work = be.all_reduce(cupy.ones(1 << 20, dtype=cupy.float32), S, True)
        assert work.wait() is None and work.is_completed()
        be.barrier(False)
        be.free()

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
def test_nccl_refuses_ranks_that_share_a_gpu_on_every_rank(mpi_world):
    """The one-GPU node's case: a clear refusal on every rank, instead of NCCL_ERROR_INVALID_USAGE on some."""
    from mpi4py import MPI

    from axonhpc.backends.mpi import MPIBackend
    from axonhpc.backends.nccl import NCCLBackend

    shared = shared_devices(MPI.COMM_WORLD.allgather(device_identity(cupy)), range(mpi_world.world_size))
    if not shared:
        pytest.skip("every rank has a GPU of its own (run 2 ranks on one GPU to test the refusal)")

    host = MPIBackend(MPI.COMM_WORLD)

    def check():
        with pytest.raises(ax.errors.BackendUnavailableError) as err:
            NCCLBackend(host)
        for label, ranks in shared:
            assert f"ranks {ranks} share one GPU ({label})" in str(err.value)

    try:
        collectively(mpi_world, check)
    finally:
        host.free()


@pytest.mark.mpi(min_size=1)
def test_staged_mpi_path(mpi_world):
    from mpi4py import MPI

    from axonhpc.backends import cuda_aware
    from axonhpc.backends.mpi import MPIBackend

    def check():
        saved = cuda_aware.cuda_aware_mpi()
        cuda_aware.set_cached(cuda_aware.CudaAwareness(False, "test: forced staging"))
        try:
            be = MPIBackend(MPI.COMM_WORLD)
            n, r = be.size, be.rank
            x = cupy.full(1 << 16, r + 1.0, dtype=cupy.float64)
            be.all_reduce(x, S, False)
            assert float(x[0]) == n * (n + 1) / 2
            out = cupy.empty((n, 4), dtype=cupy.int32)
            be.all_gather(cupy.full(4, r, dtype=cupy.int32), out, False).wait()
            assert _get(out)[:, 0].tolist() == list(range(n))
            be.free()
        finally:
            cuda_aware.set_cached(saved)

    collectively(mpi_world, check)


def _ddp_parity(world):
    """DDP on cupy arrays, rank shards of a global batch, against single-process host training."""
    from support.ddp_cases import make_data, make_model, make_optimizer, shard, train_reference

    n, r = world.world_size, world.rank
    model = make_model(np.float64, seed=0 if r == 0 else 1000 + r).to("cuda")
    ddp = ax.DDP(model, group=world.default_group)
    opt = make_optimizer("sgd", ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for step in range(4):
        opt.zero_grad()
        x, y = make_data(step, np.float64)
        loss_fn(ddp(cupy.asarray(shard(x, r, n))), cupy.asarray(shard(y, r, n)))
        ddp.backward(loss_fn.backward())
        opt.step()
    reference = train_reference(np.float64, "sgd", steps=4)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(p.data, cupy.ndarray), name
        np.testing.assert_allclose(_get(p.data), q.data, rtol=1e-10, atol=1e-10, err_msg=name)


def _fsdp_parity(world, strategy):
    """FSDP on cupy arrays against single-process host training."""
    def make():
        return nn.Sequential(nn.Linear(6, 8, dtype=np.float32, seed=0), nn.Tanh(),
                             nn.Linear(8, 3, dtype=np.float32, seed=1))

    def data(step):
        rng = np.random.default_rng(step)
        return rng.standard_normal((12, 6)).astype(np.float32), rng.standard_normal((12, 3)).astype(np.float32)

    n, r = world.world_size, world.rank
    fsdp = ax.FSDP(make().to("cuda"), group=world.default_group, sharding_strategy=strategy)
    opt = optim.SGD(fsdp.parameters(), lr=0.1)
    ref = make()
    ref_opt = optim.SGD(ref.parameters(), lr=0.1)
    loss_fn, ref_loss = nn.MSELoss(), nn.MSELoss()
    k = 12 // n
    for step in range(3):
        x, t = data(step)
        opt.zero_grad()
        loss_fn(fsdp(cupy.asarray(x[r * k:(r + 1) * k])), cupy.asarray(t[r * k:(r + 1) * k]))
        fsdp.backward(loss_fn.backward())
        opt.step()
        ref_opt.zero_grad()
        ref_loss(ref(x), t)
        ref.backward(ref_loss.backward())
        ref_opt.step()
    fsdp.gather_parameters()
    for (name, p), (_, q) in zip(fsdp.module.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(_get(p.data), q.data, rtol=1e-5, atol=1e-6, err_msg=name)
    fsdp.reshard_parameters()


@pytest.mark.mpi(min_size=1)
def test_ddp_on_device_arrays_matches_the_host_reference(mpi_world):
    from support.ddp_cases import GLOBAL_BATCH

    if GLOBAL_BATCH % mpi_world.world_size:
        pytest.skip(f"global batch {GLOBAL_BATCH} does not split over {mpi_world.world_size} ranks")
    collectively(mpi_world, lambda: _ddp_parity(mpi_world))


def _graphed_ddp(world, graphed):
    """Parameters after 6 DDP steps on this rank's shards, eager or as one CUDA graph replayed (NCCL inside)."""
    from support.ddp_cases import make_data, make_model, make_optimizer, shard, step_fn

    n, r = world.world_size, world.rank
    model = make_model(np.float64, seed=0).to("cuda")
    ddp = ax.DDP(model, group=world.default_group)
    step = step_fn(ddp, make_optimizer("adam", ddp.parameters()), nn.CrossEntropyLoss())
    run = ax.graph_step(step) if graphed else step
    for s in range(6):
        x, y = make_data(s, np.float64)
        run(cupy.asarray(shard(x, r, n)), cupy.asarray(shard(y, r, n)))
    assert not graphed or run.captured
    return [_get(p.data) for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
def test_graphed_ddp_replays_its_nccl_all_reduces(mpi_world):
    from support.ddp_cases import GLOBAL_BATCH

    if GLOBAL_BATCH % mpi_world.world_size:
        pytest.skip(f"global batch {GLOBAL_BATCH} does not split over {mpi_world.world_size} ranks")
    backend = mpi_world.default_group.backend
    if mpi_world.world_size > 1 and not backend.captures(cupy.ones(1)):
        pytest.skip(f"the world's backend ({backend.name}) cannot capture collectives: a graph holds NCCL's only "
                    "(one GPU per rank)")

    def check():
        eager, graphed = _graphed_ddp(mpi_world, False), _graphed_ddp(mpi_world, True)
        for a, b in zip(eager, graphed):
            np.testing.assert_array_equal(a, b)

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_fsdp_on_device_arrays_matches_the_host_reference(mpi_world, strategy):
    if 12 % mpi_world.world_size:
        pytest.skip(f"batch 12 does not split over {mpi_world.world_size} ranks")
    collectively(mpi_world, lambda: _fsdp_parity(mpi_world, strategy))
