"""SGD with momentum, dampening, weight decay and Nesterov, as torch.optim.SGD."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

from .._dtypes import array_module
from ..errors import ConfigurationError
from . import fused as _fused
from .optimizer import Optimizer, check_non_negative


class SGD(Optimizer):
    """Stochastic gradient descent with PyTorch's update rule.

    With g = grad + weight_decay * p: if momentum is 0, p -= lr * g. Otherwise
    buf = g on the first step and buf = momentum * buf + (1 - dampening) * g
    after; p -= lr * (g + momentum * buf) with Nesterov, else p -= lr * buf.

    Args:
        params: Parameters to update.
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        fused: update each cupy parameter of float32 or float64 with one
            kernel, bit for bit the unfused update (None, the default: where
            possible while ``settings.fused_kernels`` is on; True: every
            parameter, else ConfigurationError; False: never). See
            ``axonhpc.optim.fused``.

    Raises:
        ConfigurationError: a negative value, nesterov without momentum or with
            dampening, or ``fused=True`` with a parameter the kernel does not serve.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, fused: Optional[bool] = None) -> None:
        check_non_negative("SGD", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigurationError(f"SGD nesterov needs momentum > 0 and dampening 0, got momentum={momentum}, "
                                     f"dampening={dampening}")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=bool(nesterov))
        self.fused = _fused.check_fused(fused, self.params, "SGD")

    def _update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
        if _fused.fuses(self.fused, param.data, grad):
            self._fused_update(param.data, grad, state)
            return
        if self.weight_decay != 0:
            grad = grad + self.weight_decay * param.data
        if self.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.copy()
            else:
                buf *= self.momentum
                buf += grad if self.dampening == 0 else (1 - self.dampening) * grad  # 1 * g is g: no pass
            grad = grad + self.momentum * buf if self.nesterov else buf
        data = param.data
        data -= self.lr * grad

    def _fused_update(self, data: Any, grad: Any, state: Dict[str, Any]) -> None:
        xp, buf, first = array_module(data), None, False
        if self.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = xp.empty_like(data)
                first = True
        _fused.sgd(xp, data, grad, buf, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                   weight_decay=self.weight_decay, nesterov=self.nesterov, first=first)


__all__ = ["SGD"]
