"""axonhpc: MPI-native distributed training for HPC clusters.

``import axonhpc`` works with none of the optional extras installed and does
not initialise MPI: that happens in ``ax.init()`` (or at the first collective
on the default group).
"""
from . import errors
from .backends import LocalBackend, ReduceOp, Work
from .collectives import (
    all_gather,
    all_reduce,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_product,
    all_reduce_sum,
    barrier,
    broadcast,
    gather,
    get_rank,
    get_world_size,
    irecv,
    is_main_process,
    isend,
    recv,
    reduce_scatter,
    reduce_scatter_mean,
    reduce_scatter_sum,
    scatter,
    send,
    sync_gradient,
    sync_gradients,
)
from .groups import Mesh, ProcessGroup, World, current_world, init, is_initialized, run_local
from .info import info
from .settings import settings

__version__ = "0.1.0"

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
    "Pipeline": "axonhpc.parallel",
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
}
_SUBMODULES = ("nn", "optim", "data", "bucketing", "comm", "backends", "settings", "cli", "bench", "parallel",
               "checkpoint")


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"axonhpc.{name}")
    raise AttributeError(f"module 'axonhpc' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


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
    "ReduceOp",
    "Work",
    "LocalBackend",
    "MPIBackend",
    "all_reduce",
    "all_reduce_sum",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_max",
    "all_reduce_product",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce_scatter_sum",
    "reduce_scatter_mean",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "sync_gradient",
    "sync_gradients",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "GradientBucket",
    "GradientSynchronizer",
    "GradSyncStrategy",
    "pack",
    "unpack",
    "shard_bounds",
    "DDP",
    "DistributedDataParallel",
    "Pipeline",
    "PipelineStage",
    "PipelineSchedule",
    "Action",
    "pipeline_schedule",
    "simulate_pipeline",
    "PipelineMemoryStats",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "TensorParallelAttention",
]
