"""Column- and row-parallel linear layers, and the MLP made of one of each (see the package notes)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..._dtypes import array_module
from ...backends import ReduceOp
from ...collectives import all_reduce
from ...groups import ProcessGroup, resolve_group
from ...nn import GELU, Linear, Module, Parameter, Sequential
from ...nn import _init
from ...nn.autocast import (add_bias, linear_backward, linear_grad_output, linear_input_grad, linear_param_grads,
                            linear_product)
from ..same_model import agreed
from .partition import (check_last_axis, check_sizes, full_linear_values, gather_last_axis, my_part, partition_range,
                        same_geometry, shared_seed)


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
        start, stop = my_part(pg, "ColumnParallelLinear", in_features, out_features, "out_features",
                               gather_output=bool(gather_output), bias=bool(bias), dtype=dtype)
        self.group = pg
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.out_features_per_rank = stop - start
        self.gather_output = bool(gather_output)
        weight, bias_values = full_linear_values(self.in_features, self.out_features, bias, dtype,
                                                  shared_seed(seed, pg))
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
        check_last_axis(self, x, self.in_features, "input")
        y, saved = linear_product(x, self.weight.data)  # in the autocast dtype under nn.autocast
        self._save_cache(saved)
        if self.bias is not None:
            y = add_bias(y, self.bias.data, saved)
        if self.gather_output:
            y = gather_last_axis(y, self.group)
        return y

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Local weight/bias gradients; returns the full input gradient, summed over the group.

        Args:
            grad_out: d loss / d output: this rank's block (..., out_features / P), or with
                ``gather_output`` the full (..., out_features) gradient.
            input_grad: False (the first layer of a model, whose input is data) skips the
                input gradient's product and its all-reduce, and returns None. Every rank of
                the group must pass the same value, as for any collective.

        Returns:
            d loss / d x (..., in_features), identical on every rank of the group.
        """
        block, saved = self.begin_backward(grad_out)
        if not input_grad:
            self.finish_backward(block, saved)
            return None
        xp = array_module(block)
        grad_in = xp.ascontiguousarray(self.partial_input_grad(block, saved))
        # Start the sum of the partial input gradients first, and compute the
        # parameter gradients while it travels (Megatron overlaps the same way).
        work = all_reduce(grad_in, ReduceOp.SUM, self.group, async_op=True)
        self.finish_backward(block, saved)
        work.wait(self.group.effective_timeout())
        return grad_in

    def begin_backward(self, grad_out: Any) -> Tuple[Any, Any]:
        """The first half of ``backward``, with no communication.

        For a layer that sums the partial input gradients of several column
        layers itself (``TensorParallelAttention``: one all-reduce for q, k and v).

        Returns:
            ``(block, saved)``: this rank's block of the output gradient (checked; cut from the full gradient
            with ``gather_output``; in the product's dtype under autocast) and what forward kept. This rank's
            partial input gradient is ``partial_input_grad(block, saved)``; pass both to ``finish_backward``.
        """
        saved = self._pop_cache()
        if self.gather_output:
            check_last_axis(self, grad_out, self.out_features, "output gradient")
            start = self.group.rank * self.out_features_per_rank
            grad_out = grad_out[..., start:start + self.out_features_per_rank]
        else:
            check_last_axis(self, grad_out, self.out_features_per_rank, "output gradient")
        return linear_grad_output(grad_out, saved), saved

    def partial_input_grad(self, block: Any, saved: Any) -> Any:
        """This rank's part of d loss / d x, ``block @ weight`` (in the input's dtype), from ``begin_backward``."""
        return linear_input_grad(block, saved, self.weight)

    def finish_backward(self, block: Any, saved: Any) -> None:
        """The second half of ``backward``: the local weight/bias gradients from ``begin_backward``'s pair."""
        linear_param_grads(block, saved, self.weight, self.bias)  # bias first, as in nn.Linear

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
        start, stop = my_part(pg, "RowParallelLinear", in_features, out_features, "in_features",
                               input_is_parallel=bool(input_is_parallel), bias=bool(bias), dtype=dtype)
        self.group = pg
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.in_features_per_rank = stop - start
        self.input_is_parallel = bool(input_is_parallel)
        weight, bias_values = full_linear_values(self.in_features, self.out_features, bias, dtype,
                                                  shared_seed(seed, pg))
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
            check_last_axis(self, x, self.in_features_per_rank, "input")
            x_local = x
        else:
            check_last_axis(self, x, self.in_features, "input")
            start = self.group.rank * self.in_features_per_rank
            x_local = x[..., start:start + self.in_features_per_rank]
        y, saved = linear_product(x_local, self.weight.data)  # in the autocast dtype under nn.autocast
        self._save_cache(saved)
        y = array_module(y).ascontiguousarray(y)
        all_reduce(y, ReduceOp.SUM, self.group)
        # After the sum: added on every rank before it, the bias would count P times.
        if self.bias is not None:
            y = add_bias(y, self.bias.data, saved)
        return y

    def backward(self, grad_out: Any) -> Any:
        """Local weight gradient and the replicated bias gradient; returns the input gradient.

        Args:
            grad_out: d loss / d output (..., out_features), the same on every rank of the group.

        Returns:
            d loss / d input: this rank's block (..., in_features / P) if
            ``input_is_parallel``, else the full (..., in_features), all-gathered.
        """
        saved = self._pop_cache()
        check_last_axis(self, grad_out, self.out_features, "output gradient")
        grad_in = linear_backward(grad_out, saved, self.weight, self.bias)
        if not self.input_is_parallel:
            grad_in = gather_last_axis(grad_in, self.group)
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
        # One exchange for the whole block: its two layers follow from these numbers.
        with same_geometry(pg, "TensorParallelMLP", hidden=hidden, ffn_hidden=ffn_hidden, dtype=dtype):
            # Checked here too, so the message names the block's own argument.
            check_sizes("TensorParallelMLP", hidden, ffn_hidden)
            partition_range(int(ffn_hidden), pg.rank, pg.size, "TensorParallelMLP ffn_hidden")
        self.hidden = int(hidden)
        self.ffn_hidden = int(ffn_hidden)
        seeds = _init.child_seeds(shared_seed(seed, pg), 2)
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

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Backward through fc2, GELU and fc1; returns the full input gradient.

        ``input_grad=False`` goes to fc1 (see ``ColumnParallelLinear.backward``): None is returned.
        """
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)), input_grad=input_grad)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, tp_size={self.fc1.group.size}"
