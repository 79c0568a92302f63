"""A strategy's own optimizer, built from a class and its hyperparameters on every rank alike.

ZeRO-1 and the parameter server build the optimizer over their shards themselves, inside the model
comparison (``same_model.compared_model``), so that what one rank's optimizer rejects reaches every rank,
and the ranks compare the class and every hyperparameter, defaults included: ranks with another ``lr``
would each update their own part of the model with their own, a silent wrong answer.
"""
from __future__ import annotations

import difflib
import inspect
import numbers
from typing import Any, Dict, List

import numpy as np

from ..errors import AxonError, ConfigurationError
from ..optim.optimizer import Optimizer


def build_optimizer(what: str, optimizer_class: Any, params: List[Any], optimizer_args: Dict[str, Any]) -> Optimizer:
    """``optimizer_class(params, **optimizer_args)``: an ``Optimizer`` subclass or a function giving one.

    Raises:
        ConfigurationError: a keyword it does not take (naming the closest it does), anything else its
            constructor raises that is not an axonhpc error (a user's subclass), or a function that returns no
            ``Optimizer``; each naming ``what`` and the call.
    """
    _check_keywords(what, optimizer_class, optimizer_args)
    try:
        optimizer = optimizer_class(params, **optimizer_args)
    except AxonError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's Optimizer subclass: every rank must hear of it
        given = ", ".join(f"{k}={v!r}" for k, v in optimizer_args.items())
        raise ConfigurationError(f"{what}: {_name(optimizer_class)}({given}) rejected its hyperparameters: "
                                 f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(optimizer, Optimizer):  # a function that returned something else
        raise ConfigurationError(f"{what}: {optimizer_class!r} returned a {type(optimizer).__name__}, not an "
                                 f"axonhpc.optim.Optimizer")
    return optimizer


def _name(optimizer_class: Any) -> str:
    return getattr(optimizer_class, "__name__", type(optimizer_class).__name__)


def _check_keywords(what: str, optimizer_class: Any, optimizer_args: Dict[str, Any]) -> None:
    """ConfigurationError naming an argument that ``optimizer_class`` does not take (a misspelled hyperparameter)."""
    try:
        signature = inspect.signature(optimizer_class)
    except (TypeError, ValueError):  # no signature to read: the constructor itself decides
        return
    taken = list(signature.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken):
        return
    names = [p.name for p in taken[1:]  # the first takes the parameters
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in optimizer_args:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(f"{what}: {_name(optimizer_class)} takes no hyperparameter {key!r} "
                                     f"(got {key}={optimizer_args[key]!r}); it takes {names}{hint}")


def shown(value: Any) -> str:
    """A hyperparameter as every rank writes it alike: 0.1 and numpy's float64(0.1) the same, 1 and 1.0 too, a
    function or an object of a default repr (its address differs in every process) by its type's name."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(shown(v) for v in value) + ")"
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return repr(float(value))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def optimizer_settings(optimizer: Optimizer, optimizer_args: Dict[str, Any]) -> List[str]:
    """``optimizer: SGD`` and one ``optimizer <name>: value`` line per hyperparameter (the optimizer's, defaults
    included, and any other argument given), sorted by name: what the ranks must pass alike, as
    ``compared_model`` settings."""
    values = dict(optimizer_args)
    values.update(optimizer.hyperparameters())
    cls = type(optimizer)
    return [f"optimizer: {cls.__module__}.{cls.__qualname__}"] + [f"optimizer {name}: {shown(values[name])}"
                                                                  for name in sorted(values)]


__all__ = ["build_optimizer", "optimizer_settings", "shown"]
