"""Per-rank memory of sharded data parallelism: the ZeRO formulas, and what a rank really holds.

[Note: the ZeRO formulas]
With Psi parameters, N ranks and K optimizer bytes per parameter (mixed-precision Adam: 2 + 2 + 12), a rank
holds ``(2 + 2 + K) Psi`` at stage 0, ``(2 + 2) Psi + K Psi / N`` at stage 1, ``2 Psi + (2 + K) Psi / N`` at
stage 2 and ``(2 + 2 + K) Psi / N`` at stage 3 (Rajbhandari et al., "ZeRO", 2020, figure 1: 7.5B parameters
on 64 ranks take 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per rank).

[Note: measured memory]
``MemoryTracker`` counts the arrays FSDP itself allocates and drops (gathered parameters, unsharded
gradients, communication copies) and keeps the peak of that sum with the persistent shards. Activations
belong to the model and are not counted.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Union

from ...errors import ConfigurationError

Number = Union[int, float]


class FSDPMemoryStats:
    """Per-rank bytes of parameters, gradients and optimizer state (see the module note).

    Attributes:
        param_bytes, grad_bytes, optimizer_bytes: bytes per rank; ``total_bytes`` their sum.
        stage: the ZeRO stage (0-3).
        world_size: number of ranks sharing the state.
        num_params: number of parameters of the model.
    """

    def __init__(self, param_bytes: float, grad_bytes: float, optimizer_bytes: float, stage: int = 0,
                 world_size: int = 1, num_params: Number = 0):
        self.param_bytes = param_bytes
        self.grad_bytes = grad_bytes
        self.optimizer_bytes = optimizer_bytes
        self.stage = stage
        self.world_size = world_size
        self.num_params = num_params
        self._baseline = None

    @property
    def total_bytes(self) -> float:
        """Parameters + gradients + optimizer state, per rank."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @classmethod
    def estimate(cls, num_params: Number, world_size: int, stage: int, param_bytes: Number = 2,
                 grad_bytes: Number = 2, optimizer_bytes: Number = 12) -> "FSDPMemoryStats":
        """Per-rank memory by the ZeRO formulas.

        Args:
            num_params: parameters of the model (int or float, e.g. 7.5e9).
            stage: 0 (DDP), 1 (optimizer state), 2 (and gradients) or 3 (and parameters).
            optimizer_bytes: K, bytes of optimizer state per parameter (12 for mixed-precision Adam).

        Raises ConfigurationError for a negative size, ``world_size`` < 1 or a stage outside 0-3.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigurationError(f"world_size must be a positive int, got {world_size!r}")
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ConfigurationError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        for name, value in (("num_params", num_params), ("param_bytes", param_bytes),
                            ("grad_bytes", grad_bytes), ("optimizer_bytes", optimizer_bytes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigurationError(f"{name} must be a non-negative number, got {value!r}")
        n = world_size
        params = num_params * param_bytes / (n if stage >= 3 else 1)
        grads = num_params * grad_bytes / (n if stage >= 2 else 1)
        optimizer = num_params * optimizer_bytes / (n if stage >= 1 else 1)
        stats = cls(params, grads, optimizer, stage, world_size, num_params)
        stats._baseline = num_params * (param_bytes + grad_bytes + optimizer_bytes)
        return stats

    def total_memory_mb(self) -> float:
        """``total_bytes`` in MiB."""
        return self.total_bytes / 2**20

    def memory_savings(self) -> float:
        """Fraction of the stage-0 memory this stage saves (0.0 for stage 0)."""
        if not self._baseline:  # no stage-0 figure to compare with, or an empty model
            return 0.0
        return 1.0 - self.total_bytes / self._baseline

    def __repr__(self) -> str:
        return (f"FSDPMemoryStats(stage={self.stage}, world_size={self.world_size}, "
                f"param_bytes={self.param_bytes:.6g}, grad_bytes={self.grad_bytes:.6g}, "
                f"optimizer_bytes={self.optimizer_bytes:.6g}, total_MiB={self.total_memory_mb():.6g})")


class MemoryTracker:
    """Current and peak bytes of FSDP's arrays; ``persistent()`` gives the persistent arrays' bytes now."""

    def __init__(self, persistent: Callable[[], Dict[str, int]]):
        self._persistent = persistent
        self.transient: Dict[str, int] = {"gathered_params": 0, "unsharded_grads": 0, "communication": 0}
        self.peak = 0

    def _update_peak(self) -> None:
        total = sum(self._persistent().values()) + sum(self.transient.values())
        if total > self.peak:
            self.peak = total

    def allocate(self, category: str, nbytes: int) -> None:
        """Count ``nbytes`` more in ``category`` and update the peak."""
        self.transient[category] += int(nbytes)
        self._update_peak()

    def release(self, category: str, nbytes: int) -> None:
        """Count ``nbytes`` less in ``category``."""
        self.transient[category] -= int(nbytes)

    def snapshot(self, extra: Dict[str, int]) -> Dict[str, int]:
        """Bytes by category now, plus ``current`` and ``peak`` totals (``extra`` counted in both)."""
        self._update_peak()
        out = dict(self._persistent())
        out.update(self.transient)
        out.update(extra)
        added = sum(extra.values())
        out["current"] = sum(out.values())
        out["peak"] = self.peak + added
        return out

    def reset_peak(self) -> None:
        """Start a new peak from the current total."""
        self.peak = 0
        self._update_peak()


class CommCounter:
    """Collectives FSDP issued, and the bytes a bandwidth-optimal algorithm sends per rank for them (not the wire's)."""

    FACTORS = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}

    def __init__(self) -> None:
        self.calls: Dict[str, int] = {}
        self.sent_bytes: Dict[str, float] = {}

    def record(self, op: str, full_bytes: int, group_size: int) -> None:
        """Count one ``op`` over ``group_size`` ranks on a buffer of ``full_bytes`` (the unsharded size)."""
        self.calls[op] = self.calls.get(op, 0) + 1
        sent = self.FACTORS[op] * full_bytes * (group_size - 1) / group_size
        self.sent_bytes[op] = self.sent_bytes.get(op, 0.0) + sent

    def total_sent(self) -> float:
        """Bytes this rank sent over all recorded collectives."""
        return sum(self.sent_bytes.values())

    def reset(self) -> None:
        """Forget everything recorded."""
        self.calls.clear()
        self.sent_bytes.clear()


