"""Building an MPI world with its device path: binding each rank to a GPU, and NCCL when it can work.

[Note: how init sets up the device path]
1. Look at the devices and choose (``choose_backend``): "nccl" without cupy, a device or NCCL raises
   at once, naming what is missing.
2. Build the MPI world; its node layout gives each rank its local rank.
3. When cupy sees a device, bind this rank to one (``select_device``) on every backend choice.
4. For "auto" and "nccl" every rank votes over MPI on NCCL (a rank that cannot still votes, or the
   others would wait for it): "auto" uses NCCL only when every rank can, "nccl" raises on every rank
   when one cannot. NCCL then checks that no two ranks share a GPU ("auto" falls back to MPI, "nccl"
   raises). The world's backend becomes a ``DeviceDispatchBackend``. Without NCCL cupy arrays go to
   MPI, CUDA-aware or staged.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..backends.devices import (
    BackendChoice,
    DeviceChoice,
    DeviceFacts,
    bind_device,
    check_one_device_per_rank,
    choose_backend,
    device_facts,
    device_problem,
    select_device,
)
from ..errors import BackendUnavailableError
from ..settings import device_env, launcher_env
from .world import World

_report: Dict[str, Any] = {}


def _vote(world: World, ok: bool) -> List[int]:
    """Collective over the world's host backend: the global ranks that said no."""
    mine = np.array([1 if ok else 0], dtype=np.int32)
    table = np.empty((world.world_size, 1), dtype=np.int32)
    world.backend.all_gather(mine, table, async_op=False).wait()
    return [r for r, (flag,) in enumerate(table.tolist()) if not flag]


def build_world(requested: str, comm=None, facts: Optional[DeviceFacts] = None) -> World:
    """The world for ``init(backend=requested)`` when that is "auto", "mpi" or "nccl" (see the module note).

    Raises:
        BackendUnavailableError: the requested backend cannot work; for
            "nccl" on every rank once MPI is up.
    """
    facts = device_facts() if facts is None else facts
    try:
        from mpi4py import MPI
    except ImportError as exc:
        if requested == "mpi":
            raise BackendUnavailableError(f"backend 'mpi' needs mpi4py, which failed to import: {exc}") from exc
        MPI = None
    choice = choose_backend(requested, facts, MPI is not None)
    _report.clear()
    _report.update(requested=requested, facts=facts)
    if choice.host == "local":
        world = World.mock()
        world.launcher = launcher_env()
        world.warn_launcher_problems()
        _report.update(choice=choice)
        return world
    from ..backends.mpi import MPIBackend

    launcher = launcher_env() if comm is None else None
    world = World(MPIBackend(MPI.COMM_WORLD if comm is None else comm), launcher)
    binding: Optional[DeviceChoice] = None
    if facts.cupy is not None and facts.devices >= 1:
        binding = select_device(world.local_rank, facts.devices, device_env())
        bind_device(binding)
    if requested in ("auto", "nccl"):  # every rank votes, whatever it found, or the vote would hang
        world, choice = agree_on_nccl(world, requested, choice, facts, binding, launcher)
    world.warn_launcher_problems()
    _report.update(choice=choice, binding=binding)
    return world


def agree_on_nccl(world: World, requested: str, choice: BackendChoice, facts: DeviceFacts,
                  binding: Optional[DeviceChoice], launcher=None, make_device: Optional[Callable] = None) -> tuple:
    """Collective: vote on NCCL; (world, choice), the world over NCCL when every rank can use it.

    Args:
        choice: this rank's own choice (``choose_backend``).
        make_device: builds the device backend over a host backend (``NCCLBackend``).

    Raises:
        BackendUnavailableError: "nccl" and some rank cannot use it (on every rank, naming those ranks).
    """
    if choice.device != "nccl":
        problem: Optional[str] = device_problem(facts) or choice.reason
    elif binding is None:
        problem = device_problem(facts)
    else:
        problem = check_one_device_per_rank(binding, world.local_size)
    refused = _vote(world, problem is None)
    if refused:
        mine = f"; here: {problem}" if problem else ""
        if requested == "nccl":
            raise BackendUnavailableError(f"backend 'nccl' cannot work on ranks {refused}{mine} "
                                          f"(NCCL needs cupy, a CUDA device per rank and the NCCL library)")
        if choice.device != "nccl":
            return world, choice  # this rank's own reason says why
        return world, BackendChoice("mpi", None, f"auto: ranks {refused} cannot use NCCL, so device arrays "
                                                 f"go through MPI{mine}")
    from ..backends.dispatch import DeviceDispatchBackend

    if make_device is None:
        from ..backends.nccl import NCCLBackend as make_device
    try:
        backend = DeviceDispatchBackend(world.backend, make_device)
    except BackendUnavailableError as exc:
        # Raised on every rank alike (the backend's own votes: readiness, ranks sharing a GPU), so
        # every rank takes the same way out here.
        if requested == "nccl":
            raise
        return world, BackendChoice("mpi", None, f"auto: NCCL refused ({exc}), so device arrays go through MPI")
    return World(backend, launcher), choice


def device_report() -> Dict[str, Any]:
    """What ``init`` decided about devices: requested backend, facts, choice, binding (empty before ``init``)."""
    return dict(_report)


__all__ = ["build_world", "agree_on_nccl", "device_report"]
