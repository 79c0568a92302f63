"""SGD with momentum, dampening, weight decay and Nesterov, as torch.optim.SGD."""
from __future__ import annotations

from typing import Any, Dict, Iterable

from ..errors import ConfigurationError
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

    Raises:
        ConfigurationError: a negative value, or nesterov without momentum or with dampening.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        check_non_negative("SGD", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigurationError(f"SGD nesterov needs momentum > 0 and dampening 0, got momentum={momentum}, "
                                     f"dampening={dampening}")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=bool(nesterov))

    def _update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
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


__all__ = ["SGD"]
