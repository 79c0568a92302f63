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
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .._dtypes import array_module
from ..backends import ReduceOp
from ..collectives import all_gather, all_reduce, broadcast
from ..errors import AxonError, ConfigurationError, ShapeError
from ..groups import ProcessGroup, resolve_group
from ..nn import GELU, Linear, Module, MultiHeadAttention, Parameter, Sequential
from ..nn import _init
from ..nn.attention import attention_backward, attention_forward, merge_heads, split_heads
from .same_model import agreed, check_same_model


def partition_range(total: int, rank: int, size: int, what: str = "features") -> Tuple[int, int]:
    """The contiguous block ``[start, stop)`` of ``total`` items that ``rank`` of ``size`` holds.

    A pure function (no communication), so the split is testable on its own
    and identical on every rank.

    Args:
        total: number of items to split (features of a layer).
        rank: the rank's index in the group, ``0 <= rank < size``.
        size: number of ranks.
        what: how error messages name the items.

    Returns:
        ``(start, stop)`` with ``stop - start == total // size``.

    Raises:
        ConfigurationError: ``total`` is negative, ``size`` not positive, ``rank``
            out of range, or ``total`` not divisible by ``size``.
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


def _shared_seed(seed: _init.SeedLike, group: ProcessGroup) -> _init.SeedLike:
    """``seed``, or for None entropy drawn on group rank 0 and broadcast (collective).

    Every rank must draw the same full weight; fresh entropy per rank would
    give shards of different matrices and disagreeing replicated biases.
    """
    if seed is not None or group.size == 1:
        return seed
    words = np.zeros(4, dtype=np.int64)
    if group.rank == 0:
        words[:] = np.random.default_rng().integers(0, 2**62, size=4, dtype=np.int64)
    broadcast(words, src=0, group=group)
    return np.random.SeedSequence([int(w) for w in words])


def _full_linear_values(in_features: int, out_features: int, bias: bool, dtype: Any,
                        seed: _init.SeedLike) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Weight and bias exactly as ``nn.Linear(in_features, out_features, bias, dtype, seed)`` draws them."""
    rng = _init.make_rng(seed)
    bound = _init.fan_in_bound(in_features)
    weight = _init.uniform(rng, (out_features, in_features), bound, dtype)
    bias_values = _init.uniform(rng, (out_features,), bound, dtype) if bias else None
    return weight, bias_values


def _check_sizes(layer: str, in_features: int, out_features: int) -> None:
    if in_features < 0 or out_features < 0:
        raise ConfigurationError(f"{layer} sizes must be >= 0, got in_features={in_features}, "
                                 f"out_features={out_features}")


def _my_part(pg: ProcessGroup, layer: str, in_features: int, out_features: int, split: str,
             **geometry: Any) -> Tuple[int, int]:
    """This rank's ``[start, stop)`` of the ``split`` dimension, once every rank agrees on the layer's geometry.

    The local checks' error (sizes, a dimension the group does not divide)
    joins the exchange instead of being raised first, so that no rank waits.
    """
    problem, start, stop = None, 0, 0
    try:
        _check_sizes(layer, in_features, out_features)
        size = out_features if split == "out_features" else in_features
        start, stop = partition_range(int(size), pg.rank, pg.size, f"{layer} {split}")
    except AxonError as exc:
        problem = exc
    _agree_on_geometry(pg, layer, problem, in_features=in_features, out_features=out_features, **geometry)
    return start, stop


