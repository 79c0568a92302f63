"""Column- and row-parallel linear layers, and the MLP made of one of each (see the package notes)."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from ..._dtypes import array_module
from ...backends import ReduceOp
from ...collectives import all_reduce
from ...groups import ProcessGroup, resolve_group
from ...nn import GELU, Linear, Module, Parameter, Sequential
from ...nn import initializers
from ...nn.autocast import (add_bias, linear_backward, linear_grad_output, linear_input_grad, linear_param_grads,
                            linear_product)
from ..same_model import agreed
from .partition import (check_last_axis, check_sizes, full_linear_values, gather_last_axis, my_part, partition_range,
                        same_geometry, shared_seed)


class ColumnParallelLinear(Module):
    """Linear layer whose output features are split across a tensor-parallel group (rank r: rows ``[r*k, (r+1)*k)``).

    Forward takes the full, replicated input and returns this rank's output block (or the full output with
    ``gather_output``); backward all-reduces the input gradient.

    Args:
        gather_output: all-gather the output blocks; backward then takes the full output gradient.
        seed: the same on every rank; the full weight is drawn as ``nn.Linear(..., seed=seed)`` draws it.
            None: group rank 0 picks fresh entropy and broadcasts it (collective).

    Raises:
        ConfigurationError: a negative size, or ``out_features`` not divisible by the group size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks build it with different geometry, or another rank's checks failed.
    """

    def __init__(self, in_features: int, out_features: int, group: Optional[ProcessGroup] = None,
                 gather_output: bool = False, bias: bool = True, dtype: Any = np.float32,
                 seed: initializers.SeedLike = None) -> None:
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

    def split_axes(self) -> List[Tuple[Parameter, int]]:
        """The parameters this layer splits over its group, each with the axis it is cut along: weight and bias, 0."""
        return [(p, 0) for p in (self.weight, self.bias) if p is not None]

    def forward(self, x: Any) -> Any:
        """This rank's output block (..., out_features / P), or the full output if ``gather_output``; ShapeError on a bad ``x``."""
        check_last_axis(self, x, self.in_features, "input")
        y, saved = linear_product(x, self.weight.data)  # in the autocast dtype under nn.autocast
        self._save_cache(saved)
        if self.bias is not None:
            y = add_bias(y, self.bias.data, saved)
        if self.gather_output:
            y = gather_last_axis(y, self.group)
        return y

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Collective: local weight/bias gradients; returns d loss / d x summed over the group.

        ``input_grad=False`` skips the input gradient and its all-reduce (the same value on every rank).
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
        """The first half of ``backward``, with no communication: ``(block, saved)``, for layers that sum partial input gradients themselves."""
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
    """Linear layer whose input features are split across a tensor-parallel group (rank r: columns ``[r*k, (r+1)*k)``).

    Forward all-reduces the partial products and adds the replicated bias once; the output is full on every rank.

    Args:
        input_is_parallel: the input is already this rank's block, as a ``ColumnParallelLinear`` without
            ``gather_output`` produces it; else the full input (backward all-gathers its gradient).
        seed: as ``ColumnParallelLinear``'s.

    Raises:
        ConfigurationError: a negative size, or ``in_features`` not divisible by the group size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks build it with different geometry, or another rank's checks failed.
    """

    def __init__(self, in_features: int, out_features: int, group: Optional[ProcessGroup] = None,
                 input_is_parallel: bool = True, bias: bool = True, dtype: Any = np.float32,
                 seed: initializers.SeedLike = None) -> None:
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

    def split_axes(self) -> List[Tuple[Parameter, int]]:
        """The parameters this layer splits over its group, each with the axis it is cut along: the weight, 1.

        The bias is added after the sum, whole and the same on every rank of the group.
        """
        return [(self.weight, 1)]

    def forward(self, x: Any) -> Any:
        """Collective: the full output (..., out_features), identical on every rank; ShapeError on a bad ``x``."""
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
        """Local weight and replicated bias gradients; returns the input gradient (this rank's block if ``input_is_parallel``)."""
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
    """Transformer MLP split over a tensor-parallel group: column, GELU, row; one all-reduce each way.

    With an explicit seed it computes the same function as ``TensorParallelMLP.dense_equivalent(...)``.

    Raises:
        ConfigurationError: ``ffn_hidden`` not divisible by the group size, or a negative size.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks build it with different geometry, or another rank's checks failed.
    """

    def __init__(self, hidden: int, ffn_hidden: int, group: Optional[ProcessGroup] = None,
                 dtype: Any = np.float32, seed: initializers.SeedLike = None) -> None:
        super().__init__()
        pg = resolve_group(group).require_member("TensorParallelMLP")
        # One exchange for the whole block: its two layers follow from these numbers.
        with same_geometry(pg, "TensorParallelMLP", hidden=hidden, ffn_hidden=ffn_hidden, dtype=dtype):
            # Checked here too, so the message names the block's own argument.
            check_sizes("TensorParallelMLP", hidden, ffn_hidden)
            partition_range(int(ffn_hidden), pg.rank, pg.size, "TensorParallelMLP ffn_hidden")
        self.hidden = int(hidden)
        self.ffn_hidden = int(ffn_hidden)
        seeds = initializers.child_seeds(shared_seed(seed, pg), 2)
        with agreed():
            self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, group=pg, gather_output=False, dtype=dtype,
                                            seed=seeds[0])
            self.act = GELU()
            self.fc2 = RowParallelLinear(ffn_hidden, hidden, group=pg, input_is_parallel=True, dtype=dtype,
                                         seed=seeds[1])

    @staticmethod
    def dense_equivalent(hidden: int, ffn_hidden: int, dtype: Any = np.float32,
                         seed: initializers.SeedLike = None) -> Sequential:
        """The single-process ``Sequential(Linear, GELU, Linear)`` that ``TensorParallelMLP(..., seed=seed)`` shards (seed not None)."""
        seeds = initializers.child_seeds(seed, 2)
        return Sequential(Linear(hidden, ffn_hidden, dtype=dtype, seed=seeds[0]), GELU(),
                          Linear(ffn_hidden, hidden, dtype=dtype, seed=seeds[1]))

    def forward(self, x: Any) -> Any:
        """The block's output (..., hidden) from the full input (..., hidden)."""
        return self.fc2(self.act(self.fc1(x)))

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Backward through fc2, GELU and fc1; returns the full input gradient (None with ``input_grad=False``)."""
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)), input_grad=input_grad)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, tp_size={self.fc1.group.size}"
