"""Embedding: a lookup table of rows, with a scatter-add backward."""
from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import array_module
from ..errors import ConfigurationError, ShapeError, UnsupportedDtypeError
from . import initializers, kernels
from .module import Module
from .parameter import Parameter


def _scatter_add_rows(xp: Any, out: Any, index: Any, rows: Any) -> None:
    """out[index[i]] += rows[i], adding repeated indices (numpy's add.at)."""
    try:
        xp.add.at(out, index, rows)
    except (AttributeError, NotImplementedError):
        # cupy before 13 has no ufunc.at; cupyx.scatter_add is its spelling there.
        import cupyx

        cupyx.scatter_add(out, index, rows)


class Embedding(Module):
    """Map integer indices to rows of ``weight`` (num_embeddings, embedding_dim).

    ``weight`` starts as N(0, 1) samples, as in PyTorch. Gradients for rows
    that appear several times in a batch are summed.

    Args:
        num_embeddings: number of rows.
        embedding_dim: row length.
        dtype: parameter dtype.
        seed: int, SeedSequence or Generator for the initial values (None: fresh entropy).

    Raises:
        ConfigurationError: a non-positive size.
    """

    takes_arrays = True

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Any = np.float32,
                 seed: initializers.SeedLike = None) -> None:
        super().__init__()
        initializers.check_sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ConfigurationError(f"Embedding sizes must be positive, got num_embeddings={num_embeddings}, "
                                     f"embedding_dim={embedding_dim}")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        rng = initializers.make_rng(seed)
        self.weight = Parameter(rng.standard_normal((self.num_embeddings, self.embedding_dim)).astype(dtype))

    def forward(self, indices: Any) -> Any:
        """Look up ``indices`` (integer array of any shape); returns (*indices.shape, embedding_dim).

        Raises:
            TypeError: non-integer indices.
            ShapeError: an index outside [0, num_embeddings).
        """
        if indices.dtype.kind not in "iu":
            raise UnsupportedDtypeError(f"Embedding indices must be integers, got dtype {indices.dtype}")
        if indices.size:
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise ShapeError(f"Embedding({self.num_embeddings}, {self.embedding_dim}) got indices in "
                                 f"[{lo}, {hi}]; they must be in [0, {self.num_embeddings})")
        self._save_cache(indices)
        return self.weight.data[indices]

    def backward(self, grad_out: Any) -> None:
        """Scatter-add ``grad_out`` rows into the weight gradient; indices get no gradient (None)."""
        indices = self._pop_cache()
        xp = array_module(grad_out)
        dweight = xp.zeros(self.weight.shape, dtype=self.weight.dtype)
        rows = grad_out.reshape(-1, self.embedding_dim)
        if kernels.takes_host_kernels(dweight, rows):  # add.at's adds, in its order, in one compiled loop
            kernels.scatter_add_rows(dweight, indices.reshape(-1), rows)
            self.weight.accumulate_grad(dweight)
            return None
        _scatter_add_rows(xp, dweight, indices.reshape(-1), rows.astype(dweight.dtype, copy=False))
        self.weight.accumulate_grad(dweight)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


__all__ = ["Embedding"]
