"""Multi-head self-attention with an explicit backward."""
from __future__ import annotations

import math
from typing import Any, Tuple

import numpy as np

from .._dtypes import array_module
from ..errors import ConfigurationError, ShapeError
from . import initializers, kernels
from .autocast import autocast_dtype, like, lower, product, widen
from .functional import softmax
from .linear import Linear
from .module import Module


def split_heads(t: Any, num_heads: int) -> Any:
    """(B, T, H*D) -> (B, H, T, D): the heads of a projection, head h from features [h*D, (h+1)*D)."""
    b, n, width = t.shape
    return t.reshape(b, n, num_heads, width // num_heads).transpose(0, 2, 1, 3)


def merge_heads(t: Any) -> Any:
    """(B, H, T, D) -> (B, T, H*D): the inverse of ``split_heads``."""
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def attention_forward(q: Any, k: Any, v: Any, causal: bool) -> Tuple[Any, Any]:
    """Scaled dot-product attention of each head on its own: ``(context, cache)``.

    The core of ``MultiHeadAttention`` without the projections (a tensor-parallel block calls it on its heads).
    q, k, v and the context are (B, H, T, D); the cache is what ``attention_backward`` needs.
    """
    xp = array_module(q)
    n = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = autocast_dtype()
    in_dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v = lower(q, dtype), lower(k, dtype), lower(v, dtype)
    scores = widen(product(q, k.transpose(0, 1, 3, 2), dtype))  # softmax in float32 under autocast
    if kernels.takes_kernels(scores):  # scale, mask and softmax: host in one pass, in place; device in 4 launches
        attn = kernels.softmax_forward(scores, scale, causal)
    else:
        scores = scores * scale
        if causal:
            future = xp.triu(xp.ones((n, n), dtype=bool), 1)
            # Same dtype on both sides so float32 scores stay float32.
            scores = xp.where(future, xp.asarray(-xp.inf, dtype=scores.dtype), scores)
        attn = softmax(scores, axis=-1)
    return product(lower(attn, dtype), v, dtype), (q, k, v, attn, scale, dtype, in_dtypes)


def attention_backward(dctx: Any, cache: Any) -> Tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv), each (B, H, T, D), from d loss / d context and ``attention_forward``'s cache.

    Under autocast (recorded in the cache) the products run in the forward's low dtype, the softmax
    gradient in float32, and the gradients come back in the dtypes of q, k and v.
    """
    q, k, v, attn, scale, dtype, in_dtypes = cache
    dctx = lower(dctx, dtype)
    dattn = dctx @ v.transpose(0, 1, 3, 2)
    dv = lower(attn, dtype).transpose(0, 1, 3, 2) @ dctx
    # Softmax backward; masked positions have attn == 0, so they get no gradient.
    if kernels.takes_kernels(attn, dattn):
        dscores = kernels.softmax_backward(attn, dattn, scale)
    else:
        dscores = attn * (dattn - (dattn * attn).sum(axis=-1, keepdims=True))
        dscores *= scale
    dscores = lower(dscores, dtype)
    dq = dscores @ k
    dk = dscores.transpose(0, 1, 3, 2) @ q
    return like(dq, in_dtypes[0]), like(dk, in_dtypes[1]), like(dv, in_dtypes[2])


class MultiHeadAttention(Module):
    """Scaled dot-product self-attention over ``num_heads`` heads, batch first.

    For x (B, T, E) each head computes softmax(q_h k_h^T / sqrt(E / H)) v_h (future positions masked when
    ``causal``); the heads are concatenated and passed through ``out_proj``. The projections are ``Linear``
    submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``; splitting PyTorch's packed ``in_proj_weight``
    along rows gives the first three. Initialisation follows PyTorch: q/k/v weights U(-sqrt(6 / 4E),
    sqrt(6 / 4E)) (Glorot over the packed (3E, E) matrix), out_proj Linear's default, biases zero.

    Raises:
        ConfigurationError: ``num_heads`` does not divide ``embed_dim``, or a non-positive size.
    """

    takes_arrays = True

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False,
                 dtype: Any = np.float32, seed: initializers.SeedLike = None) -> None:
        super().__init__()
        initializers.check_sizes("MultiHeadAttention", embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ConfigurationError(f"MultiHeadAttention needs num_heads dividing embed_dim, both positive; "
                                     f"got embed_dim={embed_dim}, num_heads={num_heads}")
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.causal = bool(causal)
        seeds = initializers.child_seeds(seed, 4)
        self.q_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, seed=seeds[0])
        self.k_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, seed=seeds[1])
        self.v_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, seed=seeds[2])
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, seed=seeds[3])
        in_bound = initializers.xavier_bound(embed_dim, 3 * embed_dim)
        for proj, s in zip((self.q_proj, self.k_proj, self.v_proj), seeds[:3]):
            proj.weight.data[...] = initializers.uniform(initializers.make_rng(s), proj.weight.shape, in_bound, dtype)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                proj.bias.data[...] = 0

    def forward(self, x: Any) -> Any:
        """Self-attention over ``x`` (B, T, E); returns (B, T, E). ShapeError unless 3-D with last axis E."""
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ShapeError(f"MultiHeadAttention(embed_dim={self.embed_dim}) expects input (B, T, "
                             f"{self.embed_dim}), got {tuple(x.shape)}")
        q = split_heads(self.q_proj(x), self.num_heads)
        k = split_heads(self.k_proj(x), self.num_heads)
        v = split_heads(self.v_proj(x), self.num_heads)
        ctx, cache = attention_forward(q, k, v, self.causal)
        self._save_cache(cache)
        return self.out_proj(merge_heads(ctx))

    def backward(self, grad_out: Any) -> Any:
        """Gradients through out_proj, the attention weights and the q/k/v projections."""
        cache = self._pop_cache()
        dctx = split_heads(self.out_proj.backward(grad_out), self.num_heads)
        dq, dk, dv = attention_backward(dctx, cache)
        # v, k, q order keeps the grad hooks in reverse registration order.
        dx = self.v_proj.backward(merge_heads(dv))
        dx = dx + self.k_proj.backward(merge_heads(dk))
        dx = dx + self.q_proj.backward(merge_heads(dq))
        return dx

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}"


__all__ = ["MultiHeadAttention", "attention_backward", "attention_forward", "merge_heads", "split_heads"]
