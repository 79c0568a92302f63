"""A model and its optimizer as global arrays in pieces: saved under one parallel layout, resumed under another.

[Note: what is stored]
``save_model_slices`` takes, on every rank, the ``boxes`` of the parameters
it holds (whole-model name -> (global shape, offset, Parameter), e.g.
``ParallelGPT.parameter_boxes()``) and writes, through ``save_slices``:

- ``model/<name>``: each parameter's piece;
- ``optimizer/<key>/<name>``: each array of the optimizer's per-parameter
  state (Adam's ``exp_avg``, ``exp_avg_sq``) with the parameter's box, since
  it is element-wise like the parameter; a scalar of that state (Adam's
  ``step``) as a 0-d array, replicated.

The optimizer's class, hyperparameters and state keys go into the index
(``extra["optimizer"]``), with the caller's ``extra``. A load under any other
layout asks for the boxes it now holds and gets exactly those values, so
the parameters and the optimizer continue where the saved run stopped. The
optimizer must update the same Parameters the boxes name (not FSDP's flat
shards: ``ParallelGPT`` with ``fsdp=True`` is refused by its caller).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from .._dtypes import array_module
from ..errors import CheckpointError
from ..groups import resolve_group
from .directory import read_index, report
from .sliced import INDEX_FORMAT, Box, load_slices, save_slices

Boxes = Mapping[str, Tuple[Tuple[int, ...], Tuple[int, ...], Any]]


def _optimizer_states(boxes: Boxes, optimizer: Any) -> Dict[str, Dict[str, Any]]:
    """Whole-model name -> the optimizer's state dict of that parameter (every boxed parameter must be in it)."""
    index = {id(p): i for i, p in enumerate(optimizer.params)}
    missing = [name for name, (_, _, p) in boxes.items() if id(p) not in index]
    if missing:
        raise CheckpointError(f"the optimizer does not update parameters {missing[:4]} of the model "
                              f"({len(missing)} in all); build it over the same Parameters")
    return {name: optimizer.state[index[id(p)]] for name, (_, _, p) in boxes.items()}


def _describe_optimizer(states: Mapping[str, Dict[str, Any]], optimizer: Any) -> Dict[str, Any]:
    keys = sorted({k for state in states.values() for k in state})
    scalars = sorted({k for state in states.values() for k, v in state.items() if not hasattr(v, "shape")})
    hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.hyperparameters().items()}
    return {"type": type(optimizer).__name__, "hyperparameters": hyper, "keys": keys, "scalars": scalars}


def save_model_slices(path: "str | os.PathLike[str]", boxes: Boxes, optimizer: Any = None, group: Any = None,
                      extra: Any = None) -> None:
    """Collective: write the model (and optimizer) pieces every rank holds as one layout-free checkpoint.

    Args:
        path: the checkpoint directory; replaced atomically if it exists.
        boxes: whole-model name -> (global shape, offset, Parameter) for every parameter this rank holds.
        optimizer: the optimizer over those Parameters, or None.
        group: every rank that holds a part of the model (None: the default group).
        extra: more plain state (the step, ...); group rank 0's is kept.

    Raises:
        CheckpointError: on every rank, as ``save_slices`` (the previous checkpoint is then left
            intact), or when the optimizer does not update a boxed parameter.
    """
    pieces: Dict[str, Any] = {f"model/{name}": (shape, offset, p.data) for name, (shape, offset, p) in boxes.items()}
    described = None
    if optimizer is not None:
        states = _optimizer_states(boxes, optimizer)
        described = _describe_optimizer(states, optimizer)
        for name, state in states.items():
            shape, offset, _ = boxes[name]
            for key, value in state.items():
                if hasattr(value, "shape"):
                    pieces[f"optimizer/{key}/{name}"] = (shape, offset, value)
                else:
                    pieces[f"optimizer/{key}/{name}"] = ((), (), np.asarray(value))
    save_slices(path, pieces, group=group, extra={"optimizer": described, "user": extra})


def _wanted_optimizer(path: str, boxes: Boxes, optimizer: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The optimizer pieces to ask for, and the saved description (from the index, read locally)."""
    index, _ = read_index(path, INDEX_FORMAT)
    extra = index.get("extra")
    saved = extra.get("optimizer") if isinstance(extra, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path!r} holds no optimizer state; load it without an optimizer")
    if saved.get("type") != type(optimizer).__name__:
        raise CheckpointError(f"{path!r} holds the state of a {saved.get('type')} optimizer, not of this "
                              f"{type(optimizer).__name__}")
    keys, scalars = saved.get("keys"), saved.get("scalars")
    if not (isinstance(keys, list) and isinstance(scalars, list) and all(isinstance(k, str) for k in keys)):
        raise CheckpointError(f"{path!r}: the index records optimizer keys {keys!r} and scalars {scalars!r}; "
                              f"expected lists of names (a corrupt or crafted index)")
    _optimizer_states(boxes, optimizer)  # every boxed parameter is the optimizer's
    wanted = {}
    for name, (shape, offset, p) in boxes.items():
        for key in keys:
            wanted[f"optimizer/{key}/{name}"] = Box((), (), ()) if key in scalars else Box(shape, offset, p.data.shape)
    return wanted, saved


def load_model_slices(path: "str | os.PathLike[str]", boxes: Boxes, optimizer: Any = None,
                      group: Any = None) -> Any:
    """Collective: fill this rank's parameters (and optimizer state) from a ``save_model_slices`` checkpoint.

    The checkpoint may come from any layout of the same model: each rank
    reads only the files holding the boxes it now needs.

    Args:
        path: the checkpoint directory.
        boxes: whole-model name -> (global shape, offset, Parameter) for every parameter this rank holds now.
        optimizer: the optimizer over those Parameters (its state and hyperparameters are replaced), or None.
        group: every rank that holds a part of the model (None: the default group).

    Returns:
        The ``extra`` given to ``save_model_slices``.

    Raises:
        CheckpointError: on every rank, as ``load_slices`` (a name, global shape or dtype the
            checkpoint lacks or differs in; nothing is changed then), or for an optimizer of
            another class than the saved one, or a checkpoint without optimizer state.
    """
    path = os.fspath(path)
    pg = resolve_group(group).require_member("checkpoint load_model_slices")
    wanted: Dict[str, Any] = {f"model/{name}": (shape, offset, p.data) for name, (shape, offset, p) in boxes.items()}
    saved: Dict[str, Any] = {}
    if optimizer is not None:
        problem = None
        try:
            more, saved = _wanted_optimizer(path, boxes, optimizer)
            wanted.update(more)
        except CheckpointError as exc:
            problem = exc
        report(pg, problem, f"loading checkpoint {path!r}")  # before the collective load, on every rank
    arrays, extra = load_slices(path, wanted, group=pg)
    if optimizer is not None:
        states = _optimizer_states(boxes, optimizer)
        for name, state in states.items():
            p = boxes[name][2]
            state.clear()
            for key in saved["keys"]:
                value = arrays[f"optimizer/{key}/{name}"]
                if key in saved["scalars"]:
                    state[key] = value.item()
                else:
                    state[key] = array_module(p.data).asarray(value).astype(p.data.dtype, copy=False)
        for key, value in saved["hyperparameters"].items():
            setattr(optimizer, key, tuple(value) if isinstance(value, list) else value)
    return extra.get("user") if isinstance(extra, dict) else None
