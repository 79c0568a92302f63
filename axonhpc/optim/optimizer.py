"""Optimizer base: the parameter list, per-parameter state, and state dicts.

[Note: in-place updates]
Optimizers change ``p.data`` in place and never rebind it, because a sharded or bucketed wrapper may hold
views of the parameter arrays. State arrays use the parameter's array module, so updates run on its device.

[Note: state dict format]
``state_dict()`` is plain data a checkpoint stores without pickle: ``{"hyperparameters": {name: number |
bool | list}, "state": [one dict per parameter, in order, of "step": int and array copies]}``. The state of
a segmented Parameter may add ``"segments"``: a list of None or dicts of numbers ([Note: segmented
parameters] in ``optim.segments``).
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .._dtypes import array_module, is_cupy_array, is_floating
from ..cuda import capture
from ..errors import ArgumentTypeError, ConfigurationError, GraphCaptureError, StateDictError
from ..observe.tracing import span
from .segments import STATE_KEY, SplitStep, check_entries, copy_entries


def _as_array_like(value: Any, like: Any) -> Any:
    """A copy of ``value`` on the device and with the dtype of ``like``."""
    if is_cupy_array(value) and not is_cupy_array(like):
        value = value.get()
    return array_module(like).array(value, dtype=like.dtype, copy=True)


def _state_array(value: Any, like: Any) -> Tuple[Any, Optional[str]]:
    """``(value as an array, None)`` if it can be state of a parameter ``like``, else ``(None, what is wrong)``.

    Arrays of the parameter's shape with real numbers fit, and so do nested lists of them (what a JSON or YAML
    round trip makes of the arrays): ``load_state_dict`` copies them in with the parameter's dtype.
    """
    if not hasattr(value, "shape"):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as exc:
            return None, f"is a {type(value).__name__} that is not an array ({exc})"
    if not (is_floating(value.dtype) or np.dtype(value.dtype).kind in "iu"):  # bfloat16 is no "f" kind
        return None, f"has dtype {np.dtype(value.dtype)}, not real numbers"
    if tuple(value.shape) != tuple(like.shape):
        return None, f"has shape {tuple(value.shape)}, the parameter has {tuple(like.shape)}"
    return value, None


def _plain(value: Any) -> Any:
    """Hyperparameter value as JSON-able data (tuples become lists, numpy scalars Python ones)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


