"""The options of FSDP: sharding strategy, CPU offload and mixed precision (with its dtype casts).

Pure data with validation; nothing here communicates.
"""
from __future__ import annotations

import enum
from typing import Any, Optional

import numpy as np

from ..._choices import parse_choice
from ..._dtypes import floating_dtype, is_floating


class ShardingStrategy(enum.Enum):
    """How FSDP spreads parameters, gradients and optimizer state over the group.

    FULL_SHARD (ZeRO-3): everything sharded; a unit is gathered for its forward and again for its backward.
    SHARD_GRAD_OP (ZeRO-2): gradients and optimizer state sharded; a unit stays gathered from its forward
    until its backward is done. NO_SHARD: every rank holds everything (DDP). HYBRID_SHARD: FULL_SHARD inside each
    node, replicated across nodes.
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def parse(cls, value: Any) -> "ShardingStrategy":
        """Accept a ShardingStrategy or its name in any case; UnknownChoiceError otherwise."""
        return parse_choice(cls, value, "sharding strategy")

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of this strategy's per-rank memory (NO_SHARD is 0)."""
        return {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0, "hybrid_shard": 3}[self.value]

    @property
    def frees_after_forward(self) -> bool:
        """True when a unit's gathered parameters are freed right after its forward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class CPUOffload(enum.Enum):
    """What lives in host memory when the model's arrays are on a GPU (cupy).

    PARAMS: the parameter shards and their gradients stay on the host, copied to the device for each gather;
    the optimizer steps on the host. OPTIMIZER_STATES: shards, gradients and optimizer state on the host; the
    device keeps the step's shard copy for its gathers. FULL: the same as PARAMS (a separate name for
    configurations written for PyTorch and DeepSpeed). For host (numpy) models every option is a no-op.
    """

    NONE = "none"
    PARAMS = "params"
    OPTIMIZER_STATES = "optimizer_states"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any) -> "CPUOffload":
        """Accept a CPUOffload, its name in any case, or a bool (True: FULL); UnknownChoiceError otherwise."""
        if value is True:
            return cls.FULL
        if value is False or value is None:
            return cls.NONE
        return parse_choice(cls, value, "cpu_offload option")

    @property
    def any(self) -> bool:
        """True unless NONE."""
        return self is not CPUOffload.NONE

    @property
    def keeps_device_copy(self) -> bool:
        """True for OPTIMIZER_STATES: the device keeps the step's shard copy between gathers."""
        return self is CPUOffload.OPTIMIZER_STATES


def cast(value: Any, dtype: Optional[np.dtype]) -> Any:
    """Floating arrays cast to ``dtype`` (others, and everything when ``dtype`` is None, unchanged)."""
    if dtype is None or not hasattr(value, "dtype") or not is_floating(value.dtype) or value.dtype == dtype:
        return value
    return value.astype(dtype)


def _float_dtype(value: Any, what: str) -> Optional[np.dtype]:
    return None if value is None else floating_dtype(value, what)


class MixedPrecision:
    """Compute and communicate in lower precision, keep the master shards as they are.

    Args:
        param_dtype: dtype the gathered parameters compute in (None: the parameters' own).
        reduce_dtype: dtype the gradients are reduced in (None: ``param_dtype``); float16/bfloat16 reductions
            are summed in a float32 copy and rounded once.
        buffer_dtype: dtype module buffers are cast to at wrapping (None: unchanged).

    The master shards keep the model's dtype, and gradient shards accumulate in it. ConfigurationError for a
    dtype that is not floating.
    """

    def __init__(self, param_dtype: Any = None, reduce_dtype: Any = None, buffer_dtype: Any = None):
        self.param_dtype = _float_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = _float_dtype(reduce_dtype, "reduce_dtype")
        self.buffer_dtype = _float_dtype(buffer_dtype, "buffer_dtype")

    def __repr__(self) -> str:
        return (f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}, "
                f"buffer_dtype={self.buffer_dtype})")


__all__ = ["ShardingStrategy", "CPUOffload", "MixedPrecision", "is_floating", "cast"]
