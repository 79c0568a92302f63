"""A model and its optimizer as global arrays in pieces: saved under one parallel layout, resumed under another.

[Note: what is stored]
``boxes`` maps a whole-model name to ``(global shape, offset, Parameter)`` when the Parameter is a block of
the global array, or ``(global shape, offset, Parameter, (local shape, start, stop, at))`` when a flat
Parameter (FSDP's shard) holds elements ``[start, stop)`` of the C-order flattening of the block of ``local
shape`` at ``offset``, as ``Parameter.data[at:at + stop - start]``. The save writes ``model/<name>`` and
``optimizer/<key>/<name>`` (Adam's moments are element-wise, so they are cut as the parameter is; a scalar
such as ``step`` is a replicated 0-d array); the optimizer's class and hyperparameters go into the index.
A load under any layout fills the Parameters in place; a flat Parameter's padding keeps its values and gets
zero optimizer state.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Tuple

import numpy as np

from .._dtypes import array_module
from ..errors import CheckpointError
from .format import checkpoint_path
from ..groups import resolve_group
from .directory import read_index, report
from .sliced import INDEX_FORMAT, Box, flat_range_boxes, load_slices, save_slices

Boxes = Mapping[str, Tuple[Any, ...]]
Piece = Tuple[Box, Callable[[Any], Any]]  # a block of the global array, and its view in an array shaped like the Parameter


def _whole(array: Any) -> Any:
    return array


def _flat_view(at: int, length: int, shape: Tuple[int, ...]) -> Callable[[Any], Any]:
    return lambda array: array[at:at + length].reshape(shape)


def _pieces(boxes: Boxes) -> Dict[str, Tuple[Any, List[Piece]]]:
    """Name -> (Parameter, its pieces), every entry checked; CheckpointError naming a malformed one."""
    if not isinstance(boxes, Mapping):
        raise CheckpointError(f"boxes must map whole-model names to (global shape, offset, Parameter[, span]), got "
                              f"{type(boxes).__name__}")
    out: Dict[str, Tuple[Any, List[Piece]]] = {}
    for name, entry in boxes.items():
        if not isinstance(entry, tuple) or len(entry) not in (3, 4) or not hasattr(entry[2], "data"):
            raise CheckpointError(f"boxes[{name!r}]: expected (global shape, offset, Parameter) or (global shape, "
                                  f"offset, Parameter, (local shape, start, stop, at)), got {entry!r:.200}")
        shape, offset, p = entry[:3]
        if len(entry) == 3:
            out[name] = (p, [(Box(shape, offset, p.data.shape), _whole)])
            continue
        span = entry[3]
        if not (isinstance(span, tuple) and len(span) == 4):
            raise CheckpointError(f"boxes[{name!r}]: the span must be (local shape, start, stop, at), got {span!r}")
        local_shape, start, stop, at = span
        block = Box(shape, offset, local_shape)
        if p.data.ndim != 1 or not 0 <= at <= at + (stop - start) <= p.data.size:
            raise CheckpointError(f"boxes[{name!r}]: elements [{at}, {at + stop - start}) of a Parameter of shape "
                                  f"{tuple(p.data.shape)}; a span needs a flat Parameter that holds them")
        out[name] = (p, [(box, _flat_view(at + a - start, b - a, box.shape))
                         for box, a, b in flat_range_boxes(block, start, stop)])
    return out


def _as_pieces(pieces: List[Piece], array: Any) -> Any:
    """``save_slices``'s value for the pieces of ``array``: one ``(Box, view)``, or a list of them."""
    out = [(box, view(array)) for box, view in pieces]
    return out[0] if len(out) == 1 else out


def _optimizer_states(pieces: Mapping[str, Tuple[Any, List[Piece]]], optimizer: Any) -> Dict[int, Dict[str, Any]]:
    """``id(Parameter)`` -> the optimizer's state dict of it (every Parameter named must be the optimizer's)."""
    index = {id(p): i for i, p in enumerate(optimizer.params)}
    missing = [name for name, (p, _) in pieces.items() if id(p) not in index]
    if missing:
        raise CheckpointError(f"the optimizer does not update parameters {missing[:4]} of the model "
                              f"({len(missing)} in all); build it over the same Parameters")
    return {id(p): optimizer.state[index[id(p)]] for p, _ in pieces.values()}


