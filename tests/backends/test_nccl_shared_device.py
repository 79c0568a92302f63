"""Ranks that share a GPU: refused on every rank, naming them, before NCCL starts (no rank left waiting).

NCCL itself refuses such a communicator with NCCL_ERROR_INVALID_USAGE inside
``ncclCommInitRank`` (seen on a one-GPU H100 node with two ranks). Here the
ranks are threads over the in-process host backend and ``fake_cuda``'s NCCL;
each test gives the fake cupy the device identity each rank would report
(``cudaGetDevice`` and ``cudaDeviceGetPCIBusId``), which is all the check reads.
"""
import socket
import threading
import types

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends.devices import DeviceChoice, DeviceFacts, choose_backend
from axonhpc.backends.nccl import NCCLBackend
from axonhpc.backends.shared_device import (
    IDENTITY_BYTES,
    decode_identity,
    device_identity,
    encode_identity,
    shared_devices,
)
from axonhpc.errors import BackendUnavailableError
from support.fake_cuda import FakeCupy, FakeNccl, device, run_device_world

HOST = socket.gethostname()
BUS = "0000:1B:00.0"


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = FakeCupy()
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
    return cupy


def _give_devices(monkeypatch, cupy, bus_of_thread):
    """Make the fake's runtime report device 0 with the PCI bus id ``bus_of_thread()`` on each thread."""
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetPCIBusId", lambda index: bus_of_thread(), raising=False)


def _counting_unique_ids(nccl):
    made = []
    real = nccl.get_unique_id
    nccl.get_unique_id = lambda: made.append(1) or real()
    return made


# -- the pure parts ----------------------------------------------------------------------------------
def test_identity_is_host_and_pci_bus_as_nccl_compares_them():
    runtime = types.SimpleNamespace(getDevice=lambda: 1, deviceGetPCIBusId=lambda i: f"0000:{i + 26:02X}:00.0")
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    assert device_identity(fake, "gpu-07") == ("gpu-07/0000:1b:00.0", "cuda:1, PCI 0000:1B:00.0, on gpu-07")
    assert device_identity(types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=object())), "x") is None


def test_identities_travel_as_fixed_size_bytes():
    ident = ("node-a/0000:1b:00.0", "cuda:0, PCI 0000:1B:00.0, on node-a")
    raw = encode_identity(ident)
    assert len(raw) == IDENTITY_BYTES and decode_identity(raw) == ident
    assert encode_identity(None) == bytes(IDENTITY_BYTES) and decode_identity(bytes(IDENTITY_BYTES)) is None
    key, label = decode_identity(encode_identity(("k", "x" * 2 * IDENTITY_BYTES)))
    assert key == "k" and len(label) == IDENTITY_BYTES - 2  # the label is cut, the key kept
    with pytest.raises(ValueError, match=f"a device key of {IDENTITY_BYTES} bytes does not fit in {IDENTITY_BYTES}"):
        encode_identity(("k" * IDENTITY_BYTES, ""))


def test_shared_devices_groups_world_ranks_by_device_and_ignores_unknown_ones():
    a, b, c = ("h/a", "A"), ("h/b", "B"), ("g/a", "C on another host")
    assert shared_devices([a, b, a, None, c, b], (4, 5, 6, 7, 8, 9)) == [("A", [4, 6]), ("B", [5, 9])]
    assert shared_devices([a, None, None, c], range(4)) == []


# -- the NCCL backend on threads ----------------------------------------------------------------------
def test_ranks_sharing_a_gpu_are_refused_on_every_rank_before_nccl_starts(fake_cupy, monkeypatch):
    _give_devices(monkeypatch, fake_cupy, lambda: BUS)
    nccl = FakeNccl()
    made = _counting_unique_ids(nccl)

    def body(world):
        with pytest.raises(BackendUnavailableError) as err:
            NCCLBackend(world.backend, fake_cupy, nccl)
        return str(err.value)

    messages = ax.run_local(body, world_size=3)
    assert len(set(messages)) == 1
    assert messages[0].startswith(f"NCCL cannot start: ranks [0, 1, 2] share one GPU (cuda:0, PCI {BUS}, on {HOST}).")
    assert "one GPU per rank" in messages[0] and "ax.init(backend='mpi')" in messages[0]
    assert made == [] and nccl._hubs == {}  # no unique id made, no communicator joined


def test_only_the_ranks_that_share_are_named_and_every_rank_says_so(fake_cupy, monkeypatch):
    mine = threading.local()
    _give_devices(monkeypatch, fake_cupy, lambda: mine.bus)
    nccl = FakeNccl()

    def body(world):
        mine.bus = ["0000:01:00.0", "0000:02:00.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"][world.rank]
        try:
            NCCLBackend(world.backend, fake_cupy, nccl)
        except BackendUnavailableError as exc:
            return str(exc)
        return "started"

    messages = ax.run_local(body, world_size=5)
    assert len(set(messages)) == 1, messages
    assert (f"ranks [0, 2] share one GPU (cuda:0, PCI 0000:01:00.0, on {HOST}); "
            f"ranks [1, 3] share one GPU (cuda:0, PCI 0000:02:00.0, on {HOST})") in messages[0]
    assert "[4]" not in messages[0]


