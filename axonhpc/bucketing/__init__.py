"""Gradient buckets and their reduction: the layer between the collectives and the parallel strategies.

``plan`` (which gradients share a bucket), ``bucket`` (``GradBucket``), ``reducer`` (``Reducer``: launch,
progress, complete), ``synchronizer`` (``GradientSynchronizer``: lists of gradients through copied buckets)
and ``shared`` (DDP's buckets in one shared window of the node). DDP and the pipeline's replicas both reduce
through ``Reducer``. The compiled buffers of ``axonhpc.buffers`` are re-exported here, as the API lists them.
"""
from ..buffers import (FlatLayout, GradientBucket, flatten_into_padded, pack, padded_size, shard_bounds,
                       shard_size, shard_view, unflatten, unpack)
from .bucket import KINDS, GradBucket
from .plan import plan_buckets
from .reducer import GradSyncStrategy, Reducer, finished
from .shared import shared_flats
from .synchronizer import GradientSynchronizer

__all__ = [
    "GradBucket",
    "GradientBucket",
    "GradientSynchronizer",
    "GradSyncStrategy",
    "FlatLayout",
    "KINDS",
    "Reducer",
    "finished",
    "flatten_into_padded",
    "pack",
    "padded_size",
    "plan_buckets",
    "shard_bounds",
    "shard_size",
    "shard_view",
    "shared_flats",
    "unflatten",
    "unpack",
]