def _describe_optimizer(states: Mapping[int, Dict[str, Any]], optimizer: Any) -> Dict[str, Any]:
    keys = sorted({k for state in states.values() for k in state})
    scalars = sorted({k for state in states.values() for k, v in state.items() if not hasattr(v, "shape")})
    hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.hyperparameters().items()}
    return {"type": type(optimizer).__name__, "hyperparameters": hyper, "keys": keys, "scalars": scalars}


def save_model_slices(path: "str | os.PathLike[str]", boxes: Boxes, optimizer: Any = None, group: Any = None,
                      extra: Any = None, writer: Any = None) -> None:
    """Collective: write the model (and optimizer) pieces every rank holds as one layout-free checkpoint.

    Args:
        path: the checkpoint directory; replaced atomically if it exists.
        boxes: whole-model name -> where this rank's Parameter holds it (see the module note), e.g.
            ``ParallelGPT.parameter_boxes()``.
        optimizer: the optimizer over those Parameters, or None.
        group: every rank that holds a part of the model (None: the default group; with ``writer``, its group).
        extra: more plain state (the step, ...); group rank 0's is kept.
        writer: an ``AsyncCheckpointer``: copy the pieces to host buffers, return, and write them in its thread.

    Raises:
        CheckpointError: on every rank, as ``save_slices``, or when an entry of ``boxes`` is malformed or the
            optimizer does not update a Parameter named there.
    """
    problem, pieces, described = None, {}, None
    try:
        pieces, described = _save_plan(boxes, optimizer)
    except CheckpointError as exc:  # malformed boxes: every rank hears of it before anything is sent
        problem = exc
    pg = writer.group if writer is not None else resolve_group(group).require_member("checkpoint save_model_slices")
    report(pg, problem, f"saving checkpoint {checkpoint_path(path)!r}")
    extra = {"optimizer": described, "user": extra}
    if writer is not None:
        writer.save_slices(path, pieces, extra=extra)
    else:
        save_slices(path, pieces, group=pg, extra=extra)


def _save_plan(boxes: Boxes, optimizer: Any) -> Tuple[Dict[str, Any], Any]:
    """``save_slices``'s pieces of the model and optimizer, and the optimizer's description (or None)."""
    held = _pieces(boxes)
    pieces: Dict[str, Any] = {f"model/{name}": _as_pieces(cut, p.data) for name, (p, cut) in held.items()}
    if optimizer is None:
        return pieces, None
    states = _optimizer_states(held, optimizer)
    for name, (p, cut) in held.items():
        for key, value in states[id(p)].items():
            if hasattr(value, "shape"):
                pieces[f"optimizer/{key}/{name}"] = _as_pieces(cut, value)
            else:
                pieces[f"optimizer/{key}/{name}"] = ((), (), np.asarray(value))
    return pieces, _describe_optimizer(states, optimizer)


def _saved_optimizer(path: str, optimizer: Any) -> Dict[str, Any]:
    """The optimizer description in the index (read locally), checked against ``optimizer``."""
    index, _, _ = read_index(path, INDEX_FORMAT)
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
    return saved


def load_model_slices(path: "str | os.PathLike[str]", boxes: Boxes, optimizer: Any = None,
                      group: Any = None) -> Any:
    """Collective: fill this rank's parameters (and optimizer state) from a ``save_model_slices`` checkpoint.

    The checkpoint may come from any layout of the same model (FSDP's included). ``optimizer``'s state and
    hyperparameters are replaced. Returns the ``extra`` given to ``save_model_slices``.

    Raises:
        CheckpointError: on every rank, as ``load_slices`` (nothing is changed then), or for an optimizer of
            another class than the saved one, a checkpoint without optimizer state, or a malformed entry.
    """
    path = checkpoint_path(path)
    pg = resolve_group(group).require_member("checkpoint load_model_slices")
    plan, problem = None, None
    try:
        plan = _LoadPlan(boxes, optimizer, _saved_optimizer(path, optimizer) if optimizer is not None else {})
    except CheckpointError as exc:
        problem = exc
    report(pg, problem, f"loading checkpoint {path!r}")  # before the collective load, on every rank
    arrays, extra = load_slices(path, plan.wanted, group=pg)
    plan.install(arrays)
    return extra.get("user") if isinstance(extra, dict) else None


