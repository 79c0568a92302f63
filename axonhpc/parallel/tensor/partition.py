"""How a tensor-parallel layer is cut over its group, and the checks every rank agrees on before it is."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

import numpy as np

from ..._dtypes import array_module
from ...collectives import all_gather, broadcast
from ...errors import ConfigurationError, ShapeError
from ...groups import ProcessGroup
from ...nn import Module
from ...nn import initializers
from ..same_model import compared_model


def partition_range(total: int, rank: int, size: int, what: str = "features") -> Tuple[int, int]:
    """The contiguous block ``[start, stop)`` of ``total`` items that ``rank`` of ``size`` holds.

    A pure function, so the split is identical on every rank. ``what`` names the items in messages. Raises
    ConfigurationError for a negative ``total``, a non-positive ``size``, a ``rank`` out of range, or ``total``
    not divisible by ``size``.
    """
    if size < 1 or not 0 <= rank < size:
        raise ConfigurationError(f"partition of {what}: rank {rank} is not in a group of size {size}")
    if total < 0 or total % size:
        raise ConfigurationError(
            f"{what}={total} must be a non-negative multiple of the tensor-parallel group size {size} "
            f"({total} % {size} = {total % size})"
        )
    per_rank = total // size
    return rank * per_rank, (rank + 1) * per_rank


def shared_seed(seed: initializers.SeedLike, group: ProcessGroup) -> initializers.SeedLike:
    """``seed``, or for None entropy drawn on group rank 0 and broadcast (collective).

    Fresh entropy per rank would give shards of different matrices and disagreeing replicated biases.
    """
    if seed is not None or group.size == 1:
        return seed
    words = np.zeros(4, dtype=np.int64)
    if group.rank == 0:
        words[:] = np.random.default_rng().integers(0, 2**62, size=4, dtype=np.int64)
    broadcast(words, src=0, group=group)
    return np.random.SeedSequence([int(w) for w in words])


def full_linear_values(in_features: int, out_features: int, bias: bool, dtype: Any,
                        seed: initializers.SeedLike) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Weight and bias exactly as ``nn.Linear(in_features, out_features, bias, dtype, seed)`` draws them."""
    rng = initializers.make_rng(seed)
    bound = initializers.fan_in_bound(in_features)
    weight = initializers.uniform(rng, (out_features, in_features), bound, dtype)
    bias_values = initializers.uniform(rng, (out_features,), bound, dtype) if bias else None
    return weight, bias_values


def check_sizes(layer: str, in_features: int, out_features: int) -> None:
    if in_features < 0 or out_features < 0:
        raise ConfigurationError(f"{layer} sizes must be >= 0, got in_features={in_features}, "
                                 f"out_features={out_features}")


def my_part(pg: ProcessGroup, layer: str, in_features: int, out_features: int, split: str,
             **geometry: Any) -> Tuple[int, int]:
    """This rank's ``[start, stop)`` of the ``split`` dimension, once every rank agrees on the layer's geometry.

    The local checks' error joins the exchange instead of being raised first, so that no rank waits.
    """
    with same_geometry(pg, layer, in_features=in_features, out_features=out_features, **geometry):
        check_sizes(layer, in_features, out_features)
        size = out_features if split == "out_features" else in_features
        return partition_range(int(size), pg.rank, pg.size, f"{layer} {split}")


@contextlib.contextmanager
def same_geometry(pg: ProcessGroup, layer: str, **geometry: Any) -> Iterator[None]:
    """Collective: run the block (this rank's checks), then agree that every rank builds ``layer`` alike.

    Runs before any other message of the constructor, so a rank with other sizes, flags or dtype, or whose
    block raised, makes every rank raise (ModelMismatchError; the block's own error where it raised) instead of
    leaving the others waiting or computing with shards of different layers.
    """
    def shown(key: str, value: Any) -> str:
        if key == "dtype":
            try:
                return str(np.dtype(value))  # np.float32, "float32" and np.dtype("f4") alike
            except TypeError:
                return repr(value)
        if hasattr(value, "__index__") and not isinstance(value, bool):
            return str(int(value))  # a numpy integer as a plain one
        return repr(value)

    text = ", ".join(f"{k}={shown(k, v)}" for k, v in geometry.items())
    hint = f"every rank of the tensor-parallel group must build the same {layer} (tp_size={pg.size}), in the same order"
    with compared_model(pg, f"{layer} over group {pg.name}", hint=hint) as described:
        described.settings = [f"layer: {layer}({text})"]
        yield


def check_last_axis(layer: Module, x: Any, expected: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] != expected:
        raise ShapeError(f"{type(layer).__name__}({layer.in_features}, {layer.out_features}) on a group of "
                         f"size {layer.group.size} got {what} of shape {tuple(x.shape)}; the last axis must be "
                         f"{expected}")


def gather_last_axis(x: Any, group: ProcessGroup) -> Any:
    """Concatenate every rank's ``x`` along the last axis, in group-rank order (collective).

    Each block is copied into its place (not ``xp.concatenate``: cupy joins more than 8 arrays through a table
    of their addresses copied from the host, which a CUDA graph capture refuses).
    """
    xp = array_module(x)
    stacked = all_gather(xp.ascontiguousarray(x), group=group)
    width = x.shape[-1]
    out = xp.empty(x.shape[:-1] + (width * group.size,), dtype=stacked.dtype)
    for i in range(group.size):
        out[..., i * width:(i + 1) * width] = stacked[i]
    return out