def test_a_subgroup_names_world_ranks(fake_cupy, monkeypatch):
    mine = threading.local()
    _give_devices(monkeypatch, fake_cupy, lambda: mine.bus)
    nccl = FakeNccl()

    def body(world):
        mine.bus = {1: "0000:01:00.0", 3: "0000:01:00.0"}.get(world.rank, f"0000:0{world.rank + 5}:00.0")
        sub = world.backend.create_group([1, 3])
        if sub is None:
            return None
        with pytest.raises(BackendUnavailableError, match=r"ranks \[1, 3\] share one GPU"):
            NCCLBackend(sub, fake_cupy, nccl)
        return "refused"

    assert ax.run_local(body, world_size=4) == [None, "refused", None, "refused"]


def test_ranks_on_distinct_gpus_start_and_reduce(fake_cupy, monkeypatch):
    _give_devices(monkeypatch, fake_cupy, lambda: f"0000:{threading.get_ident():x}:00.0")

    def body(world):
        x = device(np.full(3, world.rank + 1.0, dtype=np.float32))
        ax.all_reduce(x)
        return x.tolist()

    assert run_device_world(body, 3) == [[6.0] * 3] * 3


def test_one_rank_is_never_compared(fake_cupy, monkeypatch):
    _give_devices(monkeypatch, fake_cupy, lambda: BUS)
    assert run_device_world(lambda world: world.backend.name, 1) == ["local+nccl"]


# -- init: "auto" falls back to MPI, "nccl" refuses ----------------------------------------------------
GOOD = DeviceFacts("14.2.0", 2, (2, 28, 3))
OWN = DeviceChoice(0, 4, False, None, "local rank 0 of 4 visible devices")  # the counts see no sharing


def test_init_auto_falls_back_to_mpi_and_nccl_refuses_when_the_counts_miss_a_shared_gpu(fake_cupy, monkeypatch):
    from axonhpc.groups.device_path import agree_on_nccl

    _give_devices(monkeypatch, fake_cupy, lambda: BUS)
    nccl = FakeNccl()

    def make(host):
        return NCCLBackend(host, fake_cupy, nccl)

    def auto(world):
        got_world, got = agree_on_nccl(world, "auto", choose_backend("auto", GOOD, True), GOOD, OWN, make_device=make)
        return got_world.backend.name, got.device, got.reason

    results = ax.run_local(auto, world_size=2)
    assert [r[:2] for r in results] == [("local", None)] * 2
    assert results[0][2].startswith("auto: NCCL refused (NCCL cannot start: ranks [0, 1] share one GPU")
    assert results[0][2].endswith("so device arrays go through MPI")

    def strict(world):
        with pytest.raises(BackendUnavailableError, match=r"ranks \[0, 1\] share one GPU"):
            agree_on_nccl(world, "nccl", choose_backend("nccl", GOOD, True), GOOD, OWN, make_device=make)
        return "refused"

    assert ax.run_local(strict, world_size=2) == ["refused", "refused"]
    assert nccl._hubs == {}


# -- over real MPI processes (the multi-rank suite) -----------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_over_mpi_every_process_names_the_same_ranks(fake_cupy, monkeypatch, mpi_world):
    """Processes, not threads: the identities cross MPI (uint8 rows through MPIBackend.all_gather)."""
    from mpi4py import MPI

    from axonhpc.backends.mpi import MPIBackend
    from support.mpi_assert import collectively

    n, r = mpi_world.world_size, mpi_world.rank
    gpus = (n + 1) // 2  # ranks take turns: 2 ranks share 1 GPU, 3 ranks 2 (one alone), 4 ranks 2
    _give_devices(monkeypatch, fake_cupy, lambda: f"0000:{r % gpus + 1:02X}:00.0")
    groups = {}
    for k, host_name in enumerate(MPI.COMM_WORLD.allgather(socket.gethostname())):
        groups.setdefault((host_name, k % gpus + 1), []).append(k)
    want = [f"ranks {ranks} share one GPU (cuda:0, PCI 0000:{bus:02X}:00.0, on {host_name})"
            for (host_name, bus), ranks in groups.items() if len(ranks) > 1]
    alone = [ranks for ranks in groups.values() if len(ranks) == 1]
    if not want:  # the same on every rank: it comes from the gathered host names
        pytest.skip("no two ranks of this job are on one host")
    host = MPIBackend(MPI.COMM_WORLD)

    def check():
        with pytest.raises(BackendUnavailableError) as err:
            NCCLBackend(host, fake_cupy, FakeNccl())
        message = str(err.value)
        assert all(w in message for w in want), (want, message)
        assert not any(f"ranks {ranks} " in message for ranks in alone), message

    try:
        collectively(mpi_world, check)
    finally:
        host.free()