def state_pieces(boxes: Boxes, optimizer: Any = None) -> Tuple[List[Tuple[str, Box, Any]], Any]:
    """Local: this rank's model and optimizer values as ``(key, Box, array)``, and the optimizer's description.

    The keys and boxes are those ``save_model_slices`` writes (``axonhpc.elastic`` moves them between ranks).
    """
    pieces, described = _save_plan(boxes, optimizer)
    out = []
    for key, value in pieces.items():
        for item in value if isinstance(value, list) else [value]:
            box, array = item if isinstance(item[0], Box) else (Box(item[0], item[1], np.shape(item[2])), item[2])
            out.append((key, box, array))
    return out, described


def fill_model_state(boxes: Boxes, optimizer: Any, whole: Mapping[str, np.ndarray], described: Any) -> None:
    """Local: ``load_model_slices`` from whole arrays in memory (key -> the global array; see ``state_pieces``).

    Raises CheckpointError for a key of ``boxes`` or of the optimizer's state that ``whole`` lacks.
    """
    plan = _LoadPlan(boxes, optimizer, described if optimizer is not None else {})
    missing = sorted(set(plan.wanted) - set(whole))
    if missing:
        raise CheckpointError(f"the state lacks {missing[:4]} ({len(missing)} in all)")
    arrays = {}
    for key, value in plan.wanted.items():
        if isinstance(value, Box):
            arrays[key] = np.asarray(whole[key])
            continue
        for box, view in value if isinstance(value, list) else [value]:
            view[...] = whole[key][box.slices]
    plan.install(arrays)


class _LoadPlan:
    """What a load fills on this rank (``wanted``: key -> pieces) and how it installs the optimizer's state."""

    def __init__(self, boxes: Boxes, optimizer: Any, saved: Mapping[str, Any]):
        self.optimizer, self.saved = optimizer, saved
        self.held = _pieces(boxes)
        self.wanted: Dict[str, Any] = {f"model/{name}": _as_pieces(cut, p.data) for name, (p, cut) in self.held.items()}
        self.fresh: Dict[int, Dict[str, Any]] = {}  # id(Parameter) -> its new optimizer state, filled by the load
        if optimizer is None:
            return
        _optimizer_states(self.held, optimizer)  # every named Parameter is the optimizer's
        for name, (p, cut) in self.held.items():
            if id(p) not in self.fresh:  # one state per Parameter (an FSDP shard holds many names)
                self.fresh[id(p)] = {key: array_module(p.data).zeros_like(p.data)
                                     for key in saved["keys"] if key not in saved["scalars"]}
            state = self.fresh[id(p)]
            for key in saved["keys"]:
                self.wanted[f"optimizer/{key}/{name}"] = (Box((), (), ()) if key in saved["scalars"]
                                                          else _as_pieces(cut, state[key]))

    def install(self, arrays: Mapping[str, Any]) -> None:
        """Put the loaded optimizer state in place (the parameters were filled in place); ``arrays``: the scalars."""
        optimizer, saved = self.optimizer, self.saved
        if optimizer is None:
            return
        states = _optimizer_states(self.held, optimizer)
        for pid, state in self.fresh.items():
            states[pid].clear()
            states[pid].update(state)
        for name, (p, _) in self.held.items():
            for key in saved["scalars"]:
                states[id(p)][key] = arrays[f"optimizer/{key}/{name}"].item()
        for key, value in saved["hyperparameters"].items():
            setattr(optimizer, key, tuple(value) if isinstance(value, list) else value)
