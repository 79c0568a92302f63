"""Staging device arrays through reusable host buffers, with numpy stand-ins for device arrays.

``run_staged`` and ``HostBuffers`` are tested directly with injected copies;
the MPI backend's staged and CUDA-aware paths run end to end on a one-rank
MPI job (a plain ``python`` subprocess, no mpiexec) with ``fake_cuda``'s
DeviceArray playing the cupy array. Nothing here touches a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from axonhpc.backends.base import CompletedWork, Work
from axonhpc.backends.staging import DeviceCopies, HostBuffers, Staging, host_view, run_pipelined, run_staged
from support.fake_cuda import DeviceArray, device
from support.paths import ROOT


def _pool():
    return HostBuffers(lambda nbytes: np.empty(nbytes, dtype=np.uint8))


class _Copies:
    """Copies between DeviceArrays and host arrays, counted."""

    def __init__(self):
        self.to_host = self.to_device = self.syncs = 0

    def make(self) -> DeviceCopies:
        def to_host(dev, host):
            assert isinstance(dev, DeviceArray) and type(host) is np.ndarray
            self.to_host += 1
            dev.get(out=host)

        def to_device(host, dev):
            self.to_device += 1
            dev.set(host)

        def sync():
            self.syncs += 1

        return DeviceCopies(to_host, to_device, sync)


class _Pending(Work):
    """A Work that completes when the test says so."""

    done = False

    def _test(self):
        return self.done


# -- the pool -------------------------------------------------------------------------------------
def test_buffers_are_reused_not_allocated_per_call():
    pool = _pool()
    for _ in range(10):
        a = pool.lease(1000)
        b = pool.lease(3000)
        assert a.nbytes >= 1000 and b.nbytes >= 3000 and a is not b
        pool.release(a)
        pool.release(b)
    assert pool.allocations == 2


def test_a_lease_takes_the_smallest_free_buffer_that_fits():
    pool = _pool()
    small, big = pool.lease(4096), pool.lease(1 << 20)
    pool.release(big)
    pool.release(small)
    assert pool.lease(100) is small
    assert pool.lease(5000) is big


def test_a_larger_request_drops_the_buffers_too_small_for_it():
    pool = _pool()
    held = [pool.lease(4096), pool.lease(8192)]  # leased together, so both are kept
    for buf in held:
        pool.release(buf)
    assert pool.free_bytes == 4096 + 8192
    big = pool.lease(100_000)
    assert big.nbytes == 131072  # rounded up to a power of two
    assert pool.free_bytes == 0
    pool.release(big)
    assert pool.lease(70_000) is big and pool.allocations == 3


def test_host_view_shapes_the_leading_bytes():
    raw = np.arange(64, dtype=np.uint8)
    v = host_view(raw, (2, 3), np.float16)
    assert v.shape == (2, 3) and v.dtype == np.float16 and np.shares_memory(v, raw)
    assert host_view(raw, (0,), np.float64).shape == (0,)


# -- run_staged ------------------------------------------------------------------------------------
def test_inputs_are_copied_in_outputs_copied_back_and_the_result_is_the_device_array():
    copies, pool = _Copies(), _pool()
    staging = Staging(pool, copies.make())
    send = device(np.arange(4, dtype=np.float32))
    recv = device(np.zeros((2, 4), dtype=np.float32))
    seen = {}

    def host_all_gather(s, r, async_op):
        seen["types"] = (type(s), type(r))
        assert s.tolist() == [0, 1, 2, 3]  # copied in before the call
        r[...] = np.stack([s, s + 10])
        return CompletedWork(r)

    work = run_staged(host_all_gather, (send, recv, False), reads=(0,), writes=(1,), staging=staging)
    assert seen["types"] == (np.ndarray, np.ndarray)
    result = work.wait()
    assert result is recv and recv.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert (copies.to_host, copies.to_device, copies.syncs) == (1, 1, 1)
    assert pool.free_bytes > 0  # both buffers back in the pool


def test_nothing_is_copied_back_before_the_transfer_completes_and_buffers_stay_leased():
    copies, pool = _Copies(), _pool()
    staging = Staging(pool, copies.make())
    x = device(np.ones(8))
    pending = _Pending()

    def host_all_reduce(buf, op, async_op):
        buf *= 3
        return pending

    work = run_staged(host_all_reduce, (x, "sum", True), reads=(0,), writes=(0,), staging=staging)
    assert x.tolist() == [1.0] * 8 and not work.is_completed()
    other = pool.lease(64)  # the in-flight operation's buffer is not handed out again
    assert pool.allocations == 2
    pool.release(other)
    pending.done = True
    work.wait()
    assert x.tolist() == [3.0] * 8 and copies.to_device == 1


def test_absent_buffers_and_write_only_buffers_are_not_copied_in():
    copies = _Copies()
    staging = Staging(_pool(), copies.make())
    recv = device(np.zeros(3))

    def host_scatter(send, r, root, async_op):
        assert send is None
        r[...] = 7
        return CompletedWork(r)

    assert run_staged(host_scatter, (None, recv, 0, False), reads=(0,), writes=(1,), staging=staging).wait() is recv
    assert recv.tolist() == [7, 7, 7] and copies.to_host == 0


def test_a_failing_call_returns_its_buffers():
    pool = _pool()
    staging = Staging(pool, _Copies().make())

    def broken(buf, async_op):
        raise RuntimeError("MPI said no")

    with pytest.raises(RuntimeError, match="MPI said no"):
        run_staged(broken, (device(np.ones(4)), False), reads=(0,), writes=(0,), staging=staging)
    assert pool.free_bytes > 0


# -- the chunked pipeline -------------------------------------------------------------------------------
class _Session:
    """A copy session that copies at once and logs each step, so the tests can read the pipeline's order."""

    def __init__(self, log):
        self.log = log
        log.append("begin")

    def to_host(self, dev, host):
        assert type(host) is np.ndarray
        self.log.append(f"in {dev.size}")
        dev.get(out=host)
        return lambda: self.log.append("arrived")

    def to_device(self, host, dev):
        self.log.append(f"out {dev.size}")
        dev.set(host)

    def end(self):
        self.log.append("end")