def _agree_on_geometry(pg: ProcessGroup, layer: str, problem: Optional[AxonError], **geometry: Any) -> None:
    """Collective: every rank of the tensor-parallel group builds ``layer`` with the same geometry (one exchange).

    Runs before any other message of the constructor (``seed=None`` broadcasts
    the seed), so a rank with other sizes, flags or dtype, or one whose own
    checks failed (``problem``), makes every rank raise instead of leaving
    the others waiting or computing with shards of different layers.

    Raises:
        ModelMismatchError: the geometry differs across the group (on every rank).
        AxonError: ``problem``, on the rank that found it.
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
    check_same_model(pg, f"{layer} over group {pg.name}", [], problem, settings=[f"layer: {layer}({text})"],
                     hint=f"every rank of the tensor-parallel group must build the same {layer} (tp_size="
                          f"{pg.size}), in the same order")


def _check_last_axis(layer: Module, x: Any, expected: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] != expected:
        raise ShapeError(f"{type(layer).__name__}({layer.in_features}, {layer.out_features}) on a group of "
                         f"size {layer.group.size} got {what} of shape {tuple(x.shape)}; the last axis must be "
                         f"{expected}")


def _gather_last_axis(x: Any, group: ProcessGroup) -> Any:
    """Concatenate every rank's ``x`` along the last axis, in group-rank order (collective)."""
    xp = array_module(x)
    stacked = all_gather(xp.ascontiguousarray(x), group=group)
    return xp.concatenate([stacked[i] for i in range(group.size)], axis=-1)


class ColumnParallelLinear(Module):
    """Linear layer whose output features are split across a tensor-parallel group.

    Rank r of the group holds rows ``[r*k, (r+1)*k)`` of the dense layer's
    weight (k = out_features / group size) as ``weight`` (k, in_features) and
    the same block of the bias as ``bias`` (k,). Forward takes the full input
    (replicated on the group) and returns this rank's block of the output, or
    the full output with ``gather_output``. Backward all-reduces (sums) the
    input gradient over the group.

    Args:
        in_features: size of the input's last axis (the full input).
        out_features: total output features over the group; divisible by the group size.
        group: the tensor-parallel process group (None: the current world's default group).
        gather_output: all-gather the output blocks into the full output; backward then
            takes the full output gradient and uses this rank's block of it.
        bias: learn an additive bias (split like the output).
        dtype: parameter dtype.
        seed: int, SeedSequence or Generator (the same on every rank of the group); the
            full weight is drawn exactly as ``nn.Linear(in_features, out_features,
            seed=seed, dtype=dtype)`` draws it. None: group rank 0 picks fresh entropy
            and broadcasts it (collective).

    Raises:
        ConfigurationError: a negative size, or ``out_features`` not divisible by the group size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks of the group build it with different geometry
            (sizes, flags, dtype), or another rank's checks failed; raised on every rank
            before anything else is sent.
    """

    def __init__(self, in_features: int, out_features: int, group: Optional[ProcessGroup] = None,
                 gather_output: bool = False, bias: bool = True, dtype: Any = np.float32,
                 seed: _init.SeedLike = None) -> None:
        super().__init__()
        pg = resolve_group(group).require_member("ColumnParallelLinear")
        start, stop = _my_part(pg, "ColumnParallelLinear", in_features, out_features, "out_features",
                               gather_output=bool(gather_output), bias=bool(bias), dtype=dtype)
        self.group = pg
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.out_features_per_rank = stop - start
        self.gather_output = bool(gather_output)
        weight, bias_values = _full_linear_values(self.in_features, self.out_features, bias, dtype,
                                                  _shared_seed(seed, pg))
        # Copies, so the full draw is freed once construction returns.
        self.weight = Parameter(weight[start:stop].copy())
        self.bias = Parameter(bias_values[start:stop].copy()) if bias else None

    def forward(self, x: Any) -> Any:
        """This rank's output block (..., out_features / P), or the full output if ``gather_output``.

        Args:
            x: the full input, shape (..., in_features), the same on every rank of the group.

        Raises:
            ShapeError: the last axis of ``x`` is not ``in_features``.
        """
        _check_last_axis(self, x, self.in_features, "input")
        self._save_cache(x)
        y = x @ self.weight.data.T
        if self.bias is not None:
            y = y + self.bias.data
        if self.gather_output:
            y = _gather_last_axis(y, self.group)
        return y

    def backward(self, grad_out: Any) -> Any:
        """Local weight/bias gradients; returns the full input gradient, summed over the group.

        Args:
            grad_out: d loss / d output: this rank's block (..., out_features / P), or with
                ``gather_output`` the full (..., out_features) gradient.

        Returns:
            d loss / d x (..., in_features), identical on every rank of the group.
        """
        x = self._pop_cache()
        grad_out = self._local_grad_out(grad_out)
        xp = array_module(grad_out)
        grad_in = xp.ascontiguousarray(grad_out @ self.weight.data)
        # Start the sum of the partial input gradients first, and compute the
        # parameter gradients while it travels (Megatron overlaps the same way).
        work = all_reduce(grad_in, ReduceOp.SUM, self.group, async_op=True)
        self._accumulate_param_grads(grad_out, x)
        work.wait(self.group.effective_timeout())
        return grad_in

    def _local_grad_out(self, grad_out: Any) -> Any:
        """Check the output gradient's width and keep this rank's block of it (``gather_output``)."""
        if self.gather_output:
            _check_last_axis(self, grad_out, self.out_features, "output gradient")
            start = self.group.rank * self.out_features_per_rank
            return grad_out[..., start:start + self.out_features_per_rank]
        _check_last_axis(self, grad_out, self.out_features_per_rank, "output gradient")
        return grad_out

    def _accumulate_param_grads(self, grad_out: Any, x: Any) -> None:
        """Local weight/bias gradients from this rank's output-gradient block and the cached input."""
        g2 = grad_out.reshape(-1, self.out_features_per_rank)
        # Bias before weight: hooks fire in reverse registration order, as in nn.Linear.
        if self.bias is not None:
            self.bias.accumulate_grad(g2.sum(axis=0))
        self.weight.accumulate_grad(g2.T @ x.reshape(-1, self.in_features))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_rank={self.out_features_per_rank}, tp_size={self.group.size}, "
                f"gather_output={self.gather_output}, bias={self.bias is not None}")


