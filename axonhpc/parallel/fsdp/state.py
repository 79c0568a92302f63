"""FSDP's state dicts: full ones gathered from the shards, sharded ones, and resharding them for any world size.

[Note: resharding]
A sharded state dict records per unit the names, shapes, dtype, unpadded ``numel`` and this shard's range
``[start, stop)`` (padding is never stored). Loading on another group size, each rank computes its new range
with ``shard_bounds`` and copies in the overlapping pieces; an uncovered position is an error naming the
unit and range. A full state dict becomes one piece covering everything, so one code path loads both, and
everything is checked before anything is written.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..._dtypes import array_module, to_host
from ...buffers import unflatten
from ...collectives import all_gather, gather
from ...errors import StateDictError
from ...groups.agreement import Failed, all_or_none

ROOT = "<root>"  # the unit of the parameters outside every wrapped module
FORMAT = "axonhpc.fsdp.sharded/1"


def _host(array: Any) -> np.ndarray:
    return np.asarray(to_host(array))


def _optimizer_units(fsdp: Any, optimizer: Any) -> List[Any]:
    """The unit of each of the optimizer's parameters, in the optimizer's order."""
    by_id = {id(u.shard): u for u in fsdp.units}
    units = []
    for i, p in enumerate(optimizer.params):
        if id(p) not in by_id:
            raise StateDictError(f"optimizer parameter {i} is not one of this FSDP's shards; build the "
                                 "optimizer over fsdp.parameters()")
        units.append(by_id[id(p)])
    return units


def full_state_dict(fsdp: Any, rank0_only: bool = True) -> "OrderedDict[str, Any]":
    """Collective: the full values gathered from the shards, in ``module.state_dict()`` order (``rank0_only``: {} elsewhere)."""
    values: Dict[int, Any] = {}
    keep = not rank0_only or fsdp.group.rank == 0
    for unit in fsdp.units:
        shard = unit.shard.data
        if unit.shard_world == 1:
            full = shard
        elif rank0_only:
            stacked = gather(shard, 0, unit.shard_group)
            full = None if stacked is None else stacked.reshape(-1)
        else:
            full = all_gather(shard, unit.shard_group).reshape(-1)
        if keep and full is not None:
            for p, view in zip(unit.params, unflatten(full, unit.layout)):
                values[id(p)] = view.copy()
    if not keep:
        return OrderedDict()
    out: "OrderedDict[str, Any]" = OrderedDict()
    for key, (kind, target) in fsdp.module.named_state().items():
        out[key] = values[id(target)] if kind == "param" else target.copy()
    return out


def sharded_state(fsdp: Any, optimizer: Any = None) -> Dict[str, Any]:
    """This rank's shard of the model (and ``optimizer``) state, as plain data (see the module note)."""
    units = {}
    for u in fsdp.units:
        start, stop = u.unpadded_range()
        units[u.name] = {"names": list(u.param_names), "shapes": [list(s) for s in u.layout.shapes],
                         "dtype": str(u.layout.dtype), "numel": int(u.numel), "start": int(start), "stop": int(stop),
                         "values": _host(u.shard.data[:stop - start]).copy()}
    out: Dict[str, Any] = {"format": FORMAT, "shard_world_size": fsdp.shard_world_size,
                           "shard_rank": fsdp.shard_rank, "units": units,
                           "buffers": {name: _host(b).copy() for name, b in fsdp.module.named_buffers()}}
    if optimizer is not None:
        owners = _optimizer_units(fsdp, optimizer)
        saved = optimizer.state_dict()
        states = {}
        for unit, entry in zip(owners, saved["state"]):
            length = units[unit.name]["stop"] - units[unit.name]["start"]
            states[unit.name] = {k: (_host(v[:length]) if hasattr(v, "shape") else v) for k, v in entry.items()}
        out["optimizer"] = {"hyperparameters": saved["hyperparameters"], "state": states}
    return out


