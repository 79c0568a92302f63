"""The pipelined staged all-reduce on real MPI ranks (mpiexec -n 1..4), with fake_cuda's arrays as device arrays.

MPI is told it is not CUDA-aware, so a device array's all-reduce goes through
host copies; the staging area is plain numpy buffers with a copy session that
counts its chunks (``fake_cuda`` has no pinned memory). Each device result is
compared bit for bit with the same all-reduce of a numpy array: the chunks'
host all-reduces (the shared-memory engine, or MPI) must give exactly what the
whole array gets. Nothing here runs on a GPU.
"""
import sys

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends import cuda_aware, staging
from axonhpc.errors import CollectiveMismatchError
from support.mpi_assert import collectively

CHUNK_BYTES = 24
DTYPES = ["float32", "float64", "int64", "float16"]
OPS = ["sum", "avg", "max", "min", "product"]


class _CountingSession:
    """Copies at once; counts sessions and chunks so the tests know which path ran."""

    sessions = 0
    chunks = 0

    def __init__(self):
        type(self).sessions += 1

    def to_host(self, dev, host):
        type(self).chunks += 1
        dev.get(out=host)
        return lambda: None

    def to_device(self, host, dev):
        dev.set(host)

    def end(self):
        pass


@pytest.fixture
def staged(monkeypatch):
    """fake_cuda's cupy in sys.modules, MPI not CUDA-aware, numpy staging, 24-byte chunks."""
    from support import fake_cuda

    monkeypatch.setitem(sys.modules, "cupy", fake_cuda.FakeCupy())
    saved_aware = cuda_aware.cuda_aware_mpi()
    cuda_aware.set_cached(cuda_aware.CudaAwareness(False, "test: forced staging"))
    monkeypatch.setattr(staging, "_default", staging.Staging(
        staging.HostBuffers(lambda n: np.empty(n, dtype=np.uint8)),
        staging.DeviceCopies(lambda d, h: d.get(out=h), lambda h, d: d.set(h), lambda: None),
        _CountingSession))
    saved = {k: getattr(ax.settings, k) for k in ("staging_chunk_bytes", "shm_collectives", "deterministic",
                                                  "timeout")}
    ax.settings.staging_chunk_bytes = CHUNK_BYTES
    yield fake_cuda.device
    for k, v in saved.items():
        setattr(ax.settings, k, v)
    cuda_aware.set_cached(saved_aware)


def _data(dtype, rank, n=37):
    rng = np.random.default_rng(100 + rank)
    if dtype == "int64":
        return rng.integers(-50, 50, n).astype(np.int64)
    return (rng.standard_normal(n) * (0.5 if dtype == "float16" else 3)).astype(dtype)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), f"{a.tolist()} != {b.tolist()}"


def _pipelined(device, data, op, **kwargs):
    """All-reduce ``data`` as a device array; returns (host result, chunks the pipeline copied)."""
    before = _CountingSession.chunks
    d = device(data.copy())
    work = ax.all_reduce(d, op, **kwargs)
    if work is not None:
        work.wait()
    return d.get(), _CountingSession.chunks - before


