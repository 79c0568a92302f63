"""axonhpc: MPI-native distributed training for HPC clusters.

``import axonhpc`` works with none of the optional extras installed and does
not initialise MPI: that happens in ``ax.init()`` (or at the first collective
on the default group).
"""
from . import errors
from ._version import __version__
from .backends import LocalBackend, ReduceOp, Work
from . import collectives as _collectives
from .collectives import *  # noqa: F401,F403 - the collectives are the top-level API
from .groups import Mesh, ProcessGroup, World, current_world, init, is_initialized, run_local
from .info import info
from .observe.log import get_logger
from .settings import settings

# Names loaded on first use: the compiled buffers and the model layer.
_LAZY = {
    "GradientBucket": "axonhpc.bucketing",
    "GradientSynchronizer": "axonhpc.bucketing",
    "GradSyncStrategy": "axonhpc.bucketing",
    "pack": "axonhpc.bucketing",
    "unpack": "axonhpc.bucketing",
    "shard_bounds": "axonhpc.bucketing",
    "MPIBackend": "axonhpc.backends.mpi",
    "DDP": "axonhpc.parallel",
    "DistributedDataParallel": "axonhpc.parallel",
    "FSDP": "axonhpc.parallel",
    "FullyShardedDataParallel": "axonhpc.parallel",
    "ShardingStrategy": "axonhpc.parallel",
    "CPUOffload": "axonhpc.parallel",
    "MixedPrecision": "axonhpc.parallel",
    "FSDPMemoryStats": "axonhpc.parallel",
    "GradScaler": "axonhpc.parallel",
    "Pipeline": "axonhpc.parallel",
    "DistributedTrainer": "axonhpc.trainer",
    "ParameterServer": "axonhpc.parallel",
    "PipelineStage": "axonhpc.parallel",
    "PipelineSchedule": "axonhpc.parallel",
    "Action": "axonhpc.parallel",
    "pipeline_schedule": "axonhpc.parallel",
    "simulate_pipeline": "axonhpc.parallel",
    "PipelineMemoryStats": "axonhpc.parallel",
    "ColumnParallelLinear": "axonhpc.parallel",
    "RowParallelLinear": "axonhpc.parallel",
    "TensorParallelMLP": "axonhpc.parallel",
    "TensorParallelAttention": "axonhpc.parallel",
    "ZeroRedundancyOptimizer": "axonhpc.parallel",
    "ParallelGPT": "axonhpc.parallel",
    "clip_grad_norm": "axonhpc.parallel",
    "TensorParallelBlock": "axonhpc.parallel",
    "gather_timelines": "axonhpc.parallel",
    "write_gantt_png": "axonhpc.parallel",
    "timeline": "axonhpc.observe.timeline",
    "graph_step": "axonhpc.cuda.graphs",
    "GraphedStep": "axonhpc.cuda.graphs",
    "defer_reads": "axonhpc.cuda.capture",
}
# Submodules loaded on first use; ``ax.tracing``, ``ax.profiling`` and ``ax.graphs`` keep the names they had
# before the cuda/ and observe/ packages.
_SUBMODULES = {name: f"axonhpc.{name}" for name in ("nn", "optim", "data", "bucketing", "comm", "backends",
                                                     "settings", "cli", "bench", "parallel", "checkpoint", "trainer")}
_SUBMODULES.update(tracing="axonhpc.observe.tracing", profiling="axonhpc.observe.timeline",
                   graphs="axonhpc.cuda.graphs")


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'axonhpc' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


# The public names: the core objects, every collective, and the lazily loaded names.
__all__ = [
    "errors",
    "settings",
    "init",
    "info",
    "World",
    "ProcessGroup",
    "Mesh",
    "run_local",
    "current_world",
    "is_initialized",
    "LocalBackend",
    "get_logger",
] + list(_collectives.__all__) + list(_LAZY)