def persistent_bytes(fsdp: Any) -> Dict[str, int]:
    """``{"params", "grads"}``: bytes of the parameter and gradient shards ``fsdp``'s units hold now."""
    params = grads = 0
    for unit in fsdp.units:
        p, g = unit.persistent_bytes()
        params += p
        grads += g
    return {"params": params, "grads": grads}


def memory_stats(tracker: MemoryTracker, optimizer: Any = None) -> Dict[str, int]:
    """``FullyShardedDataParallel.memory_stats``: the tracker's snapshot, with the optimizer's state arrays."""
    opt_bytes = 0
    if optimizer is not None:
        for state in optimizer.state:
            opt_bytes += sum(int(v.nbytes) for v in state.values() if hasattr(v, "nbytes"))
    return tracker.snapshot({"optimizer": opt_bytes})


def memory_estimate(fsdp: Any, optimizer_bytes: Optional[float] = None) -> FSDPMemoryStats:
    """``FullyShardedDataParallel.memory_estimate``: the ZeRO formulas for ``fsdp``'s model, group and strategy."""
    itemsize = fsdp.master_dtype.itemsize
    k = 2 * itemsize if optimizer_bytes is None else optimizer_bytes
    numel = sum(u.numel for u in fsdp.units)
    return FSDPMemoryStats.estimate(numel, fsdp.shard_world_size, fsdp.strategy.zero_stage,
                                    param_bytes=itemsize, grad_bytes=itemsize, optimizer_bytes=k)


__all__ = ["FSDPMemoryStats", "MemoryTracker", "CommCounter", "persistent_bytes", "memory_stats", "memory_estimate"]
