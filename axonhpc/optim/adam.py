"""Adam and AdamW with PyTorch's exact update order."""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .._dtypes import array_module
from ..cuda import capture, kernels as cuda_kernels
from ..errors import ConfigurationError
from . import fused as _fused
from .optimizer import Optimizer, check_non_negative


def _check_betas(owner: str, betas: Tuple[float, float]) -> Tuple[float, float]:
    try:
        values = tuple(float(b) for b in betas)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{owner} betas must be two numbers in [0, 1), got {betas!r}") from None
    if len(values) != 2 or not all(0.0 <= b < 1.0 for b in values):
        raise ConfigurationError(f"{owner} betas must be two numbers in [0, 1), got {values}")
    return values


class Adam(Optimizer):
    """Adam (Kingma & Ba) exactly as torch.optim.Adam (amsgrad off).

    Per step t, with g = grad + weight_decay * p (L2 added to the gradient):
    m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2;
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
    Note eps is added after the bias-corrected square root. The lerp is
    torch's, two-sided: m + w (g - m) for a weight w = 1 - beta1 below 0.5,
    else g - (g - m)(1 - w), so beta1 = 0 gives m = g exactly. The
    operations are torch's, in its order and dtype; torch's CPU kernels fuse
    some into multiply-adds, which these do not, so the results can differ
    from its in the last bit.

    Args:
        params: Parameters to update.
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        fused: update the float32 or float64 parameters with fused kernels
            (cupy: one launch a step for those of one dtype; numpy: one
            compiled pass, C-contiguous arrays), bit for bit the unfused
            update (None, the default: where possible while
            ``settings.fused_kernels`` is on; True: every parameter, else
            ConfigurationError; False: never). See ``axonhpc.optim.fused``.

    Raises:
        ConfigurationError: a negative lr, eps or weight_decay, betas outside
            [0, 1), or ``fused=True`` with a parameter the kernel does not serve.
    """

    _decoupled = False
    state_keys = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, fused: Optional[bool] = None) -> None:
        name = type(self).__name__
        check_non_negative(name, lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, lr=lr, betas=_check_betas(name, betas), eps=eps, weight_decay=weight_decay)
        self.fused = _fused.check_fused(fused, self.params, name)
        self._tables = cuda_kernels.TensorTables()

    @staticmethod
    def _advance(xp: Any, data: Any, state: Dict[str, Any]) -> int:
        """Make the moments on first use and count the step; returns its number."""
        if not state:
            state["step"] = 0
            state["exp_avg"] = xp.zeros_like(data)
            state["exp_avg_sq"] = xp.zeros_like(data)
        state["step"] += 1
        return state["step"]

    def _update_together(self, pending: List[Tuple[Any, Dict[str, Any]]]) -> List[Tuple[Any, Dict[str, Any]]]:
        """The parameters ``fused.joins`` takes, one launch per dtype and step count (see ``optim.fused``)."""
        if capture.capturing():
            self._capture_update(pending)
            return []
        groups: Dict[Tuple[Any, int], List[Tuple[Any, Dict[str, Any]]]] = {}
        rest = []
        for p, state in pending:
            if _fused.joins(self.fused, p.data, p.grad, state.get("exp_avg"), state.get("exp_avg_sq")):
                step = self._advance(array_module(p.data), p.data, state)
                groups.setdefault((p.data.dtype, step), []).append((p, state))
            else:
                rest.append((p, state))
        beta1, beta2 = self.betas
        for (_, step), members in groups.items():
            _fused.adam_many(array_module(members[0][0].data), self._tables, [p.data for p, _ in members],
                             [p.grad for p, _ in members], [s["exp_avg"] for _, s in members],
                             [s["exp_avg_sq"] for _, s in members], lr=self.lr, beta1=beta1, beta2=beta2,
                             eps=self.eps, weight_decay=self.weight_decay, decoupled=self._decoupled, step=step)
        return rest

    def _capture_update(self, pending: List[Tuple[Any, Dict[str, Any]]]) -> None:
        """Capture every update in a CUDA graph (see [Note: updates in a CUDA graph] in ``optim.fused``)."""
        name = type(self).__name__
        groups = _fused.captured_groups(self.fused, pending, name,
                                        lambda s: (s.get("exp_avg"), s.get("exp_avg_sq")),
                                        lambda s: "exp_avg" in s, lambda s: s["step"])
        variant = _fused.adam_variant(self.weight_decay, self._decoupled)
        for members in groups.values():
            lists = ([p.grad for p, _ in members], [p.data for p, _ in members], [s["exp_avg"] for _, s in members],
                     [s["exp_avg_sq"] for _, s in members])
            scalars = _fused.captured_launch(array_module(lists[1][0]), self._tables, "adam", variant,
                                             _fused._adam_source, lists, 8)
            capture.before_replay(functools.partial(self._before_replay, [s for _, s in members], scalars, variant))

    def _before_replay(self, states: List[Dict[str, Any]], scalars: Any, variant: Tuple[bool, bool]) -> None:
        """Advance the step counts and write this step's scalars for a replay of the captured update."""
        _fused.check_variant(type(self).__name__, variant, _fused.adam_variant(self.weight_decay, self._decoupled),
                             self.hyperparameters())
        for state in states:
            state["step"] += 1
        beta1, beta2 = self.betas
        cuda_kernels.fill(array_module(scalars), scalars,
                      _fused.adam_scalars(scalars.dtype.type, self.lr, beta1, beta2, self.eps, self.weight_decay,
                                          states[0]["step"]))

    def _update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
        xp = array_module(param.data)
        data = param.data
        step = self._advance(xp, data, state)
        beta1, beta2 = self.betas
        if _fused.fuses(self.fused, data, grad, state["exp_avg"], state["exp_avg_sq"]):
            _fused.adam(xp, data, grad, state["exp_avg"], state["exp_avg_sq"], lr=self.lr, beta1=beta1,
                        beta2=beta2, eps=self.eps, weight_decay=self.weight_decay, decoupled=self._decoupled,
                        step=step)
            return
        if self.weight_decay != 0:
            if self._decoupled:
                data *= 1 - self.lr * self.weight_decay
            else:
                grad = grad + self.weight_decay * data
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # torch's exp_avg.lerp_(grad, w), w = 1 - beta1 in the parameters' dtype: m + w (g - m) for |w| < 0.5,
        # else g - (g - m)(1 - w), exact where w is 1 (beta1 = 0 keeps the gradient's low bits).
        weight = exp_avg.dtype.type(1 - beta1)
        diff = grad - exp_avg
        if abs(weight) < 0.5:
            diff *= weight
            exp_avg += diff
        else:
            diff *= 1 - weight
            xp.subtract(grad, diff, out=exp_avg)
        # torch's exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): v b2 + ((1 - b2) g) g
        exp_avg_sq *= beta2
        square = grad * (1 - beta2)
        square *= grad
        exp_avg_sq += square
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denom = xp.sqrt(exp_avg_sq)
        denom /= math.sqrt(bias_correction2)
        denom += self.eps
        # torch's param.addcdiv_(exp_avg, denom, value=-step_size): p + ((-step_size) m) / denom
        update = exp_avg * (self.lr / bias_correction1)
        update /= denom
        data -= update


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.

    Each step first shrinks p *= 1 - lr * weight_decay, then applies the Adam
    update to the plain gradient.

    Args:
        params: Parameters to update.
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled decay coefficient.
        fused: as for ``Adam``.

    Raises:
        ConfigurationError: as for ``Adam``.
    """

    _decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, fused: Optional[bool] = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


__all__ = ["Adam", "AdamW"]
