"""Parallel strategies built on the collectives and the model layer."""
from . import comm_hooks
from .clipping import clip_grad_norm
from .comm_hooks import GradBucket, bf16_compress_hook, fp16_compress_hook
from .ddp import DDP, DistributedDataParallel, GradientAfterReductionError, UnusedParameterError
from .fsdp import FSDP, CPUOffload, FSDPMemoryStats, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from .gpt import ParallelGPT, TensorParallelBlock
from .grad_scaler import GradScaler
from .parameter_server import ParameterServer, ParameterServerError, PeerFailedError
from .pipeline import (Action, Pipeline, PipelineMemoryStats, PipelineSchedule, PipelineStage, SimulationResult,
                       chrome_trace, format_schedule_table, gather_timelines, pipeline_schedule, simulate_pipeline,
                       timeline_bubble, write_chrome_trace, write_gantt_png)
from .tensor import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .tensor import TensorParallelAttention
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "clip_grad_norm",
    "comm_hooks",
    "GradBucket",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "DDP",
    "DistributedDataParallel",
    "UnusedParameterError",
    "GradientAfterReductionError",
    "FSDP",
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "CPUOffload",
    "MixedPrecision",
    "FSDPMemoryStats",
    "GradScaler",
    "ParameterServer",
    "ParameterServerError",
    "PeerFailedError",
    "Pipeline",
    "PipelineStage",
    "PipelineSchedule",
    "Action",
    "pipeline_schedule",
    "format_schedule_table",
    "simulate_pipeline",
    "SimulationResult",
    "PipelineMemoryStats",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "gather_timelines",
    "timeline_bubble",
    "chrome_trace",
    "write_chrome_trace",
    "write_gantt_png",
    "TensorParallelAttention",
    "ZeroRedundancyOptimizer",
    "ParallelGPT",
    "TensorParallelBlock",
]
