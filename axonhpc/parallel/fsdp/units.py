"""FSDP's plan: which submodules become units, the parameters each unit holds, the groups they shard over.

``select_units`` and ``assign_parameters`` only look at the model (no
communication), so every rank can check them before the first message;
``build_groups`` splits the group for HYBRID_SHARD (collective).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...collectives import all_gather
from ...errors import ConfigurationError
from .config import ShardingStrategy, is_floating
from .state import ROOT


def select_units(module: Any, units: Any) -> List[Tuple[str, Any]]:
    """``(name, submodule)`` of each unit, checked (see the wrapper's note on units).

    Args:
        module: the model.
        units: the submodules the user listed, or None for each top-level child with parameters.

    Raises:
        ConfigurationError: a unit that is not a submodule, the model itself, listed twice, or units that are nested.
    """
    named = module.named_modules()
    if units is None:
        return [(name, child) for name, child in module.named_children() if child.parameters()]
    units = list(units)
    names = {id(m): name for name, m in named}
    out = []
    listed: Dict[int, int] = {}
    for i, unit in enumerate(units):
        if id(unit) not in names:
            raise ConfigurationError(f"FSDP units[{i}] ({type(unit).__name__}) is not a submodule of the model")
        if unit is module:
            raise ConfigurationError(f"FSDP units[{i}] is the model itself; list its submodules instead")
        if id(unit) in listed:
            raise ConfigurationError(f"FSDP units[{i}] is units[{listed[id(unit)]}] again (submodule "
                                     f"{names[id(unit)]!r}); list each unit once")
        listed[id(unit)] = i
        out.append((names[id(unit)], unit))
    for a_name, a in out:
        for b_name, b in out:
            if a is not b and any(m is b for m in a.modules()):
                raise ConfigurationError(f"FSDP units {a_name!r} and {b_name!r} are nested; units must be disjoint")
    return [(n, m) for n, m in out if m.parameters()]


def assign_parameters(module: Any, units: List[Tuple[str, Any]]) -> List[Tuple[str, Any, List[Tuple[str, Any]]]]:
    """Each unit's named parameters, then the root's leftovers (name ROOT), checked.

    Raises:
        ConfigurationError: a parameter shared by two units, or by a unit and a
            module left to the root unit; a unit whose parameters mix dtypes or
            are not floating.
    """
    owner: Dict[int, Tuple[str, str]] = {}  # id(parameter) -> (unit, the parameter's name there)
    plan = []
    for name, unit in units:
        params = unit.named_parameters(prefix=name)
        for pname, p in params:
            if id(p) in owner:
                raise ConfigurationError(f"parameter {pname!r} is shared by FSDP units {owner[id(p)][0]!r} and "
                                         f"{name!r}; put the modules that share it into one unit")
            owner[id(p)] = (name, pname)
        plan.append((name, unit, params))
    # A module outside every unit holding a unit's parameter (weight tying across the two): the root unit would
    # run it with the unit's parameter, which is only gathered inside the unit's own forward and backward.
    in_units = {id(m) for _, unit in units for m in unit.modules()}
    for mod_name, m in module.named_modules():
        if id(m) in in_units:
            continue
        for pname, p in m.named_parameters(prefix=mod_name, recurse=False):
            if id(p) in owner:
                unit_name, held = owner[id(p)]
                where = f"module {mod_name!r}" if mod_name else "the model itself"
                raise ConfigurationError(
                    f"parameter {held!r} of FSDP unit {unit_name!r} is also {pname!r} of {where}, which no unit "
                    f"holds (it is left to the root unit); list the modules that share it in one unit, or leave "
                    f"both out of units=[...]")
    leftovers = [(n, p) for n, p in module.named_parameters() if id(p) not in owner]
    if leftovers:
        plan.append((ROOT, module, leftovers))
    for name, _, params in plan:
        dtypes = sorted({str(p.dtype) for _, p in params})
        if len(dtypes) > 1:
            raise ConfigurationError(f"FSDP unit {name!r} mixes parameter dtypes {dtypes}; a flat parameter has "
                                     "one dtype, so split the unit (units=[...])")
        if not is_floating(params[0][1].dtype):
            raise ConfigurationError(f"FSDP unit {name!r} has parameters of dtype {dtypes[0]}, not floating")
    return plan


def build_groups(strategy: ShardingStrategy, pg: Any, ranks_per_node: Optional[int]) -> Tuple[Any, Any]:
    """``(shard group, replicate group)`` of ``strategy`` over ``pg`` (None where there is none).

    HYBRID_SHARD shards over each node (or each block of ``ranks_per_node``
    consecutive ranks) and replicates across them; collective over ``pg``.

    Raises:
        ConfigurationError: HYBRID_SHARD's node groups differ in size.
    """
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return pg, None
    if strategy is ShardingStrategy.NO_SHARD:
        return None, pg
    color = pg.rank // ranks_per_node if ranks_per_node is not None else pg.world.node_rank
    shard = pg.split(color, pg.rank)
    sizes = all_gather(np.array([shard.size], dtype=np.int64), pg).reshape(-1)
    if len(set(sizes.tolist())) != 1:
        raise ConfigurationError(f"HYBRID_SHARD needs the same number of ranks on every node; the node "
                                 f"groups have sizes {sizes.tolist()} (pass ranks_per_node to choose)")
    replicate = pg.split(shard.rank, pg.rank)
    return shard, replicate


__all__ = ["select_units", "assign_parameters", "build_groups"]