class Optimizer:
    """Base class: holds ``params``, per-parameter ``state`` and hyperparameters.

    Subclasses pass their hyperparameters to ``__init__`` (they become attributes, so ``opt.lr = 0.1`` changes
    the learning rate) and implement ``_update(param, grad, state)``.

    Raises:
        ConfigurationError: an empty parameter list or a Parameter given twice.
        TypeError: an element without ``.data`` and ``.grad``.
    """

    # The keys of a parameter's state once it has stepped (None: not checked); a subclass names its own.
    state_keys: Optional[Tuple[str, ...]] = None

    def __init__(self, params: Iterable[Any], **hyperparameters: Any) -> None:
        if hasattr(params, "parameters") and callable(params.parameters):
            raise ArgumentTypeError(f"{type(self).__name__} takes the parameters, got the {type(params).__name__} "
                                    f"itself: pass model.parameters()")
        try:
            params = list(params)
        except TypeError:
            raise ArgumentTypeError(f"{type(self).__name__} takes an iterable of Parameters, got "
                                    f"{type(params).__name__}") from None
        if not params:
            raise ConfigurationError(f"{type(self).__name__} got an empty parameter list")
        for i, p in enumerate(params):
            if not (hasattr(p, "data") and hasattr(p, "grad")):
                raise ArgumentTypeError(f"{type(self).__name__} parameter {i} is a {type(p).__name__}, not a Parameter")
        if len({id(p) for p in params}) != len(params):
            raise ConfigurationError(f"{type(self).__name__} got the same Parameter more than once")
        self.params: List[Any] = params
        self.state: List[Dict[str, Any]] = [{} for _ in params]
        self._hyperparameter_names = tuple(hyperparameters)
        for name, value in hyperparameters.items():
            setattr(self, name, value)

    def hyperparameters(self) -> Dict[str, Any]:
        """Current hyperparameters by name."""
        return {name: getattr(self, name) for name in self._hyperparameter_names}

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the gradients of ``params`` (``set_to_none`` drops the arrays instead of zeroing them)."""
        for p in self.params:
            _zero(p, set_to_none)

    def step(self) -> None:
        """Update every parameter that has a gradient, in place.

        A segmented Parameter (``p.segments``, a flat shard) is updated piece by piece where its parameters
        differ: one without a gradient is left alone ([Note: segmented parameters] in ``optim.segments``).

        Raises:
            GraphCaptureError: a segmented Parameter has to be updated piece by piece inside a CUDA graph capture.
        """
        with span(f"{type(self).__name__}.step"):
            pending, split = [], []
            for p, state in zip(self.params, self.state):
                if p.grad is None:
                    continue
                segments = getattr(p, "segments", None)
                if segments is None or not segments.needs_split(state):
                    pending.append((p, state))
                    continue
                if capture.capturing():
                    raise GraphCaptureError(
                        f"{type(self).__name__}.step: a flat Parameter whose parameters have no gradient or have "
                        f"taken different steps ({segments}) is updated piece by piece, which a CUDA graph "
                        f"cannot replay; capture steps in which every parameter has a gradient from the start")
                split.append(SplitStep(p, state))
                pending.extend(split[-1].pending)
            for p, state in self._update_together(pending):
                self._update(p, p.grad, state)
            for one in split:
                for piece, state in one.empty:
                    self._update(piece, piece.grad, state)
                one.finish()

    def _update_together(self, pending: List[Tuple[Any, Dict[str, Any]]]) -> List[Tuple[Any, Dict[str, Any]]]:
        """Update at once the pairs a subclass can (one kernel across them); return the rest (default: all)."""
        return pending

    def _update(self, param: Any, grad: Any, state: Dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _update")

    def state_dict(self) -> Dict[str, Any]:
        """Hyperparameters and per-parameter state as plain data with copied arrays (see the module note)."""
        state = []
        for entry in self.state:
            state.append({k: (v.copy() if hasattr(v, "shape") else _plain(v)) for k, v in entry.items()})
        return {"hyperparameters": {k: _plain(v) for k, v in self.hyperparameters().items()}, "state": state}

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise StateDictError, changing nothing, if ``load_state_dict(state_dict)`` would refuse it.

        Checked: the keys, the hyperparameter names (another kind of optimizer has others), the number of
        parameters, each state's keys (``state_keys``), its ``step`` (an int >= 0) and every other value: an
        array of real numbers with the parameter's shape, or nested lists that ``np.asarray`` makes one (a
        JSON round trip's). Every problem is listed.
        """
        name = type(self).__name__
        if not isinstance(state_dict, dict) or set(state_dict) != {"hyperparameters", "state"}:
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise StateDictError(f"{name} state dict must have keys 'hyperparameters' and 'state', got {found}")
        problems = []
        hyper, states = state_dict["hyperparameters"], state_dict["state"]
        if not isinstance(hyper, dict) or set(hyper) != set(self._hyperparameter_names):
            found = sorted(hyper) if isinstance(hyper, dict) else type(hyper).__name__
            problems.append(f"hyperparameters {found} differ from {sorted(self._hyperparameter_names)} (a state "
                            f"dict of another kind of optimizer?)")
        if not isinstance(states, (list, tuple)) or len(states) != len(self.params):
            count = len(states) if isinstance(states, (list, tuple)) else type(states).__name__
            problems.append(f"state for {count} parameters, the optimizer has {len(self.params)}")
        else:
            for i, (p, entry) in enumerate(zip(self.params, states)):
                if not isinstance(entry, dict):
                    problems.append(f"the state of parameter {i} is a {type(entry).__name__}, not a dict")
                    continue
                keys = set(entry) - {STATE_KEY}
                if self.state_keys is not None and entry and keys != set(self.state_keys):
                    problems.append(f"the state of parameter {i} has keys {sorted(entry)}; {name} keeps "
                                    f"{sorted(self.state_keys)} (or nothing before its first step)")
                for k, v in entry.items():
                    if k == STATE_KEY:
                        segments = getattr(p, "segments", None)
                        scalars = [key for key in keys if not hasattr(entry[key], "shape")
                                   and not isinstance(entry[key], (list, tuple))]
                        problems.extend(check_entries(v, None if segments is None else segments.count, scalars,
                                                      f"parameter {i}"))
                        continue
                    if k == "step":
                        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                            problems.append(f"state 'step' of parameter {i} is {v!r}, not an int >= 0")
                        continue
                    problem = _state_array(v, p.data)[1]
                    if problem is not None:
                        problems.append(f"state {k!r} of parameter {i} {problem}")
        if problems:
            raise StateDictError(f"cannot load state dict into {name}: " + "; ".join(problems))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore hyperparameters and state saved by ``state_dict()``; arrays (or lists of numbers) are copied in,
        with the parameter's dtype and on its device.

        Raises StateDictError, before anything changes, for what ``check_state_dict`` refuses.
        """
        self.check_state_dict(state_dict)
        hyper, states = state_dict["hyperparameters"], state_dict["state"]
        for name in self._hyperparameter_names:
            current = getattr(self, name)
            value = hyper[name]
            setattr(self, name, tuple(value) if isinstance(current, tuple) else value)
        self.state = [
            {k: (int(v) if k == "step" else copy_entries(v) if k == STATE_KEY
                 else _as_array_like(_state_array(v, p.data)[0], p.data))
             for k, v in entry.items()}
            for p, entry in zip(self.params, states)
        ]

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({len(self.params)} parameters, {hp})"


def _zero(p: Any, set_to_none: bool) -> None:
    if set_to_none:
        p.grad = None
    elif p.grad is not None:
        p.grad[...] = 0


def check_non_negative(owner: str, **values: float) -> None:
    """Raise ArgumentTypeError naming a value that is not a number, ConfigurationError each that is negative (or NaN)."""
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ArgumentTypeError(f"{owner}: {k} must be a number, got {type(v).__name__} {v!r}")
    bad = {k: v for k, v in values.items() if not v >= 0}
    if bad:
        raise ConfigurationError(f"{owner}: " + ", ".join(f"{k}={v} must be >= 0" for k, v in bad.items()))


__all__ = ["Optimizer"]
