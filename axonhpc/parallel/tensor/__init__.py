"""Tensor (intra-layer) parallelism: Megatron-style column- and row-parallel linear layers.

[Note: the two layers and their conjugate communication]
A linear map y = x W^T + b with W of shape (out, in) can be split two ways
over the P ranks of a tensor-parallel group:

- ``ColumnParallelLinear`` splits the *output* features: rank r holds rows
  [r*out/P, (r+1)*out/P) of W and the same block of b, and computes its block
  of y from the full (replicated) x. Forward needs no communication (Megatron's
  "f" is the identity); backward must sum the partial input gradients
  g_r W_r over the ranks (all-reduce), because every rank's block of y
  depends on all of x. With ``gather_output`` the blocks are all-gathered into
  the full y, and backward keeps only this rank's block of the full gradient.
- ``RowParallelLinear`` splits the *input* features: rank r holds columns
  [r*in/P, (r+1)*in/P) of W and multiplies its block of x. The partial
  products are summed (all-reduce, Megatron's "g") and the replicated bias is
  added once, after the sum. Backward needs no communication for the local
  input gradient g W_r, because the output gradient g is the same on every
  rank; ``input_is_parallel=False`` slices the full input in forward and
  all-gathers the input gradient back to full size in backward.

Chaining the two (column without gather, an element-wise activation, row
with a parallel input) gives a tensor-parallel MLP with exactly one
all-reduce in forward and one in backward.
``TensorParallelAttention`` applies the same pattern to heads: q/k/v are
column layers over blocks of whole heads, attention runs on the local heads,
and out_proj is a row layer; its backward adds the three column layers'
partial input gradients before a single all-reduce.

[Note: initialisation equals the unsharded layer]
Each layer draws the *full* weight and bias with the same Generator calls,
in the same order, as ``nn.Linear(in_features, out_features, seed=seed)``,
and keeps its slice. So every rank's shard is a slice of one well-defined
full layer, a tensor-parallel model can be checked against the dense model
built from the same seed, and a dp replica (same seed) holds the same shard
as its peers. The full draw costs host memory for one full weight during
construction, which is what makes that equivalence exact. With ``seed=None``
group rank 0 draws fresh entropy and broadcasts it (a collective in the
constructor), so that the shards still come from one full weight and the
replicated bias of ``RowParallelLinear`` agrees across the group.

[Note: gradient semantics]
Weight and bias gradients stay local: each rank's ``weight.grad`` is the
matching slice of the dense layer's gradient. ``RowParallelLinear.bias`` is
replicated and its gradient is identical on every rank of the group (it is
computed from the replicated output gradient), so nothing needs to reduce it
across the tensor-parallel group. Data-parallel averaging (DDP over
``mesh.dp``) composes with this unchanged.

[Modules]
``partition`` (how a layer is cut, and what the ranks agree on first),
``linear`` (the column and row layers, the MLP), ``attention`` (heads over
the group).
"""
from .attention import TensorParallelAttention
from .linear import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .partition import partition_range

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelAttention", "TensorParallelMLP",
           "partition_range"]
