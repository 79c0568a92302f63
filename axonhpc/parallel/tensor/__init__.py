"""Tensor (intra-layer) parallelism: Megatron-style column- and row-parallel linear layers.

[Note: the two layers and their conjugate communication]
``ColumnParallelLinear`` splits the output features: forward needs no communication, but backward must
all-reduce the partial input gradients, because every rank's block of y depends on all of x.
``RowParallelLinear`` splits the input features: forward all-reduces the partial products and adds the
replicated bias once, after the sum; backward needs no communication, because the output gradient is the same
on every rank. Chaining column (no gather), an element-wise activation and row gives an MLP with exactly one
all-reduce each way. ``TensorParallelAttention`` does the same over blocks of whole heads, and sums q/k/v's
partial input gradients before a single all-reduce.

[Note: initialisation equals the unsharded layer]
Each layer draws the full weight with the same Generator calls as ``nn.Linear(..., seed=seed)`` and keeps its
slice, so a tensor-parallel model can be checked against the dense model of the same seed, and a dp replica
holds the same shard as its peers; this costs one full weight of host memory during construction. With
``seed=None`` group rank 0 draws fresh entropy and broadcasts it, so the shards still come from one weight and
the replicated bias agrees across the group.

[Note: gradient semantics]
Each rank's ``weight.grad`` is the matching slice of the dense layer's gradient. ``RowParallelLinear.bias``'s
gradient is computed from the replicated output gradient, so it is identical on every rank and needs no
reduction across the group; DDP over ``mesh.dp`` composes unchanged.
"""
from .attention import TensorParallelAttention
from ..split import split_parameters
from .linear import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .partition import partition_range

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelAttention", "TensorParallelMLP",
           "partition_range", "split_parameters"]
