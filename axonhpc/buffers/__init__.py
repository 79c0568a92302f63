"""Flat buffers: the memory every strategy communicates through, and nothing that communicates.

``ops`` (host or GPU, behind ``FlatOps``: allocation, views, pack and unpack) and ``shard``
(``FlatShard``: a padded flat vector cut into equal parts); the compiled core is in ``cython_src/``.
"""
# Imported as modules of the package: the import-linter (grimp) reads only .py
# files, and names imported from a compiled module it cannot see are charged
# to the top-level package, which breaks the layers contract.
from .._ext import _bucket, _pack, _shard
from .ops import HOST, DeviceOps, FlatOps, HostOps, device_ops, flat_ops_for
from .shard import FlatShard

GradientBucket = _bucket.GradientBucket
pack, unpack = _pack.pack, _pack.unpack
shard_bounds, shard_size, padded_size = _shard.shard_bounds, _shard.shard_size, _shard.padded_size
FlatLayout, flatten_into_padded = _shard.FlatLayout, _shard.flatten_into_padded
shard_view, unflatten = _shard.shard_view, _shard.unflatten

__all__ = [
    "DeviceOps",
    "FlatLayout",
    "FlatOps",
    "FlatShard",
    "GradientBucket",
    "HOST",
    "HostOps",
    "device_ops",
    "flat_ops_for",
    "flatten_into_padded",
    "pack",
    "padded_size",
    "shard_bounds",
    "shard_size",
    "shard_view",
    "unflatten",
    "unpack",
]
