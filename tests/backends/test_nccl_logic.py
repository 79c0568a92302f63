"""The NCCL backend without a GPU: tables, the unique-id bootstrap, and its calls against a fake NCCL.

The pure parts (datatype and op codes, version codes, the bootstrap and the
readiness vote) are tested directly. The backend itself runs over
``fake_cuda``: numpy arrays stand in for device arrays and a thread-level fake
of ``cupy.cuda.nccl`` moves real data between thread ranks, so these tests
check the arguments and the order of the backend's NCCL calls, not NCCL.
Where cupy's NCCL module imports (cupy installed, even without a GPU), the
table is checked against cupy's constants and the bootstrap runs with a real
``get_unique_id``.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc._dtypes import bfloat16_dtype, supported_dtypes
from axonhpc.backends.devices import nccl_version_tuple
from axonhpc.backends.nccl import (
    NCCL_DATATYPES,
    NCCL_OPS,
    NCCLBackend,
    _host_bytes_broadcast,
    _host_flag_gather,
    agree_ready,
    bootstrap_unique_id,
    nccl_constants,
    nccl_datatype,
    reduction_plan,
    unique_id_bytes,
    unique_id_tuple,
)
from axonhpc.errors import BackendUnavailableError, UnsupportedDtypeError
from support.fake_cuda import DeviceArray, FakeCupy, FakeNccl, device, run_device_world
from support.strict_cupy import count_syncs

ReduceOp = ax.ReduceOp


def _cupy_nccl():
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - no cupy, or cupy without its CUDA libraries
        return None
    return nccl if getattr(nccl, "available", False) else None


# -- tables ----------------------------------------------------------------------------------------
def test_datatype_codes_are_nccl_h_values():
    assert NCCL_DATATYPES == {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                              "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
    assert NCCL_OPS == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_every_supported_dtype_has_an_nccl_type(dtype):
    code = nccl_datatype(dtype)
    assert code == NCCL_DATATYPES[np.dtype(dtype).name]
    assert nccl_datatype(dtype, reducing=True) == code


def test_unsupported_dtypes_are_refused_with_the_name():
    for bad in (np.complex64, np.bool_, np.int16):
        with pytest.raises(UnsupportedDtypeError, match=np.dtype(bad).name):
            nccl_datatype(bad)


@pytest.mark.skipif(bfloat16_dtype() is None, reason="needs ml_dtypes")
def test_bfloat16_before_nccl_2_10_3_moves_as_float16_and_cannot_reduce():
    bf16 = bfloat16_dtype()
    assert nccl_datatype(bf16, (2, 10, 3), reducing=True) == 9
    assert nccl_datatype(bf16, (2, 9, 9)) == NCCL_DATATYPES["float16"]
    with pytest.raises(UnsupportedDtypeError, match=r"NCCL 2\.9\.9 cannot reduce bfloat16"):
        nccl_datatype(bf16, (2, 9, 9), reducing=True)


def test_constants_prefer_the_module_and_fall_back_to_nccl_h():
    fallback = nccl_constants()
    assert fallback["float32"] == 7 and fallback["op:avg"] == 4

    class OldCupyNccl:  # an old cupy: no NCCL_AVG, no NCCL_BFLOAT16
        NCCL_FLOAT32 = 7
        NCCL_SUM = 0

    codes = nccl_constants(OldCupyNccl)
    assert codes["op:avg"] == 4 and codes["bfloat16"] == 9 and codes["float32"] == 7


def test_table_matches_cupy_where_cupy_is_installed():
    nccl = _cupy_nccl()
    if nccl is None:
        pytest.skip("cupy.cuda.nccl does not import here")
    for name, code in NCCL_DATATYPES.items():
        assert getattr(nccl, f"NCCL_{name.upper()}") == code, name
    for name, code in NCCL_OPS.items():
        assert getattr(nccl, f"NCCL_{name.upper()}") == code, name


def test_reduction_plan_uses_ncclavg_only_on_floats_of_new_nccl():
    assert reduction_plan(ReduceOp.SUM, np.float32) == ("sum", False)
    assert reduction_plan(ReduceOp.PRODUCT, np.int64) == ("prod", False)
    assert reduction_plan(ReduceOp.MIN, np.float64) == ("min", False)
    assert reduction_plan(ReduceOp.MAX, np.uint8) == ("max", False)
    assert reduction_plan(ReduceOp.AVG, np.float32, (2, 21, 5)) == ("avg", False)
    assert reduction_plan(ReduceOp.AVG, np.float32, (2, 10, 3)) == ("avg", False)
    assert reduction_plan(ReduceOp.AVG, np.float32, (2, 8, 4)) == ("sum", True)
    assert reduction_plan(ReduceOp.AVG, np.int32, (2, 21, 5)) == ("sum", True)  # floor division, not NCCL's


def test_version_codes_of_both_encodings():
    assert nccl_version_tuple(2804) == (2, 8, 4)
    assert nccl_version_tuple(2708) == (2, 7, 8)
    assert nccl_version_tuple(20906) == (2, 9, 6)
    assert nccl_version_tuple(21003) == (2, 10, 3)
    assert nccl_version_tuple(23203) == (2, 32, 3)
    assert nccl_version_tuple(0) == (0, 0, 0)  # NCCL < 2.3.4 has no ncclGetVersion


# -- unique id -------------------------------------------------------------------------------------
def test_unique_id_bytes_accepts_cupy_14_bytes_and_older_signed_tuples():
    raw = bytes(range(128))
    assert unique_id_bytes(raw) == raw
    signed = unique_id_tuple(bytes(range(128, 256)))
    assert min(signed) == -128 and max(signed) == -1
    assert unique_id_bytes(signed) == bytes(range(128, 256))
    with pytest.raises(ValueError, match="128 bytes, got 5"):
        unique_id_bytes(b"12345")


def test_bootstrap_gives_every_rank_rank_zeros_id_over_a_broadcast():
    made = []

    def make_id():
        made.append(1)
        return bytes([7]) * 128

    def body(world):
        return bootstrap_unique_id(world.rank, _host_bytes_broadcast(world.backend), make_id)

    ids = ax.run_local(body, world_size=3)
    assert ids == [bytes([7]) * 128] * 3
    assert len(made) == 1  # only rank 0 asks NCCL


def test_bootstrap_with_a_fake_broadcast_function():
    sent = []

    def broadcast_bytes(payload):
        sent.append(payload)
        return b"\0" + bytes(range(128))

    assert bootstrap_unique_id(2, broadcast_bytes, lambda: pytest.fail("only rank 0 makes the id")) == bytes(range(128))
    assert sent == [bytes(129)]
    with pytest.raises(ValueError, match="returned 3 bytes"):
        bootstrap_unique_id(1, lambda payload: b"abc", lambda: None)


def test_bootstrap_failure_on_rank_zero_is_raised_on_every_rank():
    def make_id():
        raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR: no socket")

    def body(world):
        try:
            bootstrap_unique_id(world.rank, _host_bytes_broadcast(world.backend), make_id)
        except BackendUnavailableError as exc:
            return str(exc)
        return "no error"

    messages = ax.run_local(body, world_size=3)
    assert "no socket" in messages[0]
    assert all("rank 0 could not create the NCCL unique id" in m for m in messages)


def test_bootstrap_with_cupys_real_get_unique_id():
    nccl = _cupy_nccl()
    if nccl is None:
        pytest.skip("cupy.cuda.nccl does not import here")
    ids = ax.run_local(lambda w: bootstrap_unique_id(w.rank, _host_bytes_broadcast(w.backend), nccl.get_unique_id),
                       world_size=2)
    assert len(ids[0]) == 128 and ids[0] == ids[1]


def test_readiness_vote_names_the_ranks_that_are_not_ready_on_every_rank():
    def body(world):
        problem = "no CUDA device" if world.rank == 1 else None
        try:
            agree_ready(problem, _host_flag_gather(world.backend), world.default_group.ranks)
        except BackendUnavailableError as exc:
            return str(exc)
        return "ready"

    messages = ax.run_local(body, world_size=3)
    assert all("ranks [1] are not ready" in m for m in messages)
    assert "here: no CUDA device" in messages[1] and "here:" not in messages[0]
    assert ax.run_local(lambda w: agree_ready(None, _host_flag_gather(w.backend), (0, 1)) or "ok",
                        world_size=2) == ["ok", "ok"]


# -- the backend over fake cupy/NCCL ---------------------------------------------------------------
@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = FakeCupy()
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
    return cupy


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_on_device_arrays_go_to_nccl_and_give_closed_form_results(fake_cupy, n):
    nccl = FakeNccl()

    def body(world):
        r = world.rank
        x = device(np.full(5, r + 1.0, dtype=np.float32))
        ax.all_reduce(x)
        assert isinstance(x, DeviceArray) and x.tolist() == [n * (n + 1) / 2] * 5
        m = device(np.full(3, r, dtype=np.int64))
        ax.all_reduce(m, "max")
        assert m.tolist() == [n - 1] * 3
        a = device(np.full(4, float(r), dtype=np.float64))
        ax.all_reduce(a, "avg")
        assert np.allclose(a, (n - 1) / 2)
        i = device(np.full(2, r, dtype=np.int32))
        ax.all_reduce(i, "avg")  # integer mean floors
        assert i.tolist() == [sum(range(n)) // n] * 2
        h = device(np.full(6, r + 0.5, dtype=np.float16))
        ax.all_reduce(h)  # widened to float32 by the collective layer
        assert h.dtype == np.float16 and np.allclose(h.astype(np.float32), sum(k + 0.5 for k in range(n)))
        b = device(np.arange(4, dtype=np.int32) * (r + 1))
        ax.broadcast(b, src=n - 1)
        assert b.tolist() == [0, n, 2 * n, 3 * n]
        g = ax.all_gather(device(np.array([r, 10 * r], dtype=np.float32)))
        assert isinstance(g, DeviceArray) and g.tolist() == [[k, 10 * k] for k in range(n)]
        rs = ax.reduce_scatter(device(np.arange(2 * n, dtype=np.float64)))
        assert rs.tolist() == [n * 2 * r, n * (2 * r + 1)]
        ga = ax.gather(device(np.array([r + 1], dtype=np.uint8)), dst=0)
        if r == 0:
            assert ga.tolist() == [[k + 1] for k in range(n)]
        src = device(np.arange(3 * n, dtype=np.float32).reshape(n, 3)) if r == 0 else None
        part = ax.scatter(src, 0)
        assert isinstance(part, DeviceArray) and part.tolist() == [3 * r, 3 * r + 1, 3 * r + 2]
        ax.barrier()  # host barrier
        work = ax.all_reduce(device(np.ones(2, dtype=np.float32)), async_op=True)
        work.wait()
        host = np.ones(3)
        ax.all_reduce(host)  # numpy arrays still go to the host backend
        assert host.tolist() == [n] * 3
        return world.backend.name

    assert run_device_world(body, n, nccl) == ["local+nccl"] * n
    calls = [c[1] for c in nccl.calls if c[0] == 0]
    if n > 1:
        assert "allReduce" in calls and "broadcast" in calls and "allGather" in calls and "reduceScatter" in calls
        # the float AVG used ncclAvg; the integer AVG used SUM (then floor division)
        ops = [c[4] for c in nccl.calls if c[0] == 0 and c[1] == "allReduce"]
        assert NCCL_OPS["avg"] not in ops  # the collective layer sends AVG as SUM (see the backend contract)
        p2p = [c for c in nccl.calls if c[1] in ("send", "recv")]
        assert p2p and all(c[-1] for c in p2p), "gather/scatter sends and receives must be grouped"


def test_direct_backend_avg_uses_ncclavg_on_floats_and_sum_then_floor_on_integers(fake_cupy):
    nccl = FakeNccl(version=22105)

    def body(world):
        be = world.backend.device
        f = device(np.full(2, world.rank * 2.0, dtype=np.float32))
        be.all_reduce(f, ReduceOp.AVG, False)
        i = device(np.full(2, world.rank * 3, dtype=np.int64))
        be.all_reduce(i, ReduceOp.AVG, False)
        return f.tolist(), i.tolist()

    assert run_device_world(body, 2, nccl) == [([1.0, 1.0], [1, 1])] * 2
    ops = [c[4] for c in nccl.calls if c[0] == 0 and c[1] == "allReduce"]
    assert ops[-2:] == [NCCL_OPS["avg"], NCCL_OPS["sum"]]


def test_waits_order_the_callers_stream_and_only_a_barrier_or_a_timeout_waits_on_the_host(fake_cupy):
    def body(world):
        be = world.backend.device
        x = device(np.ones(3, dtype=np.float32))
        with fake_cupy.cuda.Stream() as stream, count_syncs() as log:
            be.all_reduce(x, ReduceOp.SUM, False)  # blocking
            be.all_gather(x, device(np.zeros(3 * world.world_size, dtype=np.float32)), True).wait()
            be.reduce_scatter(device(np.ones(3 * world.world_size, dtype=np.float32)), x, ReduceOp.SUM, True).wait()
            be.send(x, (world.rank + 1) % 2, 0, False) if world.rank == 0 else be.recv(x, 0, 0, False)
            ordered, host_before_barriers = stream.waited, list(log)
            be.barrier(False)
            be.barrier(True).wait()
            work = be.all_reduce(x, ReduceOp.SUM, True)
            work.wait(timeout=5.0)  # a host clock: polls the event, never orders the stream
            return ordered, stream.waited, host_before_barriers, [e.split(" ")[0] for e in log], x.tolist()

    for ordered, waited, early, log, _ in run_device_world(body, 2, FakeNccl()):
        assert ordered == 4 and waited == 4 and early == []
        assert log == ["event.synchronize", "event.synchronize"], log  # the two barriers


def test_old_nccl_finishes_avg_with_a_division_on_the_stream(fake_cupy):
    nccl = FakeNccl(version=2804)

    def body(world):
        f = device(np.full(2, world.rank * 2.0, dtype=np.float32))
        world.backend.device.all_reduce(f, ReduceOp.AVG, False)
        return f.tolist()

    assert run_device_world(body, 2, nccl) == [[1.0, 1.0]] * 2
    assert NCCL_OPS["avg"] not in [c[4] for c in nccl.calls if c[1] == "allReduce"]


def test_nonblocking_sends_and_receives_are_issued_together_in_one_group(fake_cupy):
    """A ring step (irecv from the left, isend to the right, wait) must not deadlock on NCCL."""
    nccl = FakeNccl()

    def body(world):
        n, r = world.world_size, world.rank
        into = device(np.zeros(4, dtype=np.float32))
        works = [ax.irecv(into, (r - 1) % n, tag=5), ax.isend(device(np.full(4, float(r))).astype(np.float32),
                                                               (r + 1) % n, tag=5)]
        for w in works:
            w.wait()
        return into.tolist()

    assert run_device_world(body, 3, nccl) == [[2.0] * 4, [0.0] * 4, [1.0] * 4]
    p2p = [c for c in nccl.calls if c[1] in ("send", "recv")]
    assert len(p2p) == 6 and all(in_group for *_, in_group in p2p)


@pytest.mark.parametrize("algorithm", ["ring", "rhd", "hierarchical"])
def test_point_to_point_all_reduce_algorithms_run_on_device_arrays(fake_cupy, algorithm):
    def body(world):
        x = device(np.arange(7, dtype=np.float64) + world.rank)
        ax.all_reduce(x, algorithm=algorithm)
        return x.tolist()

    n = 3
    expected = (np.arange(7.0) * n + sum(range(n))).tolist()
    assert run_device_world(body, n) == [expected] * n


@pytest.mark.parametrize("algorithm", ["ring", "rhd"])
def test_ring_and_rhd_min_max_of_device_arrays_order_signed_zeros(fake_cupy, algorithm):
    """The point-to-point algorithms fold device arrays with cupy's ufuncs: -0.0 is below +0.0 there too.

    (NCCL's own MIN/MAX, for the native call on device arrays, is not covered: docs/collectives.md.)
    """
    n = 3
    values = [[-0.0 if c >> k & 1 else 0.0 for k in range(n)] for c in range(2 ** n)]
    values += [[0.0, np.nan, -0.0], [-0.0, 0.0, 1.0], [0.0, -1.0, -0.0]]
    rows = np.array(values).T

    def body(world):
        got = {}
        for op in ("min", "max"):
            x = device(rows[world.rank].astype(np.float32))
            ax.all_reduce(x, op, algorithm=algorithm)
            got[op] = x.get()
        return got

    results = run_device_world(body, n)
    nan = np.isnan(rows).any(axis=0)
    negative_zero, positive_zero = (rows == 0) & np.signbit(rows), (rows == 0) & ~np.signbit(rows)
    for op, extreme, sign in (("min", np.nanmin(rows, axis=0), negative_zero.any(axis=0)),
                              ("max", np.nanmax(rows, axis=0), ~positive_zero.any(axis=0))):
        want = np.where(extreme == 0, np.where(sign, -0.0, 0.0), extreme).astype(np.float32)
        for rank, got in enumerate(results):
            assert np.isnan(got[op]).tolist() == nan.tolist(), (op, rank)
            assert got[op][~nan].view(np.uint32).tolist() == want[~nan].view(np.uint32).tolist(), \
                f"{op} on rank {rank}: {got[op].tolist()}, want {want.tolist()}"


def test_subgroups_get_their_own_nccl_communicator(fake_cupy):
    nccl = FakeNccl()

    def body(world):
        sub = world.new_group([0, 2])
        half = world.split(world.rank % 2)
        out = {}
        if sub.is_member:
            x = device(np.full(2, world.rank, dtype=np.int32))
            ax.all_reduce(x, group=sub)
            out["sub"] = x.tolist()
        y = device(np.full(1, world.rank + 1.0, dtype=np.float32))
        ax.all_reduce(y, group=half)
        out["half"] = y.tolist()
        assert half.backend.global_ranks == half.ranks
        return out

    res = run_device_world(body, 4, nccl)
    assert res[0]["sub"] == res[2]["sub"] == [2, 2] and "sub" not in res[1]
    assert [r["half"] for r in res] == [[4.0], [6.0], [4.0], [6.0]]
    assert len(nccl._hubs) >= 4  # world, [0, 2], and the two halves


def test_nccl_backend_refuses_on_every_rank_when_one_rank_cannot_start(fake_cupy):
    nccl = FakeNccl()
    broken = FakeNccl()
    broken.available = False

    def body(world):
        from axonhpc.backends.nccl import NCCLBackend as B

        try:
            B(world.backend, fake_cupy, broken if world.rank == 1 else nccl)
        except BackendUnavailableError as exc:
            return str(exc)
        return "started"

    messages = ax.run_local(body, world_size=3)
    assert all("ranks [1] are not ready" in m for m in messages)
    assert "cupy cannot load NCCL" in messages[1]


def test_a_bytes_only_or_tuple_only_communicator_both_work(fake_cupy):
    """cupy >= 14 takes the id as bytes, older cupy as a tuple of signed chars."""
    seen = []
    nccl = FakeNccl()
    real = nccl.NcclCommunicator

    class TupleOnly:
        def __new__(cls, ndev, commId, rank):
            if not isinstance(commId, tuple):
                raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
            seen.append(len(commId))
            return real(ndev, unique_id_bytes(commId), rank)

    nccl.NcclCommunicator = TupleOnly
    ax.run_local(lambda w: NCCLBackend(w.backend, fake_cupy, nccl) and None, world_size=2)
    assert seen == [128, 128]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_gpu_suite_holds_against_the_fakes(fake_cupy, monkeypatch, n):
    """test_gpu_collectives' suite (never run on a GPU) checked against the fakes, so its expectations are right."""
    import test_gpu_collectives as gpu

    monkeypatch.setattr(gpu, "cupy", fake_cupy)
    run_device_world(lambda world: gpu._collective_suite(world), n)


def test_debug_mode_names_a_rank_that_mixes_device_and_host_arrays(fake_cupy):
    """In a world with NCCL the two kinds go to different backends: debug mode reports it instead of hanging."""
    from axonhpc.errors import CollectiveMismatchError

    def body(world):
        world.default_group.debug = True
        x = device(np.ones(3, dtype=np.float32)) if world.rank == 0 else np.ones(3, dtype=np.float32)
        try:
            ax.all_reduce(x)
        except CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    messages = run_device_world(body, 2)
    assert all("rank 0 called all_reduce float32 on device (3,)" in m and "rank 1 called all_reduce float32 (3,)" in m
               for m in messages), messages


@pytest.mark.parametrize("strategy", [None, "full_shard", "shard_grad_op", "no_shard"])
def test_the_gpu_ddp_and_fsdp_parity_tests_hold_against_the_fakes(fake_cupy, monkeypatch, strategy):
    """DDP (strategy None) and FSDP parity from test_gpu_collectives, over the fakes on 2 thread ranks."""
    import test_gpu_collectives as gpu

    monkeypatch.setattr(gpu, "cupy", fake_cupy)
    body = gpu._ddp_parity if strategy is None else (lambda world: gpu._fsdp_parity(world, strategy))
    run_device_world(body, 2)