class RowParallelLinear(Module):
    """Linear layer whose input features are split across a tensor-parallel group.

    Rank r of the group holds columns ``[r*k, (r+1)*k)`` of the dense layer's
    weight (k = in_features / group size) as ``weight`` (out_features, k) and
    the whole, replicated ``bias`` (out_features,). Forward sums the partial
    products over the group (all-reduce) and adds the bias once; the output
    is the full output, identical on every rank.

    Args:
        in_features: total input features over the group; divisible by the group size.
        out_features: size of the output's last axis.
        group: the tensor-parallel process group (None: the current world's default group).
        input_is_parallel: the input is already this rank's block (..., in_features / P),
            as a ``ColumnParallelLinear`` without ``gather_output`` produces it. When False
            the layer takes the full input, uses its block, and backward returns the full
            input gradient (all-gathered).
        bias: learn an additive bias (replicated; its gradient is identical on every rank).
        dtype: parameter dtype.
        seed: int, SeedSequence or Generator (the same on every rank of the group); the
            full weight and bias are drawn exactly as ``nn.Linear(in_features,
            out_features, seed=seed, dtype=dtype)`` draws them. None: group rank 0 picks
            fresh entropy and broadcasts it (collective).

    Raises:
        ConfigurationError: a negative size, or ``in_features`` not divisible by the group size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks of the group build it with different geometry
            (sizes, flags, dtype), or another rank's checks failed; raised on every rank
            before anything else is sent.
    """

    def __init__(self, in_features: int, out_features: int, group: Optional[ProcessGroup] = None,
                 input_is_parallel: bool = True, bias: bool = True, dtype: Any = np.float32,
                 seed: _init.SeedLike = None) -> None:
        super().__init__()
        pg = resolve_group(group).require_member("RowParallelLinear")
        start, stop = _my_part(pg, "RowParallelLinear", in_features, out_features, "in_features",
                               input_is_parallel=bool(input_is_parallel), bias=bool(bias), dtype=dtype)
        self.group = pg
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.in_features_per_rank = stop - start
        self.input_is_parallel = bool(input_is_parallel)
        weight, bias_values = _full_linear_values(self.in_features, self.out_features, bias, dtype,
                                                  _shared_seed(seed, pg))
        self.weight = Parameter(np.ascontiguousarray(weight[:, start:stop]))
        self.bias = Parameter(bias_values) if bias else None

    def forward(self, x: Any) -> Any:
        """The full output (..., out_features), identical on every rank of the group.

        Args:
            x: this rank's input block (..., in_features / P) if ``input_is_parallel``,
                else the full input (..., in_features).

        Raises:
            ShapeError: the last axis of ``x`` does not match.
        """
        if self.input_is_parallel:
            _check_last_axis(self, x, self.in_features_per_rank, "input")
            x_local = x
        else:
            _check_last_axis(self, x, self.in_features, "input")
            start = self.group.rank * self.in_features_per_rank
            x_local = x[..., start:start + self.in_features_per_rank]
        self._save_cache(x_local)
        xp = array_module(x_local)
        y = xp.ascontiguousarray(x_local @ self.weight.data.T)
        all_reduce(y, ReduceOp.SUM, self.group)
        # After the sum: added on every rank before it, the bias would count P times.
        if self.bias is not None:
            y = y + self.bias.data
        return y

    def backward(self, grad_out: Any) -> Any:
        """Local weight gradient and the replicated bias gradient; returns the input gradient.

        Args:
            grad_out: d loss / d output (..., out_features), the same on every rank of the group.

        Returns:
            d loss / d input: this rank's block (..., in_features / P) if
            ``input_is_parallel``, else the full (..., in_features), all-gathered.
        """
        x_local = self._pop_cache()
        _check_last_axis(self, grad_out, self.out_features, "output gradient")
        g2 = grad_out.reshape(-1, self.out_features)
        if self.bias is not None:
            self.bias.accumulate_grad(g2.sum(axis=0))
        self.weight.accumulate_grad(g2.T @ x_local.reshape(-1, self.in_features_per_rank))
        grad_in = grad_out @ self.weight.data
        if not self.input_is_parallel:
            grad_in = _gather_last_axis(grad_in, self.group)
        return grad_in

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_features_per_rank={self.in_features_per_rank}, tp_size={self.group.size}, "
                f"input_is_parallel={self.input_is_parallel}, bias={self.bias is not None}")