def test_every_copy_in_is_queued_first_then_each_chunk_is_reduced_and_queued_back_in_turn():
    log, pool = [], _pool()
    staging = Staging(pool, _Copies().make(), lambda: _Session(log))
    x = device(np.arange(10, dtype=np.float64).reshape(2, 5))

    def reduce(chunk):
        log.append(f"reduce {chunk.tolist()}")
        chunk *= 2

    run_pipelined(x, reduce, staging, 4)
    assert log == ["begin", "in 4", "in 4", "in 2",
                   "arrived", "reduce [0.0, 1.0, 2.0, 3.0]", "out 4",
                   "arrived", "reduce [4.0, 5.0, 6.0, 7.0]", "out 4",
                   "arrived", "reduce [8.0, 9.0]", "out 2", "end"]
    assert x.tolist() == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]
    assert pool.free_bytes >= x.nbytes and pool.allocations == 1
    run_pipelined(x, reduce, staging, 100)  # one chunk; the buffer is reused
    assert pool.allocations == 1 and x.tolist()[1] == [20, 24, 28, 32, 36]


def test_a_failing_chunk_ends_the_session_and_returns_the_buffer():
    log, pool = [], _pool()
    staging = Staging(pool, _Copies().make(), lambda: _Session(log))

    def reduce(chunk):
        raise RuntimeError("rank 2 is gone")

    with pytest.raises(RuntimeError, match="rank 2 is gone"):
        run_pipelined(device(np.ones(9, dtype=np.float32)), reduce, staging, 3)
    assert log[-1] == "end" and pool.free_bytes > 0


def test_without_copy_streams_the_chunks_are_copied_in_turn():
    copies = _Copies()
    staging = Staging(_pool(), copies.make())
    x = device(np.arange(7, dtype=np.int64))
    seen = []
    run_pipelined(x, lambda chunk: seen.append(chunk.tolist()) or chunk.__imul__(-1), staging, 3)
    assert seen == [[0, 1, 2], [3, 4, 5], [6]] and x.tolist() == [0, -1, -2, -3, -4, -5, -6]
    assert (copies.to_host, copies.to_device, copies.syncs) == (3, 3, 1)


def test_cupy_pipeline_orders_its_streams_after_the_callers_and_keeps_them(monkeypatch):
    from support import fake_cuda
    from axonhpc.backends.staging import cupy_pipeline

    cupy = fake_cuda.FakeCupy()
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0, raising=False)
    made = []
    real_stream = cupy.cuda.Stream
    streams = []
    monkeypatch.setattr(cupy.cuda, "Stream",
                        lambda **kw: made.append(kw) or streams.append(real_stream(**kw)) or streams[-1])
    gets = []
    real_get = DeviceArray.get
    monkeypatch.setattr(DeviceArray, "get", lambda self, **kw: gets.append(sorted(kw)) or real_get(self, **kw))
    staging = Staging(_pool(), _Copies().make(), cupy_pipeline(cupy))
    x = device(np.arange(6, dtype=np.float32))
    with fake_cuda.strict_cupy.count_syncs() as syncs:
        run_pipelined(x, lambda chunk: chunk.__iadd__(1), staging, 4)
        run_pipelined(x, lambda chunk: chunk.__iadd__(1), staging, 4)
    assert x.tolist() == [2, 3, 4, 5, 6, 7]
    assert made == [{"non_blocking": True}] * 2  # one pair of copy streams, made once
    assert [s.waited for s in streams] == [2, 2]  # each waited for the caller's stream at each call
    assert gets == [["blocking", "out", "stream"]] * 4  # asynchronous copies on a stream of their own
    # per call: one wait for each chunk's arrival, then both copy streams before the buffer is reused
    assert [s.split(" ")[0] for s in syncs] == ["event.synchronize"] * 2 + ["stream.synchronize"] * 2 + \
        ["event.synchronize"] * 2 + ["stream.synchronize"] * 2


