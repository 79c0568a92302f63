"""Device binding, backend choice and the device path's clear errors, without a GPU.

The facts (is cupy there, how many devices, which NCCL) are injected, so the
decisions are tested the same on every machine. ``init`` is run end to end in
a one-rank job (a plain ``python`` subprocess) with ``fake_cuda`` standing in
for cupy and NCCL; the refusals run against this machine, which has no GPU.
"""
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends.base import CompletedWork
from axonhpc.backends.devices import (
    DeviceFacts,
    check_one_device_per_rank,
    choose_backend,
    device_facts,
    device_problem,
    select_device,
    visible_device_list,
)
from axonhpc.backends.dispatch import DeviceDispatchBackend
from axonhpc.backends.local import LocalBackend
from axonhpc.bench import allreduce_gpu
from axonhpc.errors import BackendUnavailableError
from support.fake_cuda import FakeCupy, device
from support.paths import ROOT

GOOD = DeviceFacts("13.3.0", 4, (2, 21, 5))


def _kinds(choice):
    return choice.host, choice.device


def _has_device():
    facts = device_facts()
    return facts.cupy is not None and facts.devices > 0


# -- device binding --------------------------------------------------------------------------------
def test_visible_device_list():
    assert visible_device_list({}) is None
    assert visible_device_list({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_device_list({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_device_list({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-11c0"}) == ["GPU-8f2a", "GPU-11c0"]
    assert visible_device_list({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]  # CUDA stops at an invalid entry


def test_one_visible_device_is_device_zero_whatever_the_local_rank():
    """SLURM's gpu template (and --gpu-bind) leave each rank exactly one device."""
    choice = select_device(3, 1, {"CUDA_VISIBLE_DEVICES": "3"})
    assert (choice.index, choice.shared, choice.physical) == (0, False, "3")
    assert "the only visible device (CUDA_VISIBLE_DEVICES=3)" == choice.reason
    assert select_device(0, 1, {}).reason == "the only visible device"


def test_several_visible_devices_are_taken_by_local_rank():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    picks = [select_device(r, 4, env) for r in range(4)]
    assert [c.index for c in picks] == [0, 1, 2, 3]
    assert [c.physical for c in picks] == ["4", "5", "6", "7"]
    assert not any(c.shared for c in picks)
    assert picks[2].reason == "local rank 2 of 4 visible devices"


def test_more_ranks_than_devices_share_and_nccl_refuses_that():
    choice = select_device(5, 4, {})
    assert (choice.index, choice.shared) == (1, True) and "shared" in choice.reason
    why = check_one_device_per_rank(choice, local_size=8)
    assert "8 ranks on this node share 4 visible CUDA device(s)" in why
    assert check_one_device_per_rank(select_device(0, 4, {}), local_size=4) is None


def test_the_count_comes_from_the_environment_when_the_runtime_did_not_say():
    assert select_device(1, None, {"CUDA_VISIBLE_DEVICES": "0,1"}).index == 1


def test_no_visible_device_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match=r"no CUDA device is visible to local rank 2 "
                                                      r"\(CUDA_VISIBLE_DEVICES=''\)"):
        select_device(2, None, {"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        select_device(0, 0, {})


# -- device facts -------------------------------------------------------------------------------
def _importer(cupy=None, nccl=None, cupy_error=None):
    def import_module(name):
        if name == "cupy":
            if cupy_error is not None:
                raise cupy_error
            return cupy
        if name == "cupy.cuda.nccl":
            if nccl is None:
                raise ImportError("libnccl.so.2: cannot open shared object file")
            return nccl
        raise ImportError(name)

    return import_module


def test_device_facts_turn_every_failure_into_a_reason():
    facts = device_facts(_importer(cupy_error=ImportError("libcudart.so.12 not found")))
    assert facts.cupy is None and "cupy failed to import: ImportError: libcudart.so.12 not found" in facts.problems[0]

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    cupy = types.SimpleNamespace(__version__="14.2.0", cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=no_driver)))
    nccl = types.SimpleNamespace(available=True, get_version=lambda: 23203)
    facts = device_facts(_importer(cupy, nccl))
    assert (facts.cupy, facts.devices, facts.nccl) == ("14.2.0", 0, (2, 32, 3))
    assert device_problem(facts).startswith("no usable CUDA device: RuntimeError: cudaErrorInsufficientDriver")

    facts = device_facts(_importer(FakeCupy(devices=2), None))
    assert facts.devices == 2 and facts.nccl is None and "NCCL is not usable" in device_problem(facts)
    facts = device_facts(_importer(FakeCupy(devices=2), types.SimpleNamespace(available=False)))
    assert "cupy cannot load NCCL" in device_problem(facts)
    facts = device_facts(_importer(FakeCupy(devices=0), nccl))
    assert device_problem(facts) == "no CUDA device is visible to this process"
    assert device_problem(device_facts(_importer(FakeCupy(devices=1), nccl))) is None


# -- backend choice ------------------------------------------------------------------------------
def test_auto_takes_nccl_only_when_everything_is_there():
    assert _kinds(choose_backend("auto", GOOD, True)) == ("mpi", "nccl")
    no_device = DeviceFacts("13.3.0", 0, (2, 21, 5), ("no CUDA device is visible to this process",))
    choice = choose_backend("auto", no_device, True)
    assert _kinds(choice) == ("mpi", None) and "no CUDA device" in choice.reason
    assert _kinds(choose_backend("auto", GOOD, False)) == ("local", None)


def test_explicit_choices():
    assert _kinds(choose_backend("mpi", GOOD, True)) == ("mpi", None)  # device arrays through MPI
    assert _kinds(choose_backend("local", None, False)) == ("local", None)
    assert _kinds(choose_backend("nccl", GOOD, True)) == ("mpi", "nccl")
    with pytest.raises(BackendUnavailableError, match="backend 'mpi' needs mpi4py"):
        choose_backend("mpi", GOOD, False)
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        choose_backend("gloo", GOOD, True)


@pytest.mark.parametrize("facts,reason", [
    (DeviceFacts(problems=("cupy is not installed (pip install axonhpc[gpu])",)), "cupy is not installed"),
    (DeviceFacts("13.3.0", 0, (2, 21, 5), ("no CUDA device is visible to this process",)), "no CUDA device"),
    (DeviceFacts("13.3.0", 2, None, ("cupy cannot load NCCL (install nvidia-nccl-cu12, part of axonhpc[gpu])",)),
     "cupy cannot load NCCL"),
    (DeviceFacts("13.3.0", 2, None), "missing NCCL"),
])
def test_nccl_without_its_parts_says_which_is_missing(facts, reason):
    with pytest.raises(BackendUnavailableError, match=f"backend 'nccl' cannot work here: {reason}"):
        choose_backend("nccl", facts, True)


def test_nccl_needs_mpi_for_its_bootstrap():
    with pytest.raises(BackendUnavailableError, match="NCCL's unique id is broadcast over MPI"):
        choose_backend("nccl", GOOD, False)


def test_init_nccl_here_refuses_before_touching_mpi():
    if _has_device():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(BackendUnavailableError, match="backend 'nccl' cannot work here: (cupy|no usable CUDA|no CUDA)"):
        ax.groups.runtime.init(backend="nccl", comm=object())


# -- dispatch ---------------------------------------------------------------------------------------
class _Recorder:
    """A device backend that records what reaches it."""

    name = "fake"

    def __init__(self, host):
        self.host, self.calls, self.global_ranks = host, [], tuple(host.global_ranks)
        self.rank, self.size = host.rank, host.size

    def __getattr__(self, op):
        def call(*args):
            self.calls.append(op)
            return CompletedWork(args[1] if op in ("all_gather", "reduce_scatter", "gather", "scatter") else None)

        return call


def test_dispatch_sends_device_arrays_to_the_device_backend_and_the_rest_to_the_host(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    host = LocalBackend.create_world(1)[0]
    host.announce = lambda seq, op: ("announced", seq, op)
    made = []

    def make_device(h):
        made.append(h)
        return _Recorder(h)

    be = DeviceDispatchBackend(host, make_device)
    assert be.name == "local+fake" and (be.rank, be.size) == (0, 1)
    x, d = np.ones(3), device(np.ones(3))
    be.all_reduce(x, ax.ReduceOp.SUM, False)
    be.all_reduce(d, ax.ReduceOp.SUM, False)
    be.broadcast(d, 0, False)
    be.all_gather(d, device(np.empty((1, 3))), False)
    be.reduce_scatter(d, device(np.empty(3)), ax.ReduceOp.SUM, False)
    be.gather(d, None, 0, False)
    be.scatter(None, device(np.empty(3)), 0, False)
    be.send(d, 0, 1, True)
    be.recv(d, 0, 1, True)
    be.barrier(False)  # the host's
    # every host call first issues the device side's queued messages (NCCL's isend/irecv)
    assert be.device.calls == ["issue_queued", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "gather",
                               "scatter", "send", "recv", "issue_queued"]
    assert be.announce(4, "all_reduce") == ("announced", 4, "all_reduce")
    be.global_ranks = (7,)
    assert host.global_ranks == be.device.global_ranks == (7,)
    sub = be.split(0, 0)
    assert isinstance(sub, DeviceDispatchBackend) and len(made) == 2 and made[1] is sub.host
    assert be.split(None, 0) is None


def test_bench_gpu_table_and_refusal():
    row = allreduce_gpu.row(1 << 20, 4, {"nccl": 1e-4, "mpi-staged": 4e-4})
    assert row["nccl_us"] == pytest.approx(100.0) and row["mpi-direct_us"] is None
    assert row["nccl_busbw"] == pytest.approx((1 << 20) / 1e-4 / 1e9 * 1.5)
    assert row["staged_over_nccl"] == pytest.approx(4.0)
    assert row["bound_us"] is None and row["bound_over_pipelined"] is None  # stages not timed
    piped = allreduce_gpu.row(64 << 20, 2, {"pipelined": 0.05, "d2h": 0.01, "host": 0.04, "h2d": 0.012})
    assert piped["bound_us"] == pytest.approx(40000.0) and piped["serial_us"] == pytest.approx(62000.0)
    assert piped["bound_over_pipelined"] == pytest.approx(0.8) and piped["pipelined_us"] == pytest.approx(50000.0)
    assert "0.80" in allreduce_gpu.format_table([piped], 2, [])
    table = allreduce_gpu.format_table([row], 4, ["# mpi-direct: n/a (MPI is not CUDA-aware: test)"])
    assert "1 MiB" in table and "n/a" in table and "mpi-direct: n/a" in table
    assert allreduce_gpu.bus_factor(1) == 1.0 and allreduce_gpu.bus_factor(2) == 1.0
    assert allreduce_gpu.refusal(GOOD) is None
    assert allreduce_gpu.refusal(DeviceFacts(problems=("cupy is not installed",))) == \
        "no CUDA device: cupy is not installed"


def test_bench_allreduce_device_gpu_refuses_without_a_device():
    if _has_device():
        pytest.skip("this machine has a CUDA device")
    out = subprocess.run([sys.executable, "-m", "axonhpc", "bench", "allreduce", "--device", "gpu"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "axonhpc bench allreduce --device gpu: no CUDA device: " in out.stderr
    bad = subprocess.run([sys.executable, "-m", "axonhpc", "bench", "allreduce", "--device", "gpu", "--algorithms",
                          "ring"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "does not combine with --device gpu" in bad.stderr


# -- init end to end with fake cupy/NCCL (one rank, no mpiexec) ----------------------------------------
INIT_SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
from support import fake_cuda
cupy, nccl = fake_cuda.install(sys.modules, devices={devices})
import axonhpc as ax
from axonhpc.backends import staging
if {numpy_staging}:  # numpy buffers in place of pinned ones (the fakes have no cupyx)
    staging._default = staging.Staging(staging.HostBuffers(lambda n: np.empty(n, dtype=np.uint8)),
        staging.DeviceCopies(lambda d, h: d.get(out=h), lambda h, d: d.set(h),
                             lambda: None))
world = ax.init()
x = fake_cuda.device(np.arange(3.0))
world.backend.all_reduce(x, ax.ReduceOp.SUM, False)
facts = ax.info()
print(json.dumps(dict(backend=world.backend.name, bound=cupy.bound, device=facts.get("device"),
                      device_arrays=facts.get("device_arrays"), nccl=facts.get("nccl"), x=x.tolist(),
                      calls=[c[1] for c in nccl.calls])))
"""


def _init_with_fakes(devices, numpy_staging=True, **env_extra):
    code = INIT_SCRIPT.format(tests=os.path.join(ROOT, "tests"), devices=devices, numpy_staging=numpy_staging)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_init_auto_binds_the_device_and_puts_device_arrays_on_nccl():
    out = _init_with_fakes(2, CUDA_VISIBLE_DEVICES="6,7")
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["backend"] == "mpi+nccl"
    assert got["bound"] == [0]  # local rank 0 of 2 visible devices
    assert got["device"] == "cuda:0, CUDA_VISIBLE_DEVICES entry 6 (local rank 0 of 2 visible devices)"
    assert got["device_arrays"].startswith("nccl: auto: cupy, a CUDA device and NCCL are present")
    assert got["nccl"] == "2.32.3"
    assert got["x"] == [0.0, 1.0, 2.0] and "allReduce" in got["calls"]


def test_init_mpi_keeps_device_arrays_on_mpi_but_still_binds():
    out = _init_with_fakes(1, AXONHPC_BACKEND="mpi", AXONHPC_CUDA_AWARE_MPI="no")
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["backend"] == "mpi" and got["bound"] == [0] and got["calls"] == []
    assert got["device_arrays"].startswith("mpi: backend='mpi' asked for")


def test_init_auto_without_a_device_uses_mpi_and_says_why():
    out = _init_with_fakes(0)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["backend"] == "mpi" and got["bound"] == [] and got["device"] is None
    assert got["device_arrays"] == "mpi: auto: device arrays go through MPI (no CUDA device is visible to this process)"


def test_init_nccl_without_a_device_refuses():
    out = _init_with_fakes(0, AXONHPC_BACKEND="nccl")
    assert out.returncode != 0
    assert "BackendUnavailableError: backend 'nccl' cannot work here: no CUDA device is visible" in out.stderr


def test_device_arrays_on_mpi_fail_clearly_when_no_device_path_works():
    """Not CUDA-aware, and no pinned host memory to stage through: say both, do not crash."""
    out = _init_with_fakes(1, numpy_staging=False, AXONHPC_BACKEND="mpi")
    assert out.returncode != 0
    assert "BackendUnavailableError: cupy arrays reached the MPI backend, MPI is not CUDA-aware (" in out.stderr
    assert "and staging through pinned host memory failed: " in out.stderr  # here: the fakes have no cupyx


def test_every_rank_votes_so_one_rank_without_nccl_moves_all_to_mpi_or_fails_all():
    """A heterogeneous job: the vote is collective on every rank, whatever each found (no rank waits alone)."""
    from axonhpc.backends.devices import DeviceChoice
    from axonhpc.groups.device_path import agree_on_nccl

    own = DeviceChoice(0, 4, False, None, "local rank 0 of 4 visible devices")  # 4 >= the local world's 3 ranks
    shared = DeviceChoice(0, 1, True, None, "shared")
    no_device = DeviceFacts("13.3.0", 0, (2, 21, 5), ("no CUDA device is visible to this process",))

    def auto(world):
        if world.rank == 1:
            got_world, got = agree_on_nccl(world, "auto", choose_backend("auto", no_device, True), no_device, None)
        else:
            got_world, got = agree_on_nccl(world, "auto", choose_backend("auto", GOOD, True), GOOD, own,
                                           make_device=_Recorder)
        return got_world.backend.name, got.device, got.reason

    results = ax.run_local(auto, world_size=3)
    assert [r[:2] for r in results] == [("local", None)] * 3
    assert results[0][2].startswith("auto: ranks [1] cannot use NCCL, so device arrays go through MPI")
    assert "no CUDA device" in results[1][2]

    def nccl(world):
        try:
            agree_on_nccl(world, "nccl", choose_backend("nccl", GOOD, True), GOOD, shared if world.rank == 2 else own)
        except BackendUnavailableError as exc:
            return str(exc)

    messages = ax.run_local(lambda w: (w.__setattr__("local_size", 2), nccl(w))[1], world_size=3)
    assert all("backend 'nccl' cannot work on ranks [2]" in m for m in messages)
    assert "2 ranks on this node share 1 visible CUDA device(s)" in messages[2]

    def everyone(world):
        got_world, got = agree_on_nccl(world, "auto", choose_backend("auto", GOOD, True), GOOD, own,
                                       make_device=_Recorder)
        return got_world.backend.name, got.device

    assert ax.run_local(everyone, world_size=2) == [("local+fake", "nccl")] * 2