class TensorParallelMLP(Module):
    """Transformer MLP block split over a tensor-parallel group: column, GELU, row.

    ``fc1`` is a ``ColumnParallelLinear(hidden, ffn_hidden)`` without output
    gather, ``act`` an exact ``nn.GELU``, ``fc2`` a ``RowParallelLinear(ffn_hidden,
    hidden)`` taking the parallel input: the hidden activation stays split, so a
    step costs one all-reduce in forward (in ``fc2``) and one in backward (in
    ``fc1``). Input and output are full and identical on every rank.

    With an explicit seed it computes the same function, and its shards are
    slices of the same weights, as ``TensorParallelMLP.dense_equivalent(hidden,
    ffn_hidden, dtype, seed)``, i.e. ``nn.Sequential(nn.Linear(hidden,
    ffn_hidden), nn.GELU(), nn.Linear(ffn_hidden, hidden))`` seeded with the
    two children of ``seed`` (as ``nn.MultiHeadAttention`` seeds its projections).

    Args:
        hidden: model width (input and output features).
        ffn_hidden: width of the inner layer; divisible by the group size.
        group: the tensor-parallel process group (None: the current world's default group).
        dtype: parameter dtype.
        seed: int, SeedSequence or Generator, the same on every rank of the group
            (None: group rank 0 picks fresh entropy and broadcasts it; collective).

    Raises:
        ConfigurationError: ``ffn_hidden`` not divisible by the group size, or a negative size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks of the group build it with different geometry
            (sizes, flags, dtype), or another rank's checks failed; raised on every rank
            before anything else is sent.
    """

    def __init__(self, hidden: int, ffn_hidden: int, group: Optional[ProcessGroup] = None,
                 dtype: Any = np.float32, seed: _init.SeedLike = None) -> None:
        super().__init__()
        pg = resolve_group(group).require_member("TensorParallelMLP")
        problem = None
        try:
            # Checked here too, so the message names the block's own argument.
            _check_sizes("TensorParallelMLP", hidden, ffn_hidden)
            partition_range(int(ffn_hidden), pg.rank, pg.size, "TensorParallelMLP ffn_hidden")
        except AxonError as exc:
            problem = exc
        # One exchange for the whole block: its two layers follow from these numbers.
        _agree_on_geometry(pg, "TensorParallelMLP", problem, hidden=hidden, ffn_hidden=ffn_hidden, dtype=dtype)
        self.hidden = int(hidden)
        self.ffn_hidden = int(ffn_hidden)
        seeds = _init.child_seeds(_shared_seed(seed, pg), 2)
        with agreed():
            self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, group=pg, gather_output=False, dtype=dtype,
                                            seed=seeds[0])
            self.act = GELU()
            self.fc2 = RowParallelLinear(ffn_hidden, hidden, group=pg, input_is_parallel=True, dtype=dtype,
                                         seed=seeds[1])

    @staticmethod
    def dense_equivalent(hidden: int, ffn_hidden: int, dtype: Any = np.float32,
                         seed: _init.SeedLike = None) -> Sequential:
        """The single-process MLP that ``TensorParallelMLP(hidden, ffn_hidden, dtype=dtype, seed=seed)`` shards.

        Args:
            hidden: model width.
            ffn_hidden: inner width.
            dtype: parameter dtype.
            seed: the seed given to the tensor-parallel block (not None, or the two differ).

        Returns:
            ``nn.Sequential(nn.Linear(hidden, ffn_hidden), nn.GELU(), nn.Linear(ffn_hidden, hidden))``
            with the same initial values as the union of the shards.
        """
        seeds = _init.child_seeds(seed, 2)
        return Sequential(Linear(hidden, ffn_hidden, dtype=dtype, seed=seeds[0]), GELU(),
                          Linear(ffn_hidden, hidden, dtype=dtype, seed=seeds[1]))

    def forward(self, x: Any) -> Any:
        """The block's output (..., hidden) from the full input (..., hidden)."""
        return self.fc2(self.act(self.fc1(x)))

    def backward(self, grad_out: Any) -> Any:
        """Backward through fc2, GELU and fc1; returns the full input gradient."""
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, tp_size={self.fc1.group.size}"