# -- the MPI backend on a one-rank job ---------------------------------------------------------------
MPI_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from support import fake_cuda
cupy, nccl = fake_cuda.install(sys.modules)
syncs = []
fake_cuda._Stream.synchronize = lambda self: syncs.append(1)

from mpi4py import MPI
import axonhpc as ax
from axonhpc.backends import cuda_aware, staging
from axonhpc.backends.mpi import MPIBackend
from support.fake_cuda import DeviceArray, device

pool = staging.HostBuffers(lambda n: np.empty(n, dtype=np.uint8))
calls = []
staging._default = staging.Staging(pool, staging.DeviceCopies(
    lambda d, h: (calls.append("in"), d.get(out=h)),
    lambda h, d: (calls.append("out"), d.set(h)),
    lambda: None))
S = ax.ReduceOp.SUM

def ops(b):
    x = device(np.arange(5, dtype=np.float32))
    b.all_reduce(x, S, False)
    assert type(x) is DeviceArray and x.tolist() == [0, 1, 2, 3, 4]
    w = b.all_reduce(x, S, True)
    w.wait()
    y = device(np.full(3, 9, dtype=np.int64))
    b.broadcast(y, 0, False)
    r = device(np.zeros((1, 3), dtype=np.int64))
    assert b.all_gather(y, r, False).wait() is r and r.tolist() == [[9, 9, 9]]
    rs = device(np.zeros(3, dtype=np.int64))
    b.reduce_scatter(y, rs, S, False)
    assert rs.tolist() == [9, 9, 9]
    g = device(np.zeros((1, 3), dtype=np.int64))
    b.gather(y, g, 0, False)
    sc = device(np.zeros(3, dtype=np.int64))
    b.scatter(g, sc, 0, False)
    assert g.tolist() == [[9, 9, 9]] and sc.tolist() == [9, 9, 9]
    into = device(np.zeros(4, dtype=np.float64))
    wr = b.recv(into, 0, 3, True)
    b.send(device(np.full(4, 2.5)), 0, 3, False)
    assert wr.wait() is into and into.tolist() == [2.5] * 4

cuda_aware.set_cached(cuda_aware.CudaAwareness(False, "test: not CUDA-aware"))
b = MPIBackend(MPI.COMM_SELF)
for _ in range(3):
    ops(b)
staged_calls = len(calls)
print("staged", staged_calls > 0, "allocations", pool.allocations, "syncs", len(syncs))

# the collective layer on a one-rank world: scatter's receivers follow the source to the device
world = ax.init(backend="mpi")
part = ax.scatter(device(np.arange(4.0).reshape(1, 4)), 0)
print("scatter", type(part).__name__, part.tolist())

cuda_aware.set_cached(cuda_aware.CudaAwareness(True, "test: CUDA-aware"))
calls.clear(); syncs.clear()
ops(b)
print("direct copies", len(calls), "stream syncs", len(syncs) > 0)

# float MIN/MAX run numpy in a user op (backends.mpi_work): even a CUDA-aware MPI gets host twins
calls.clear()
m = device(np.array([1.0, np.nan], dtype=np.float32))
b.all_reduce(m, ax.ReduceOp.MAX, False)
print("float max copies", len(calls), type(m).__name__, m.tolist())
"""


def test_mpi_backend_stages_device_arrays_or_passes_them_directly_on_a_one_rank_job():
    code = MPI_SCRIPT.format(tests=os.path.join(ROOT, "tests"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    staged = lines[0].split()
    assert staged[:2] == ["staged", "True"]
    assert int(staged[3]) <= 4, f"host buffers must be reused across calls: {lines[0]}"
    assert lines[1] == "scatter DeviceArray [0.0, 1.0, 2.0, 3.0]"
    assert lines[2] == "direct copies 0 stream syncs True"
    assert lines[3] == "float max copies 2 DeviceArray [1.0, nan]", lines[3]
