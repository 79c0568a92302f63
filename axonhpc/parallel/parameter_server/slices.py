"""The model's parameters as one padded flat vector per dtype, server s owning part s of each.

Workers and servers hold the same ``Slices``: workers send gradients and
receive parameters through it, servers fill it with the final parameters
at the end of a run. The arithmetic is ``buffers.FlatShard``'s.
"""
from __future__ import annotations

from typing import Any, List

from ..._dtypes import dtype_groups
from ...buffers import FlatOps, FlatShard


class Slices:
    """Parameters grouped by dtype (in the order each dtype first appears), each group one ``FlatShard``.

    Args:
        params: the model's Parameters, in registration order.
        num_servers: how many parts each flat vector is cut into.
        ops: the flat-buffer operations of the model's memory.

    Attributes:
        groups: the Parameters of each dtype, in order.
        shards: one ``FlatShard`` per dtype.
        values: the padded flat vectors of parameter values (``allocate``), or None.
    """

    def __init__(self, params: List[Any], num_servers: int, ops: FlatOps) -> None:
        self.groups = dtype_groups(params, lambda p: p.data)
        self.shards = [FlatShard([p.data.shape for p in group], group[0].data.dtype, num_servers, ops)
                       for group in self.groups]
        self.values: Any = None

    def allocate(self) -> None:
        """Allocate ``values`` (zeroed)."""
        self.values = self.zeros()

    def zeros(self) -> List[Any]:
        """A zeroed padded flat vector per dtype."""
        return [shard.zeros() for shard in self.shards]

    def parts(self, flats: List[Any], server: int) -> List[Any]:
        """Server ``server``'s part of each of ``flats`` (views; empty where a dtype has no elements)."""
        out = []
        for shard, flat in zip(self.shards, flats):
            start, stop, _ = shard.bounds(server)
            out.append(flat[start:stop])
        return out

    def pack_values(self) -> None:
        """The parameters' values into ``values``."""
        for shard, group, flat in zip(self.shards, self.groups, self.values):
            shard.pack([p.data for p in group], flat)

    def pack_grads(self, flats: List[Any]) -> None:
        """The parameters' gradients into ``flats`` (a gradient that is None as zeros)."""
        for shard, group, flat in zip(self.shards, self.groups, flats):
            shard.pack([p.grad for p in group], flat)

    def load_values(self) -> None:
        """``values`` into the parameters' ``data``, in place."""
        for shard, group, flat in zip(self.shards, self.groups, self.values):
            shard.unpack(flat, [p.data for p in group])


__all__ = ["Slices"]