def _host(data, op):
    h = data.copy()
    ax.all_reduce(h, op)
    return h


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_chunks_give_the_whole_arrays_result_bit_for_bit(mpi_world, staged, shm):
    def check():
        ax.settings.shm_collectives = shm
        n, r = mpi_world.world_size, mpi_world.rank
        for dtype in DTYPES:
            for op in OPS:
                data = _data(dtype, r)
                if op == "product":
                    data = (data % 3 + 1).astype(dtype) if dtype == "int64" else (np.abs(data) % 1 + 0.5).astype(dtype)
                got, chunks = _pipelined(staged, data, op)
                _same_bits(got, _host(data, op))
                expected = -(-data.nbytes // CHUNK_BYTES) if n > 1 else 0
                assert chunks == expected, (dtype, op, chunks, expected)

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=1)
def test_bfloat16_chunks_are_widened_like_the_whole_array(mpi_world, staged):
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def check():
        data = _data("float32", mpi_world.rank).astype(ml_dtypes.bfloat16)
        for op in ("sum", "avg"):
            got, _ = _pipelined(staged, data, op)
            _same_bits(got, _host(data, op))

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
def test_what_is_not_pipelined_still_reduces(mpi_world, staged):
    """One chunk or less, async_op=True, a timeout, and chunk size 0 take the whole-array staging.

    That path reduces with MPI's own all-reduce, whose order of additions may differ
    from the shared-memory engine's, so floats are compared to rounding here.
    """

    def _close(a, b):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6 if a.dtype == np.float32 else 1e-14)

    def check():
        r = mpi_world.rank
        small = _data("float32", r, n=CHUNK_BYTES // 4)
        got, chunks = _pipelined(staged, small, "sum")
        assert chunks == 0
        _close(got, _host(small, "sum"))
        data = _data("float64", r)
        got, chunks = _pipelined(staged, data, "sum", async_op=True)
        assert chunks == 0
        _close(got, _host(data, "sum"))
        ax.settings.timeout = 60
        got, chunks = _pipelined(staged, data, "avg")
        ax.settings.timeout = None
        assert chunks == 0
        _close(got, _host(data, "avg"))
        ax.settings.staging_chunk_bytes = 0
        got, chunks = _pipelined(staged, data, "max")
        assert chunks == 0
        _close(got, _host(data, "max"))

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_a_rank_whose_call_is_asynchronous_takes_the_others_off_the_pipeline(mpi_world, staged, shm):
    # The pipeline's chunks would meet the asynchronous rank's one nonblocking all-reduce of the whole
    # array and wait forever ([Note: blocking and nonblocking twins]): every rank reduces it whole.
    def check():
        ax.settings.shm_collectives = shm
        r, n = mpi_world.rank, mpi_world.world_size
        data = np.full(37, float(r + 1))
        for async_rank in (0, n - 1):
            got, chunks = _pipelined(staged, data, "sum", async_op=r == async_rank)
            assert chunks == 0 and (got == n * (n + 1) / 2).all(), (async_rank, chunks, got[:3])
        got, chunks = _pipelined(staged, data, "sum")  # all blocking again: pipelined
        assert chunks == -(-data.nbytes // CHUNK_BYTES) and (got == n * (n + 1) / 2).all()

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shm", ["auto", "off"])
def test_a_rank_under_a_timeout_takes_the_others_off_the_pipeline(mpi_world, staged, shm):
    # A timed rank stages the whole array (its wait is polled); the others would pipeline chunks. Its call is
    # nonblocking, and the agreement check says so to every rank, as for an asynchronous call.
    def check():
        ax.settings.shm_collectives = shm
        r, n = mpi_world.rank, mpi_world.world_size
        pg = mpi_world.default_group
        data = np.full(37, float(r + 1))
        saved = pg.timeout
        try:
            for timed_rank in (0, n - 1):
                pg.timeout = 30.0 if r == timed_rank else None
                for _ in range(3):
                    got, chunks = _pipelined(staged, data, "sum")
                    assert chunks == 0 and (got == n * (n + 1) / 2).all(), (timed_rank, chunks, got[:3])
        finally:
            pg.timeout = saved

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
def test_deterministic_mode_pipelines_through_the_engine_with_its_fixed_order(mpi_world, staged):
    def check():
        ax.settings.deterministic = True
        data = _data("float32", mpi_world.rank, n=101)
        got, chunks = _pipelined(staged, data, "sum")
        assert chunks == -(-data.nbytes // CHUNK_BYTES)  # one node here: the engine is there
        _same_bits(got, _host(data, "sum"))

    collectively(mpi_world, check)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_sizes_are_refused_on_every_rank_before_any_chunk(mpi_world, staged):
    def check():
        r = mpi_world.rank
        before = _CountingSession.chunks
        with pytest.raises(CollectiveMismatchError, match=r"float32 on device \(40,\).*float32 on device \(41,\)"):
            ax.all_reduce(staged(np.ones(40 + (r == 1), dtype=np.float32)))
        assert _CountingSession.chunks == before
        got, _ = _pipelined(staged, np.ones(40, dtype=np.float32), "sum")  # the group still works
        assert got.tolist() == [mpi_world.world_size] * 40

    collectively(mpi_world, check)
