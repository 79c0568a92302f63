"""Flat buffers: the memory every strategy communicates through, and nothing that communicates.

One concept per module:

- ``ops``: where a model's flat buffers live, host (numpy, the compiled
  nogil copies) or a GPU (cupy), behind one interface (``FlatOps``), chosen
  once per wrapper by ``flat_ops_for``.
- ``bucket``: ``FlatBucket``, arrays that are views of one flat buffer
  (DDP's gradients as bucket views), from the model's memory or a buffer the
  caller holds (a shared window).
- ``shard``: ``FlatShard``, arrays as one padded flat vector cut into equal
  parts (FSDP's flat parameters, ZeRO's shards, the parameter server's
  slices).
- the compiled core (``cython_src/``): ``GradientBucket``, ``pack``/``unpack``
  and the shard arithmetic (``FlatLayout``, ``shard_bounds``, ...).

``axonhpc.bucketing`` re-exports the compiled names (as documented in the
API) beside ``GradientSynchronizer``, which does communicate.
"""
# Imported as modules of the package: the import-linter (grimp) reads only .py
# files, and names imported from a compiled module it cannot see are charged
# to the top-level package, which breaks the layers contract.
from .._ext import _bucket, _pack, _shard
from .bucket import FlatBucket
from .ops import HOST, DeviceOps, FlatOps, HostOps, device_ops, flat_ops_for
from .shard import FlatShard

GradientBucket = _bucket.GradientBucket
pack, unpack = _pack.pack, _pack.unpack
shard_bounds, shard_size, padded_size = _shard.shard_bounds, _shard.shard_size, _shard.padded_size
FlatLayout, flatten_into_padded = _shard.FlatLayout, _shard.flatten_into_padded
shard_view, unflatten = _shard.shard_view, _shard.unflatten

__all__ = [
    "DeviceOps",
    "FlatBucket",
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
