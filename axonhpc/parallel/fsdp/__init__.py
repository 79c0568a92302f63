"""Fully sharded data parallelism (ZeRO-2/3, hybrid sharding, CPU offload, mixed precision).

- ``wrapper``: ``FullyShardedDataParallel``, the object users hold: building it, the step, the public API.
- ``units``: which submodules become units, their parameters, the shard and replicate groups.
- ``hooks``: ``UnitHooks``, the hooks on the unit modules: gather, prefetch, free and reduce around each unit.
- ``flat_param``: one unit's padded flat parameter, its shard, gather, free and reduce.
- ``config``: the options (``ShardingStrategy``, ``CPUOffload``, ``MixedPrecision``).
- ``clip``: gradient norm clipping over the shards.
- ``memory``: what FSDP holds and sends (``FSDPMemoryStats``).
- ``state``: full and sharded state dicts, and resharding on load.
"""
from .config import CPUOffload, MixedPrecision, ShardingStrategy
from .flat_param import MovedGradient, fsdp_role, moved
from .memory import FSDPMemoryStats
from .wrapper import FSDP, FullyShardedDataParallel

__all__ = ["FSDP", "FullyShardedDataParallel", "ShardingStrategy", "CPUOffload", "MixedPrecision", "FSDPMemoryStats",
           "MovedGradient", "fsdp_role", "moved"]
