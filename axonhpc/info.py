"""``ax.info()``: what this installation and this job are running on."""
from __future__ import annotations

import importlib.util
import platform
import sys
from typing import Any, Dict

import numpy as np

from ._dtypes import bfloat16_dtype
from .groups import is_initialized, current_world

_THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def _mpi_facts() -> Dict[str, Any]:
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as exc:
        return {"mpi4py": None, "mpi_error": str(exc)}
    version_line = MPI.Get_library_version().strip().splitlines()[0]
    return {
        "mpi4py": mpi4py.__version__,
        "mpi_library": " ".join(version_line.split()),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "mpi_vendor": "%s %s" % (MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
        "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        # Detecting CUDA-aware MPI safely belongs to the GPU path, which this
        # version does not have: say so instead of guessing.
        "cuda_aware_mpi": "not checked (no GPU path in this version)",
    }


def _gpu_facts() -> Dict[str, Any]:
    facts: Dict[str, Any] = {"cupy": None, "nccl": None}
    if importlib.util.find_spec("cupy") is None:
        return facts
    try:
        import cupy

        facts["cupy"] = cupy.__version__
        from cupy.cuda import nccl

        if getattr(nccl, "available", False):
            facts["nccl"] = str(nccl.get_version())
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        facts["gpu_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def info() -> Dict[str, Any]:
    """MPI vendor and version, thread level, CUDA-awareness, cupy/NCCL, ranks and nodes."""
    from . import __version__

    facts: Dict[str, Any] = {
        "axonhpc": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "bfloat16": bfloat16_dtype() is not None,
        "platform": sys.platform,
    }
    facts.update(_mpi_facts())
    facts.update(_gpu_facts())
    world = current_world() if (is_initialized() or facts.get("mpi4py")) else None
    if world is not None:
        facts.update(
            backend=world.backend.name,
            rank=world.rank,
            world_size=world.world_size,
            local_rank=world.local_rank,
            local_size=world.local_size,
            node_rank=world.node_rank,
            num_nodes=world.num_nodes,
        )
    return facts