def full_to_sharded(fsdp: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """A full state dict as one sharded piece covering every unit; StateDictError listing every missing or misshapen parameter."""
    if not state:
        raise StateDictError(f"cannot load an empty state dict into FSDP on group rank {fsdp.group.rank}: a full "
                             f"state dict must be given on every rank, and fsdp.full_state_dict() returns {{}} on "
                             f"all ranks but 0 by default (rank0_only=True). Load the dict of "
                             f"fsdp.full_state_dict(rank0_only=False) (or fsdp.state_dict()), or a sharded one")
    problems = []
    units = {}
    for u in fsdp.units:
        pieces = []
        for name, shape in zip(u.param_names, u.layout.shapes):
            if name not in state:
                problems.append(f"missing key {name!r}")
                continue
            value = _host(state[name])
            if tuple(value.shape) != tuple(shape):
                problems.append(f"shape mismatch for {name!r}: the state dict has {tuple(value.shape)}, "
                                f"the model has {tuple(shape)}")
                continue
            pieces.append(value.reshape(-1).astype(u.layout.dtype))
        values = np.concatenate(pieces) if len(pieces) == len(u.param_names) else np.zeros(0, u.layout.dtype)
        units[u.name] = {"names": list(u.param_names), "shapes": [list(s) for s in u.layout.shapes],
                         "dtype": str(u.layout.dtype), "numel": int(u.numel), "start": 0, "stop": int(u.numel),
                         "values": values}
    params = {n for u in fsdp.units for n in u.param_names}
    buffers = {name for name, _ in fsdp.module.named_buffers()}
    unexpected = [k for k in state if k not in params and k not in buffers]
    if unexpected:
        problems.append("unexpected keys: " + ", ".join(repr(k) for k in unexpected))
    if problems:
        raise StateDictError("cannot load state dict into FSDP: " + "; ".join(problems))
    return {"format": FORMAT, "units": units, "buffers": {k: state[k] for k in buffers if k in state}}


def _assemble(unit: Any, key: str, pieces: List[Tuple[int, int, Any]], problems: List[str]) -> Optional[np.ndarray]:
    """This rank's padded shard of one flat array from ``(start, stop, values)`` pieces."""
    start, stop, _ = unit.layout.shard_bounds(unit.shard_rank)
    lo, hi = min(start, unit.numel), min(stop, unit.numel)
    out = np.zeros(stop - start, dtype=unit.layout.dtype)
    covered = np.zeros(hi - lo, dtype=bool)
    for p_start, p_stop, values in pieces:
        a, b = max(lo, p_start), min(hi, p_stop)
        if a < b:
            out[a - start:b - start] = values[a - p_start:b - p_start]
            covered[a - lo:b - lo] = True
    if not covered.all():
        missing = np.flatnonzero(~covered)
        problems.append(f"unit {unit.name!r} {key}: elements {lo + int(missing[0])}..{lo + int(missing[-1])} of "
                        f"[{lo}, {hi}) are in none of the {len(pieces)} shards given")
        return None
    return out


def prepare_sharded_load(fsdp: Any, shards: List[Dict[str, Any]], optimizer: Any = None) -> Callable[[], None]:
    """Check ``shards`` against this rank's ranges and return ``apply()``, which copies them in.

    Split so that a collective loader can make every rank agree before any changes anything.

    Raises:
        StateDictError: a unit is missing or differs, a range is not covered, or the optimizer state is
            missing or inconsistent (nothing has changed then).
    """
    problems: List[str] = []
    if not shards or not all(isinstance(s, dict) and "units" in s for s in shards):
        raise StateDictError("load_state_dict needs sharded state dicts (from sharded_state_dict) or a full one")
    values: Dict[str, np.ndarray] = {}
    for u in fsdp.units:
        pieces = []
        for shard in shards:
            entry = shard["units"].get(u.name)
            if entry is None:
                continue
            expect = (list(u.param_names), [list(s) for s in u.layout.shapes], str(u.layout.dtype), int(u.numel))
            got = (list(entry["names"]), [list(s) for s in entry["shapes"]], str(entry["dtype"]), int(entry["numel"]))
            if got != expect:
                problems.append(f"unit {u.name!r} differs: the state has names/shapes/dtype/numel {got}, "
                                f"the model {expect}")
                continue
            pieces.append((int(entry["start"]), int(entry["stop"]), entry["values"]))
        assembled = _assemble(u, "values", pieces, problems)
        if assembled is not None:
            values[u.name] = assembled
    opt_state = _optimizer_state(fsdp, shards, optimizer, problems) if optimizer is not None else None
    if opt_state is not None and not problems:
        _check_optimizer_state(optimizer, opt_state, problems)
    buffers = next((s.get("buffers") for s in shards if s.get("buffers")), None)
    if buffers:
        _check_buffers(fsdp, buffers, problems)
    if problems:
        raise StateDictError("cannot load sharded state into FSDP: " + "; ".join(problems))

    def apply() -> None:
        if opt_state is not None:  # checked above; first, so that nothing else has changed if it still refused
            optimizer.load_state_dict(opt_state)
        for u in fsdp.units:
            u.shard.data[...] = _like(values[u.name], u.shard.data)
        if buffers:
            for name, b in fsdp.module.named_buffers():
                if name in buffers:
                    b[...] = _like(buffers[name], b)

    return apply


def _check_optimizer_state(optimizer: Any, opt_state: Dict[str, Any], problems: List[str]) -> None:
    """Add to ``problems`` why ``optimizer.load_state_dict(opt_state)`` would refuse it (kind, keys, shapes)."""
    check = getattr(optimizer, "check_state_dict", None)
    if check is None:
        return  # not an axonhpc Optimizer: its load_state_dict runs first in apply(), before anything else
    try:
        check(opt_state)
    except StateDictError as exc:
        problems.append(f"the checkpoint's optimizer state does not fit this optimizer: {exc}")


def _check_buffers(fsdp: Any, buffers: Any, problems: List[str]) -> None:
    """Add to ``problems`` each buffer whose saved value is not an array of the module buffer's shape."""
    if not isinstance(buffers, dict):
        problems.append(f"the buffers are a {type(buffers).__name__}, not a dict of names to arrays")
        return
    for name, b in fsdp.module.named_buffers():
        if name in buffers:
            shape = getattr(buffers[name], "shape", None)
            if shape is None or tuple(shape) != tuple(b.shape):
                problems.append(f"shape mismatch for buffer {name!r}: the state has "
                                f"{None if shape is None else tuple(shape)}, the model {tuple(b.shape)}")


def prepare_load(fsdp: Any, state: Any, optimizer: Any = None) -> Callable[[], None]:
    """Local: check a full or sharded ``state`` and return ``apply()``; StateDictError as ``prepare_sharded_load``."""
    if isinstance(state, dict) and "units" not in state:
        write = prepare_sharded_load(fsdp, [full_to_sharded(fsdp, state)], None)
    else:
        write = prepare_sharded_load(fsdp, state if isinstance(state, list) else [state], optimizer)

    def apply() -> None:
        write()
        for unit in fsdp.units:
            unit.new_step()
        fsdp.reshard_parameters()

    return apply


def state_digest(state: Any) -> str:
    """What the ranks compare before loading: ``full:<sha256 of names, dtypes, shapes, values>``, or ``sharded``.

    Sharded states differ from rank to rank by design; a full one must be the same dict everywhere.
    """
    if not (isinstance(state, dict) and "units" not in state):
        return "sharded"
    h = hashlib.sha256()
    for key in sorted(state, key=str):
        value = state[key]
        h.update(repr(key).encode("utf-8") + b"\0")
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            array = np.ascontiguousarray(_host(value))
            h.update(f"{array.dtype.str}{array.shape}".encode("utf-8") + b"\0")
            h.update(array.reshape(-1).view(np.uint8))
        else:
            h.update(repr(value).encode("utf-8") + b"\0")
    return "full:" + h.hexdigest()


def load_state(fsdp: Any, state: Any, optimizer: Any = None) -> None:
    """Collective over ``fsdp.group``: check ``state`` on every rank, agree, then load it everywhere or nowhere.

    Raises:
        StateDictError: on every rank alike, naming each rank that refused and why, or the ranks whose full
            state dicts differ; no rank has changed anything then.
    """
    group = fsdp.group

    def refused(failed: Failed) -> StateDictError:
        detail = "; ".join(f"group rank {r}: {why}" for r, why in failed)
        return StateDictError(f"FSDP load_state_dict refused on group ranks {[r for r, _ in failed]}, so nothing "
                              f"was loaded on any rank: {detail}")

    def differ(seen: List[Tuple[bool, str]]) -> StateDictError:
        by_text: Dict[str, List[int]] = {}
        for r, (_, text) in enumerate(seen):
            by_text.setdefault(text, []).append(r)
        kinds = "; ".join(f"group ranks {ranks} gave " + (f"a full state dict with sha256 {text[5:21]}..."
                                                           if text.startswith("full:") else "sharded state")
                          for text, ranks in by_text.items())
        return StateDictError(f"FSDP load_state_dict: the ranks gave different states ({kinds}), so nothing was "
                              f"loaded on any rank. A full state dict must be the same on every rank (each keeps "
                              f"its slice): pass fsdp.full_state_dict(rank0_only=False) everywhere")

    # Exception: malformed input (a KeyError in a hand-made shard) is refused alike, not left to hang the others.
    with all_or_none(group, refused, differ, catch=Exception, alike=True) as vote:
        apply = prepare_load(fsdp, state, optimizer)
        vote.text = state_digest(state)
    apply()


def _like(values: np.ndarray, target: Any) -> Any:
    """Host ``values`` in the memory of ``target`` (moved to the device for a cupy array)."""
    return array_module(target).asarray(values)


def _optimizer_state(fsdp: Any, shards: List[Dict[str, Any]], optimizer: Any,
                     problems: List[str]) -> Optional[Dict[str, Any]]:
    owners = _optimizer_units(fsdp, optimizer)
    with_opt = [s for s in shards if "optimizer" in s]
    if len(with_opt) != len(shards):
        problems.append("an optimizer was given but some shards hold no optimizer state")
        return None
    states = []
    for unit in owners:
        entries = [(s["units"][unit.name], s["optimizer"]["state"].get(unit.name, {})) for s in with_opt
                   if unit.name in s["units"]]
        keys = {k for _, e in entries for k in e}
        state: Dict[str, Any] = {}
        for k in sorted(keys):
            arrays = [(int(u["start"]), int(u["stop"]), e[k]) for u, e in entries if k in e]
            if any(hasattr(v, "shape") for _, _, v in arrays):
                assembled = _assemble(unit, f"optimizer state {k!r}", arrays, problems)
                if assembled is not None:
                    state[k] = assembled
            else:
                distinct = {repr(v) for _, _, v in arrays}
                if len(distinct) != 1:
                    problems.append(f"unit {unit.name!r}: optimizer state {k!r} differs between shards: "
                                    f"{sorted(distinct)}")
                state[k] = arrays[0][2]
        states.append(state)
    hypers = [s["optimizer"].get("hyperparameters") for s in with_opt]
    if any(h != hypers[0] for h in hypers[1:]):
        problems.append(f"the shards record different optimizer hyperparameters: {sorted({repr(h) for h in hypers})}")
    return {"hyperparameters": hypers[0], "state": states}


__all__ = ["ROOT", "FORMAT", "full_state_dict", "sharded_state", "full_to_sharded", "prepare_sharded_load",
           "prepare_load", "load_state", "state_digest"]
