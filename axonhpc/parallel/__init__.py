"""Parallel strategies built on the collectives and the model layer."""
from . import comm_hooks
from .comm_hooks import GradBucket, bf16_compress_hook, fp16_compress_hook
from .ddp import DDP, DistributedDataParallel, GradientAfterReductionError, UnusedParameterError
from .fsdp import FSDP, FullyShardedDataParallel
from .fsdp_config import CPUOffload, MixedPrecision, ShardingStrategy
from .fsdp_memory import FSDPMemoryStats
from .gpt import ParallelGPT, TensorParallelBlock
from .grad_scaler import GradScaler
from .memory import PipelineMemoryStats
from .parameter_server import ParameterServer, ParameterServerError, PeerFailedError
from .pipeline import Pipeline, PipelineStage
from .schedules import Action, PipelineSchedule, format_schedule_table, pipeline_schedule
from .simulate import SimulationResult, simulate_pipeline
from .tensor import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .trace import chrome_trace, gather_timelines, timeline_bubble, write_chrome_trace, write_gantt_png
from .tensor import TensorParallelAttention
from .zero import ZeroRedundancyOptimizer

__all__ = [
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
