"""Dynamic loss scaling for float16 training, with the skip decided by every rank together.

[Note: loss scaling across ranks]
If any rank overflowed, every rank must skip the step, or replicas and shards would drift apart; so ``step``
all-reduces the verdict, and the scale changes the same everywhere (PyTorch's ``GradScaler`` rule).

[Note: the scale in a CUDA graph]
A graph replays its captured arguments, so inside a graphed step ``scale`` multiplies by a one-element
float64 device copy of the scale (same bits as the host's ``grad * scale``). The skip decision is read on
the host, so ``unscale``, ``step`` and ``update`` stay outside the graph, as with PyTorch's.
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional

import numpy as np

from .._dtypes import array_module, finite_flags, is_cupy_array, is_low_precision_float
from ..backends import ReduceOp
from ..collectives import all_reduce
from ..cuda import capture, kernels as cuda_kernels
from ..errors import ArgumentTypeError, ConfigurationError
from ..groups import resolve_group
from ..optim import fused


_STEP_OUTSIDE = ("whether to skip the step is decided on the host from a read of the gradients, and a graph "
                 "would replay one decision; capture the forward and the backward (with scaler.scale) and call "
                 "scaler.step(opt) and scaler.update() after each call of the graphed step")


class GradScaler:
    """Scale the loss gradient, unscale and check the gradients, skip overflowing steps everywhere.

    Usage: ``model.backward(loss_fn.backward(scaler.scale(1.0))); scaler.step(opt); scaler.update()``.

    Args:
        growth_factor: multiplier after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: multiplier after an overflow (in (0, 1)).
        group: the ranks that skip together (None: the current world's group).
        enabled: False makes every method a pass-through.

    Attributes:
        scale_value: the current scale (setting it also updates the device copy graphs read).
        found_inf: whether the last ``step`` found an overflow (and skipped).
        skipped_steps: how many steps were skipped so far.

    Raises:
        ConfigurationError: a factor or interval out of range.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group: Any = None, enabled: bool = True):
        for name, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                            ("backoff_factor", backoff_factor)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ArgumentTypeError(f"GradScaler {name} must be a number, got {type(value).__name__} {value!r}")
        if not init_scale > 0:
            raise ConfigurationError(f"init_scale must be positive, got {init_scale!r}")
        if not growth_factor > 1:
            raise ConfigurationError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ConfigurationError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ConfigurationError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self._device_scale: Any = None  # the one-element float64 copy graphed steps read
        self.scale_value = float(init_scale) if enabled else 1.0
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.group = group
        self.enabled = bool(enabled)
        self.found_inf = False
        self.skipped_steps = 0
        self._clean_steps = 0
        self._unscaled: Optional[int] = None
        self._tables = cuda_kernels.TensorTables()  # the unscale kernel's address tables

    @property
    def scale_value(self) -> float:
        """The current scale."""
        return self._scale

    @scale_value.setter
    def scale_value(self, value: float) -> None:
        self._scale = float(value)
        if self._device_scale is not None:
            cuda_kernels.fill(array_module(self._device_scale), self._device_scale, [self._scale])

    def scale(self, grad: Any) -> Any:
        """``grad * scale``: a new array, or a float for a float (scale 1.0 before float16 rounding flushes small gradients).

        GraphCaptureError if the first call inside a graphed step is in the capture (no warm-up).
        """
        if not self.enabled:
            return grad
        number = isinstance(grad, (int, float)) and not isinstance(grad, bool)
        if capture.defers_reads() and (is_cupy_array(grad) or (number and capture.current().xp is not None)):
            return self._scale_on_device(grad, number)
        if isinstance(grad, (int, float)) and not isinstance(grad, bool):
            return float(grad) * self.scale_value
        if is_low_precision_float(grad.dtype):  # 2**16, the default scale, is itself beyond float16's 65504
            return (grad.astype(np.float32) * np.float32(self.scale_value)).astype(grad.dtype)
        return grad * grad.dtype.type(self.scale_value)

    def _scale_on_device(self, grad: Any, number: bool) -> Any:
        """``scale`` inside a graphed step: multiplied by the device copy of the scale."""
        xp = capture.current().xp if number else array_module(grad)
        if self._device_scale is None:
            capture.refuse("GradScaler.scale", "its first call in a graphed step must come in an eager "
                                                "(warm-up) call, which makes the device copy of the scale "
                                                "that replays read")
            self._device_scale = xp.empty(1, dtype=np.float64)
            cuda_kernels.fill(xp, self._device_scale, [self._scale])
        scale = self._device_scale.reshape(())
        if number:
            return scale * float(grad)
        if is_low_precision_float(grad.dtype):
            return (grad.astype(np.float32) * scale.astype(np.float32)).astype(grad.dtype)
        return grad * scale.astype(grad.dtype)

    def unscale(self, optimizer: Any) -> bool:
        """Collective: divide the optimizer's gradients by the scale once before ``update``; True if any rank found inf/NaN."""
        if self._unscaled == id(optimizer):
            return self.found_inf
        capture.refuse("GradScaler.unscale", _STEP_OUTSIDE)
        grads = [p.grad for p in optimizer.params if p.grad is not None]
        bad = 0.0 if all(self._unscale(grads) if self.enabled else finite_flags(grads)) else 1.0
        if self.enabled:
            flag = np.array([bad], dtype=np.float64)
            all_reduce(flag, ReduceOp.MAX, resolve_group(self.group))
            bad = float(flag[0])
        self.found_inf = bad > 0
        self._unscaled = id(optimizer)
        return self.found_inf

    def _unscale(self, grads: List[Any]) -> List[bool]:
        """Divide ``grads`` by the scale in place; whether each is then finite, with one device read."""
        inverse = 1.0 / self.scale_value
        together: Dict[Any, List[Any]] = {}
        alone = []
        for g in grads:
            if is_cupy_array(g) and fused.joins(None, g, g):  # the device's multi-tensor unscale
                together.setdefault(g.dtype, []).append(g)
            else:
                alone.append(g)
                g *= g.dtype.type(inverse)
        verdicts = []
        if together:
            xp = array_module(next(iter(together.values()))[0])
            found = xp.zeros(1, dtype=np.int32)
            for group in together.values():
                fused.unscale_many(xp, self._tables, group, inverse, found)
            verdicts.append(found.reshape(()) == 0)
        return finite_flags(alone, verdicts)

    def step(self, optimizer: Any) -> bool:
        """Collective: unscale, then ``optimizer.step()`` unless some rank overflowed; True if taken (on every rank)."""
        if self.unscale(optimizer):
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale from the last step's verdict (the same on every rank)."""
        capture.refuse("GradScaler.update", _STEP_OUTSIDE)
        self._unscaled = None
        if not self.enabled:
            return
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self._clean_steps = 0

    def state_dict(self) -> dict:
        """Scale and counters as plain data, for checkpoints."""
        return {"scale": self.scale_value, "clean_steps": self._clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.scale_value = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


__all__ = ["GradScaler"]