class TensorParallelAttention(Module):
    """Multi-head self-attention with its heads split over a tensor-parallel group.

    Rank r of a group of P holds heads ``[r*H/P, (r+1)*H/P)``. ``q_proj``,
    ``k_proj`` and ``v_proj`` are ``ColumnParallelLinear(E, E)`` without output
    gather (rank r keeps the rows of W_q, W_k, W_v, and of their biases, that
    produce its heads); the attention runs on the local heads only; ``out_proj``
    is a ``RowParallelLinear(E, E)`` taking the parallel input (the columns of
    W_o that read its heads; the bias replicated). A step costs one all-reduce
    in forward (in ``out_proj``) and one in backward: the three projections'
    partial input gradients are added locally and summed over the group once.
    Input and output are full (B, T, E) and identical on every rank.

    Initialisation equals ``nn.MultiHeadAttention(embed_dim, num_heads, bias,
    causal, dtype, seed)``: the same child seeds and draws (Glorot-uniform q/k/v
    weights, Linear-default out_proj weight, zero biases), each rank keeping its
    slice, so with an explicit seed the block computes the same function as that
    dense layer and its parameters and gradients are slices of the dense ones.

    Args:
        embed_dim: E, the model width.
        num_heads: H, the total number of heads; divides ``embed_dim`` and is divisible
            by the group size.
        group: the tensor-parallel process group (None: the current world's default group).
        bias: learn biases in the four projections.
        causal: position t attends only to positions <= t.
        dtype: parameter dtype.
        seed: int, SeedSequence or Generator, the same on every rank of the group
            (None: group rank 0 picks fresh entropy and broadcasts it; collective).

    Raises:
        ConfigurationError: ``num_heads`` does not divide ``embed_dim``, a non-positive size,
            or ``num_heads`` not divisible by the group size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks of the group build it with different geometry
            (sizes, flags, dtype), or another rank's checks failed; raised on every rank
            before anything else is sent.
    """

    def __init__(self, embed_dim: int, num_heads: int, group: Optional[ProcessGroup] = None,
                 bias: bool = True, causal: bool = False, dtype: Any = np.float32,
                 seed: _init.SeedLike = None) -> None:
        super().__init__()
        pg = resolve_group(group).require_member("TensorParallelAttention")
        problem, head_start, head_stop = None, 0, 0
        try:
            if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
                raise ConfigurationError(f"TensorParallelAttention needs num_heads dividing embed_dim, both "
                                         f"positive; got embed_dim={embed_dim}, num_heads={num_heads}")
            head_start, head_stop = partition_range(int(num_heads), pg.rank, pg.size,
                                                    "TensorParallelAttention num_heads")
        except AxonError as exc:
            problem = exc
        # Before any other message (seed=None broadcasts): one exchange for the whole block.
        _agree_on_geometry(pg, "TensorParallelAttention", problem, embed_dim=embed_dim, num_heads=num_heads,
                           bias=bool(bias), causal=bool(causal), dtype=dtype)
        self.group = pg
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.num_heads_per_rank = head_stop - head_start
        self.head_dim = self.embed_dim // self.num_heads
        self.causal = bool(causal)
        # As nn.MultiHeadAttention: four child seeds; each projection first draws like
        # nn.Linear (so a Generator seed advances alike), then q/k/v weights are redrawn
        # Glorot-uniform over the packed (3E, E) matrix and all biases zeroed.
        seeds = _init.child_seeds(_shared_seed(seed, pg), 4)
        with agreed():
            self.q_proj, self.k_proj, self.v_proj = (
                ColumnParallelLinear(embed_dim, embed_dim, group=pg, gather_output=False, bias=bias, dtype=dtype,
                                     seed=s) for s in seeds[:3])
            self.out_proj = RowParallelLinear(embed_dim, embed_dim, group=pg, input_is_parallel=True, bias=bias,
                                              dtype=dtype, seed=seeds[3])
        in_bound = _init.xavier_bound(embed_dim, 3 * embed_dim)
        rows = slice(head_start * self.head_dim, head_stop * self.head_dim)
        for proj, s in zip((self.q_proj, self.k_proj, self.v_proj), seeds[:3]):
            full = _init.uniform(_init.make_rng(s), (self.embed_dim, self.embed_dim), in_bound, dtype)
            proj.weight.data[...] = full[rows]
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                proj.bias.data[...] = 0

    @staticmethod
    def dense_equivalent(embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False,
                         dtype: Any = np.float32, seed: _init.SeedLike = None) -> MultiHeadAttention:
        """The single-process layer that ``TensorParallelAttention`` with the same arguments shards.

        Returns:
            ``nn.MultiHeadAttention(embed_dim, num_heads, bias, causal, dtype, seed)`` (pass a
            seed that is not None, or the two differ).
        """
        return MultiHeadAttention(embed_dim, num_heads, bias=bias, causal=causal, dtype=dtype, seed=seed)

    def forward(self, x: Any) -> Any:
        """Self-attention over the full ``x`` (B, T, E); returns the full (B, T, E) on every rank.

        Raises:
            ShapeError: ``x`` is not 3-D with last axis ``embed_dim``.
        """
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
        xs = [proj._pop_cache() for proj in projs]
        grads = [proj._local_grad_out(merge_heads(g)) for proj, g in zip(projs, (dv, dk, dq))]
        xp = array_module(dctx)
        grad_in = grads[0] @ projs[0].weight.data
        for proj, g in zip(projs[1:], grads[1:]):
            grad_in = grad_in + g @ proj.weight.data
        grad_in = xp.ascontiguousarray(grad_in)
        # One sum of the three partial input gradients, overlapped with the parameter gradients.
        work = all_reduce(grad_in, ReduceOp.SUM, self.group, async_op=True)
        for proj, g, x in zip(projs, grads, xs):
            proj._accumulate_param_grads(g, x)
        work.wait(self.group.effective_timeout())
        return grad_in

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_heads_per_rank={self.num_heads_per_rank}, tp_size={self.group.size}, causal={self.causal}")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelAttention", "TensorParallelMLP",
           "partition_range"]
