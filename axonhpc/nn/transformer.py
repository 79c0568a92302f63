"""A pre-LayerNorm transformer block and a GPT-style language model, with explicit backward.

[Note: residual backward]
A residual ``y = x + f(x)`` has d loss / d x = g + f.backward(g): the gradient flows both around and through
the branch. The block does this for the MLP first, then attention, so parameter hooks fire in reverse
registration order as everywhere in ``nn``.

[Note: tied output head]
With ``tie_weights`` the head is the token embedding's weight transposed, as in GPT-2; that Parameter then
receives two ``accumulate_grad`` calls per backward (head and lookup), so its hooks fire once per use.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

from .._dtypes import array_module
from ..errors import ConfigurationError, ShapeError, UnsupportedDtypeError
from . import initializers
from .activation import GELU
from .attention import MultiHeadAttention
from .autocast import linear_backward, linear_product
from .container import Sequential
from .dropout import Dropout
from .embedding import Embedding
from .linear import Linear
from .module import Module
from .normalization import LayerNorm

# GPT-2's initial standard deviation of the token and position embeddings.
_EMBED_STD = 0.02


class TransformerBlock(Module):
    """Pre-LayerNorm transformer block: x + drop(attn(ln1(x))), then h + mlp(ln2(h)), on (B, T, width).

    Args:
        heads: attention heads; must divide ``width``.
        dropout: drop probability after the attention and after the MLP.
        causal: position t attends only to positions <= t.
        seed: for the initial values and the dropout masks (None: fresh entropy).

    Raises:
        ConfigurationError: a non-positive size, ``heads`` not dividing ``width``, or dropout outside [0, 1].
    """

    takes_arrays = True

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0, causal: bool = True,
                 dtype: Any = np.float32, seed: initializers.SeedLike = None) -> None:
        super().__init__()
        initializers.check_sizes("TransformerBlock", width=width, heads=heads, mlp_ratio=mlp_ratio)
        if width <= 0 or mlp_ratio <= 0:
            raise ConfigurationError(f"TransformerBlock needs positive width and mlp_ratio, got width={width}, "
                                     f"mlp_ratio={mlp_ratio}")
        self.width = int(width)
        self.heads = int(heads)
        self.mlp_ratio = int(mlp_ratio)
        seeds = initializers.child_seeds(seed, 5)
        hidden = self.mlp_ratio * self.width
        self.ln1 = LayerNorm(width, dtype=dtype)
        self.attn = MultiHeadAttention(width, heads, causal=causal, dtype=dtype, seed=seeds[0])
        self.attn_dropout = Dropout(dropout, seed=seeds[1])
        self.ln2 = LayerNorm(width, dtype=dtype)
        self.mlp = Sequential(Linear(width, hidden, dtype=dtype, seed=seeds[2]), GELU(),
                              Linear(hidden, width, dtype=dtype, seed=seeds[3]), Dropout(dropout, seed=seeds[4]))

    def forward(self, x: Any) -> Any:
        """Apply the block to ``x`` of shape (B, T, width); returns (B, T, width)."""
        h = x + self.attn_dropout(self.attn(self.ln1(x)))
        return h + self.mlp(self.ln2(h))

    def backward(self, grad_out: Any) -> Any:
        """d loss / d x through both residual branches, MLP first."""
        dh = grad_out + self.ln2.backward(self.mlp.backward(grad_out))
        return dh + self.ln1.backward(self.attn.backward(self.attn_dropout.backward(dh)))

    def extra_repr(self) -> str:
        return f"width={self.width}, heads={self.heads}, mlp_ratio={self.mlp_ratio}"


class GPT(Module):
    """A GPT-style decoder: token + position embeddings, causal blocks, final LayerNorm, output head.

    ``forward(tokens)`` maps integer tokens (B, T), T <= ``context``, to logits (B, T, vocab_size).

    [Note: a part of the model]
    ``block_range``, ``with_embedding`` and ``with_head`` build a contiguous part, as a pipeline stage holds it.
    Blocks keep their whole-model index as name and every seed is derived alike whatever the part, so the parts
    of one seed together are exactly the whole model. ``make_block(index, seed)`` replaces ``TransformerBlock``.

    Args:
        context: the longest sequence (rows of the position embedding).
        tie_weights: share the token embedding with the output head.
        block_range: ``(start, stop)``, the blocks this part holds (None: all).

    Raises:
        ConfigurationError: a non-positive size, a ``block_range`` outside ``[0, layers]``, or ``tie_weights``
            on a part without both the embedding and the head.
    """

    takes_arrays = True

    def __init__(self, vocab_size: int, context: int, width: int, heads: int, layers: int, dropout: float = 0.0,
                 tie_weights: bool = False, mlp_ratio: int = 4, dtype: Any = np.float32,
                 seed: initializers.SeedLike = None, block_range: Optional[Tuple[int, int]] = None,
                 with_embedding: bool = True, with_head: bool = True,
                 make_block: Optional[Callable[[int, Any], Module]] = None) -> None:
        super().__init__()
        initializers.check_sizes("GPT", vocab_size=vocab_size, context=context, width=width, heads=heads,
                                 layers=layers, mlp_ratio=mlp_ratio)
        if vocab_size <= 0 or context <= 0 or width <= 0 or layers < 0:
            raise ConfigurationError(f"GPT needs positive vocab_size, context and width and layers >= 0, got "
                                     f"vocab_size={vocab_size}, context={context}, width={width}, layers={layers}")
        start, stop = (0, layers) if block_range is None else (int(block_range[0]), int(block_range[1]))
        if not 0 <= start <= stop <= layers:
            raise ConfigurationError(f"GPT block_range={block_range} must satisfy 0 <= start <= stop <= layers="
                                     f"{layers}")
        if tie_weights and not (with_embedding and with_head):
            raise ConfigurationError("GPT tie_weights needs the embedding and the head in the same part "
                                     f"(with_embedding={with_embedding}, with_head={with_head}); untie them to "
                                     "split the model")
        self.vocab_size = int(vocab_size)
        self.context = int(context)
        self.width = int(width)
        self.layers = int(layers)
        self.block_range = (start, stop)
        self.tie_weights = bool(tie_weights)
        self.with_embedding = bool(with_embedding)
        self.with_head = bool(with_head)
        seeds = initializers.child_seeds(seed, 4 + layers)
        if make_block is None:
            def make_block(index: int, block_seed: Any) -> Module:
                return TransformerBlock(width, heads, mlp_ratio=mlp_ratio, dropout=dropout, causal=True,
                                        dtype=dtype, seed=block_seed)
        if self.with_embedding:
            self.tok_emb = Embedding(vocab_size, width, dtype=dtype, seed=seeds[0])
            self.pos_emb = Embedding(context, width, dtype=dtype, seed=seeds[1])
            for emb in (self.tok_emb, self.pos_emb):
                emb.weight.data[...] *= _EMBED_STD
            self.drop = Dropout(dropout, seed=seeds[2])
        self.blocks = Sequential()
        for index in range(start, stop):
            setattr(self.blocks, str(index), make_block(index, seeds[4 + index]))
        if self.with_head:
            self.ln_f = LayerNorm(width, dtype=dtype)
            if not self.tie_weights:
                self.head = Linear(width, vocab_size, bias=False, dtype=dtype, seed=seeds[3])

    def forward(self, x: Any) -> Any:
        """Logits (B, T, vocab_size) for integer tokens (B, T); a part's own input and output otherwise.

        Raises ShapeError for a bad shape or T, UnsupportedDtypeError for non-integer tokens.
        """
        if self.with_embedding:
            h = self._embed(x)
        else:
            if x.ndim != 3 or x.shape[-1] != self.width:
                raise ShapeError(f"GPT part with blocks {self.block_range} and no embedding expects activations "
                                 f"(B, T, {self.width}), got shape {tuple(x.shape)}")
            h = x
        h = self.blocks(h)
        if not self.with_head:
            return h
        h = self.ln_f(h)
        if self.tie_weights:
            logits, saved = linear_product(h, self.tok_emb.weight.data)
            self._save_cache(saved)
            return logits
        return self.head(h)

    def _embed(self, tokens: Any) -> Any:
        if tokens.ndim != 2 or not 0 < tokens.shape[1] <= self.context:
            raise ShapeError(f"GPT(context={self.context}) expects tokens (B, T) with 0 < T <= {self.context}, "
                             f"got shape {tuple(tokens.shape)}")
        if tokens.dtype.kind not in "iu":
            raise UnsupportedDtypeError(f"GPT tokens must be integers, got dtype {tokens.dtype}")
        positions = array_module(tokens).arange(tokens.shape[1])
        return self.drop(self.tok_emb(tokens) + self.pos_emb(positions))

    def backward(self, grad_out: Any) -> Any:
        """Fill the parameter gradients from d loss / d output; returns None, or d loss / d input of a part."""
        dh = grad_out
        if self.with_head:
            if self.tie_weights:
                dh = linear_backward(grad_out, self._pop_cache(), self.tok_emb.weight)
            else:
                dh = self.head.backward(grad_out)
            dh = self.ln_f.backward(dh)
        dx = self.blocks.backward(dh)
        if not self.with_embedding:
            return dx
        dx = self.drop.backward(dx)
        self.pos_emb.backward(dx.sum(axis=0))
        self.tok_emb.backward(dx)
        return None

    def extra_repr(self) -> str:
        part = "" if self.block_range == (0, self.layers) and self.with_embedding and self.with_head else (
            f", block_range={self.block_range}, with_embedding={self.with_embedding}, with_head={self.with_head}")
        return (f"vocab_size={self.vocab_size}, context={self.context}, width={self.width}, "
                f"layers={self.layers}, tie_weights={self.tie_weights}{part}")


__all__ = ["TransformerBlock", "GPT"]
