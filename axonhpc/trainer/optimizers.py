"""The optimizer of a wrapped model: rebuilt over the strategy's own parameters, checked before anything is sent.

FSDP steps on its master shards, ZeRO-1 on its slices and a pipeline stage
on its own layers, so those strategies build a new optimizer of the given
one's class and hyperparameters over their parameters (or call the callable
``params -> Optimizer`` given instead). ``check_rebuildable`` runs first on
every rank, so that a class that cannot be rebuilt is refused before the
wrapper communicates. A pipeline stage of parameter-free layers gets
``NoOptimizer``.
"""
from __future__ import annotations

import inspect
from typing import Any, List

from ..errors import ConfigurationError
from ..optim.optimizer import Optimizer


def check_rebuildable(optimizer: Any) -> None:
    """ConfigurationError unless ``type(optimizer)(params, **optimizer.hyperparameters())`` can be called.

    A strategy that rebuilds the optimizer over other parameters (FSDP's
    shards, ZeRO-1's slices, a pipeline stage's) calls the class with every
    hyperparameter the instance reports. A subclass whose constructor takes
    fewer (``def __init__(self, params, lr)`` over ``optim.SGD``, which reports
    ``momentum`` and the rest too) would fail there with a bare TypeError,
    after the wrapper has already communicated; this check runs first, on
    every rank alike (the same code and optimizer on each), before any message.
    A callable ``params -> Optimizer`` passes.

    Raises:
        ConfigurationError: naming the class, the hyperparameters it does not
            take (or the ones it needs and is not given) and the fix.
    """
    if not isinstance(optimizer, Optimizer):
        return
    cls = type(optimizer)
    hyper = optimizer.hyperparameters()
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to check (a C-implemented class): the call will tell
        return
    try:
        signature.bind(None, **hyper)
    except TypeError as exc:
        taken = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values())
        unknown = [] if takes_any else [name for name in hyper if name not in taken]
        needed = [name for name, p in list(taken.items())[1:] if p.default is inspect.Parameter.empty
                  and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                  and name not in hyper]
        what = []
        if unknown:
            what.append(f"does not take {', '.join(f'{n}={hyper[n]!r}' for n in unknown)}")
        if needed:
            what.append(f"needs {', '.join(needed)}, which hyperparameters() does not report")
        shown = ", ".join(f"{k}={v!r}" for k, v in hyper.items() if k not in unknown)
        raise ConfigurationError(
            f"the strategy rebuilds the optimizer over its own parameters as {cls.__name__}(params, "
            f"**optimizer.hyperparameters()), but {cls.__name__}{signature} "
            f"{' and '.join(what) or f'cannot be called so ({exc})'}; pass a callable instead, e.g. "
            f"optimizer=lambda params: {cls.__name__}(params, {shown})") from None


def rebuild_optimizer(optimizer: Any, params: List[Any]) -> Any:
    """An optimizer of the same class and hyperparameters as ``optimizer`` over ``params``.

    ``optimizer`` may also be a callable ``params -> Optimizer``.

    Raises:
        ConfigurationError: neither an Optimizer nor a callable, or a class that
            cannot be rebuilt from its hyperparameters (``check_rebuildable``).
    """
    if isinstance(optimizer, Optimizer):
        check_rebuildable(optimizer)
        return type(optimizer)(params, **optimizer.hyperparameters())
    if callable(optimizer):
        return optimizer(params)
    raise ConfigurationError(f"optimizer must be an axonhpc.optim.Optimizer or a callable params -> Optimizer, "
                             f"got {type(optimizer).__name__}")


class NoOptimizer:
    """The optimizer of a pipeline stage without parameters: every call does nothing."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing to reset."""

    def step(self) -> None:
        """Nothing to update."""

    def state_dict(self) -> dict:
        """No state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


__all__ = ["check_rebuildable", "rebuild_optimizer", "NoOptimizer"]
