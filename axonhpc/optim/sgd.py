"""SGD with momentum, dampening, weight decay and Nesterov, as torch.optim.SGD."""
from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .._dtypes import array_module
from ..cuda import capture, kernels as cuda_kernels
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
        fused: update the float32 or float64 parameters with fused kernels
            (cupy: one launch a step for those of one dtype; numpy: one
            compiled pass, C-contiguous arrays), bit for bit the unfused
            update (None, the default: where possible while
            ``settings.fused_kernels`` is on; True: every parameter, else
            ConfigurationError; False: never). See ``axonhpc.optim.fused``.

    Raises:
        ConfigurationError: a negative value, nesterov without momentum or with
            dampening, or ``fused=True`` with a parameter the kernel does not serve.
    """

    state_keys = ("momentum_buffer",)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, fused: Optional[bool] = None) -> None:
        check_non_negative("SGD", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigurationError(f"SGD nesterov needs momentum > 0 and dampening 0, got momentum={momentum}, "
                                     f"dampening={dampening}")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=bool(nesterov))
        self.fused = _fused.check_fused(fused, self.params, "SGD")
        self._tables = cuda_kernels.TensorTables()

    def _update_together(self, pending: List[Tuple[Any, Dict[str, Any]]]) -> List[Tuple[Any, Dict[str, Any]]]:
        """The parameters ``fused.joins`` takes, one launch per dtype and first-step flag (see ``optim.fused``)."""
        if capture.capturing():
            self._capture_update(pending)
            return []
        groups: Dict[Tuple[Any, bool], List[Tuple[Any, Any, Any]]] = {}
        rest = []
        for p, state in pending:
            if _fused.joins(self.fused, p.data, p.grad, state.get("momentum_buffer")):
                buf, first = self._buffer(p.data, state)
                groups.setdefault((p.data.dtype, first), []).append((p.data, p.grad, buf))
            else:
                rest.append((p, state))
        for (_, first), members in groups.items():
            datas, grads, bufs = (list(column) for column in zip(*members))
            _fused.sgd_many(array_module(datas[0]), self._tables, datas, grads, bufs, lr=self.lr,
                            momentum=self.momentum, dampening=self.dampening, weight_decay=self.weight_decay,
                            nesterov=self.nesterov, first=first)
        return rest

    def _capture_update(self, pending: List[Tuple[Any, Dict[str, Any]]]) -> None:
        """Capture every update in a CUDA graph (see [Note: updates in a CUDA graph] in ``optim.fused``)."""
        momentum = self.momentum != 0
        groups = _fused.captured_groups(self.fused, pending, "SGD", lambda s: (s.get("momentum_buffer"),),
                                        lambda s: not momentum or "momentum_buffer" in s, lambda s: None)
        variant = self._variant()
        for members in groups.values():
            lists = [[p.grad for p, _ in members], [p.data for p, _ in members]]
            if momentum:
                lists.append([s["momentum_buffer"] for _, s in members])
            scalars = _fused.captured_launch(array_module(lists[1][0]), self._tables, "sgd", variant,
                                             _fused._sgd_source, lists, 4)
            capture.before_replay(functools.partial(self._before_replay, scalars, variant))

    def _variant(self) -> tuple:
        """The kernel flags of a step after the first (the only kind a graph replays)."""
        return _fused.sgd_variant(self.momentum, self.dampening, self.weight_decay, self.nesterov, False)

    def _before_replay(self, scalars: Any, variant: tuple) -> None:
        """Write this step's scalars (the current learning rate among them) for a replay of the captured update."""
        _fused.check_variant("SGD", variant, self._variant(), self.hyperparameters())
        cuda_kernels.fill(array_module(scalars), scalars,
                      _fused.sgd_scalars(scalars.dtype.type, self.lr, self.momentum, self.dampening,
                                         self.weight_decay))

    def _buffer(self, data: Any, state: Dict[str, Any]) -> Tuple[Any, bool]:
        """The fused update's momentum buffer (None without momentum), and whether it is new (the first step)."""
        if self.momentum == 0:
            return None, False
        buf = state.get("momentum_buffer")
        if buf is not None:
            return buf, False
        buf = state["momentum_buffer"] = array_module(data).empty_like(data)
        return buf, True

    def _update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
        if _fused.fuses(self.fused, param.data, grad, state.get("momentum_buffer")):
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
        buf, first = self._buffer(data, state)
        _fused.sgd(array_module(data), data, grad, buf, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                   weight_decay=self.weight_decay, nesterov=self.nesterov, first=first)


__all__ = ["SGD"]
