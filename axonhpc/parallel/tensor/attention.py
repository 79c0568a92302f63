"""Attention with its heads split over a tensor-parallel group (see the package notes)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..._dtypes import array_module
from ...backends import ReduceOp
from ...collectives import all_reduce
from ...errors import ConfigurationError, ShapeError
from ...groups import ProcessGroup, resolve_group
from ...nn import Module, MultiHeadAttention
from ...nn import initializers
from ...nn.attention import attention_backward, attention_forward, merge_heads, split_heads
from ..same_model import agreed
from .linear import ColumnParallelLinear, RowParallelLinear
from .partition import partition_range, same_geometry, shared_seed


class TensorParallelAttention(Module):
    """Multi-head self-attention with its heads split over a tensor-parallel group.

    Rank r of P holds heads ``[r*H/P, (r+1)*H/P)``: q/k/v are column layers producing its heads, the attention
    runs on the local heads, and ``out_proj`` is a row layer. One all-reduce in forward and one in backward;
    input and output are full (B, T, E) on every rank. Initialisation equals ``nn.MultiHeadAttention(embed_dim,
    num_heads, bias, causal, dtype, seed)``, each rank keeping its slice, so with an explicit seed it computes
    the same function as that dense layer.

    Args:
        num_heads: H, the total number of heads; divides ``embed_dim`` and is divisible by the group size.
        causal: position t attends only to positions <= t.
        seed: int, SeedSequence or Generator, the same on every rank (None: group rank 0 picks fresh entropy
            and broadcasts it; collective).

    Raises:
        ConfigurationError: ``num_heads`` does not divide ``embed_dim``, a non-positive size, or ``num_heads``
            not divisible by the group size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks build it with different geometry, or another rank's checks failed; raised
            on every rank before anything else is sent.
    """

    def __init__(self, embed_dim: int, num_heads: int, group: Optional[ProcessGroup] = None,
                 bias: bool = True, causal: bool = False, dtype: Any = np.float32,
                 seed: initializers.SeedLike = None) -> None:
        super().__init__()
        pg = resolve_group(group).require_member("TensorParallelAttention")
        # Before any other message (seed=None broadcasts): one exchange for the whole block.
        with same_geometry(pg, "TensorParallelAttention", embed_dim=embed_dim, num_heads=num_heads, bias=bool(bias),
                           causal=bool(causal), dtype=dtype):
            if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
                raise ConfigurationError(f"TensorParallelAttention needs num_heads dividing embed_dim, both "
                                         f"positive; got embed_dim={embed_dim}, num_heads={num_heads}")
            head_start, head_stop = partition_range(int(num_heads), pg.rank, pg.size,
                                                    "TensorParallelAttention num_heads")
        self.group = pg
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.num_heads_per_rank = head_stop - head_start
        self.head_dim = self.embed_dim // self.num_heads
        self.causal = bool(causal)
        # As nn.MultiHeadAttention: four child seeds; each projection first draws like
        # nn.Linear (so a Generator seed advances alike), then q/k/v weights are redrawn
        # Glorot-uniform over the packed (3E, E) matrix and all biases zeroed.
        seeds = initializers.child_seeds(shared_seed(seed, pg), 4)
        with agreed():
            self.q_proj, self.k_proj, self.v_proj = (
                ColumnParallelLinear(embed_dim, embed_dim, group=pg, gather_output=False, bias=bias, dtype=dtype,
                                     seed=s) for s in seeds[:3])
            self.out_proj = RowParallelLinear(embed_dim, embed_dim, group=pg, input_is_parallel=True, bias=bias,
                                              dtype=dtype, seed=seeds[3])
        in_bound = initializers.xavier_bound(embed_dim, 3 * embed_dim)
        rows = slice(head_start * self.head_dim, head_stop * self.head_dim)
        for proj, s in zip((self.q_proj, self.k_proj, self.v_proj), seeds[:3]):
            full = initializers.uniform(initializers.make_rng(s), (self.embed_dim, self.embed_dim), in_bound, dtype)
            proj.weight.data[...] = full[rows]
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                proj.bias.data[...] = 0

    @staticmethod
    def dense_equivalent(embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False,
                         dtype: Any = np.float32, seed: initializers.SeedLike = None) -> MultiHeadAttention:
        """The ``nn.MultiHeadAttention`` this layer shards, for the same arguments (seed not None)."""
        return MultiHeadAttention(embed_dim, num_heads, bias=bias, causal=causal, dtype=dtype, seed=seed)

    def forward(self, x: Any) -> Any:
        """Self-attention over the full ``x`` (B, T, E); the full (B, T, E) on every rank (ShapeError if not 3-D)."""
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ShapeError(f"TensorParallelAttention(embed_dim={self.embed_dim}) expects input (B, T, "
                             f"{self.embed_dim}), got {tuple(x.shape)}")
        h = self.num_heads_per_rank
        q = split_heads(self.q_proj(x), h)
        k = split_heads(self.k_proj(x), h)
        v = split_heads(self.v_proj(x), h)
        ctx, cache = attention_forward(q, k, v, self.causal)
        self._save_cache(cache)
        return self.out_proj(merge_heads(ctx))

    def backward(self, grad_out: Any) -> Any:
        """Local parameter gradients; returns the full input gradient, summed over the group once."""
        cache = self._pop_cache()
        dctx = split_heads(self.out_proj.backward(grad_out), self.num_heads_per_rank)
        dq, dk, dv = attention_backward(dctx, cache)
        # v, k, q order keeps the grad hooks in reverse registration order, as in nn.MultiHeadAttention.
        projs = (self.v_proj, self.k_proj, self.q_proj)
        grads, saved = zip(*(proj.begin_backward(merge_heads(g)) for proj, g in zip(projs, (dv, dk, dq))))
        xp = array_module(dctx)
        grad_in = projs[0].partial_input_grad(grads[0], saved[0])
        for proj, g, s in zip(projs[1:], grads[1:], saved[1:]):
            grad_in = grad_in + proj.partial_input_grad(g, s)
        grad_in = xp.ascontiguousarray(grad_in)
        # One sum of the three partial input gradients, overlapped with the parameter gradients.
        work = all_reduce(grad_in, ReduceOp.SUM, self.group, async_op=True)
        for proj, g, s in zip(projs, grads, saved):
            proj.finish_backward(g, s)
        work.wait(self.group.effective_timeout())
        return grad_in

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_heads_per_rank={self.num_heads_per_rank}, tp_size={self.group.size}, causal={self.causal}")


