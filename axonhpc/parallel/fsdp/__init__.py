"""Fully sharded data parallelism (ZeRO-2/3, hybrid sharding, CPU offload, mixed precision).

- ``wrapper``: ``FullyShardedDataParallel``, the units, their hooks and the step.
- ``flat_param``: one unit's padded flat parameter, its shard, gather, free and reduce.
- ``config``: the options (``ShardingStrategy``, ``CPUOffload``, ``MixedPrecision``).
- ``memory``: what FSDP holds and sends (``FSDPMemoryStats``).
- ``state``: full and sharded state dicts, and resharding on load.
"""
from .config import CPUOffload, MixedPrecision, ShardingStrategy
from .flat_param import MovedGradient, fsdp_role, moved
from .memory import FSDPMemoryStats
from .wrapper import FSDP, FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel", "ShardingStrategy", "CPUOffload", "MixedPrecision", "FSDPMemoryStats",
           "MovedGradient", "fsdp_role", "moved"]
