"""FullyShardedDataParallel: ZeRO-2/3 sharding of parameters, gradients and optimizer state.

[Note: units and hooks]
The model is cut into units: by default each top-level child that has
parameters, or the modules the user lists; parameters outside every unit
form the root unit, gathered for the whole step. Each unit's parameters
become one padded flat parameter sharded over the group (``FlatUnit``). There
is no autograd here, so FSDP wraps each unit module's ``forward`` and
``backward`` (instance attributes shadowing the class methods; the parent
still calls ``child(x)`` and ``child.backward(g)`` as before):

- before a unit's forward its parameters are gathered (waiting for a
  prefetch if one is in flight), and the all-gathers of the next
  ``prefetch`` units, in the order the previous step ran them, are issued
  without waiting; after the forward, FULL_SHARD and HYBRID_SHARD free them;
- before a unit's backward its parameters are gathered again if they were
  freed, and the units before it are prefetched; after the backward its
  gradients are packed, freed and reduce-scattered (non-blocking, one in
  flight at a time, so collectives on one communicator never overlap), and
  its parameters are freed.

Every rank runs the same model code, so every rank issues the same
all-gathers and reduce-scatters in the same order. At the end of
``backward`` any unit whose backward did not run (unused in this step) is
reduced too, with zero gradients, so all units are synchronised every step.

[Note: mixed precision]
With ``MixedPrecision(param_dtype=float16)`` the shards are cast to float16
before the all-gather (half the traffic), the forward and backward run in
float16, gradients are reduced in ``reduce_dtype``, and the result is added
into the float32 master gradient shard. Floating inputs are cast to
``param_dtype`` on the way in and the output back to the master dtype on the
way out, so the loss is computed in full precision; ``backward`` casts the
incoming gradient down again. Pair float16 with ``GradScaler``.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ... import tracing
from ..._dtypes import array_module, is_low_precision_float
from ...backends import ReduceOp
from ...buffers import flat_ops_for, unflatten
from ...collectives import all_gather, all_reduce, gather
from ...errors import ArgumentTypeError, AxonError, ConfigurationError, InvalidArgumentError
from ...groups import resolve_group
from .flat_param import FlatUnit, PendingReduction, Placement, share_shards
from .config import CPUOffload, MixedPrecision, ShardingStrategy
from .memory import CommCounter, FSDPMemoryStats, MemoryTracker
from .state import ROOT, full_to_sharded, prepare_sharded_load, sharded_state
from ..replicate import broadcast_arrays
from ..same_model import check_same_model, parameter_lines


def _is_floating(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or is_low_precision_float(dtype)


def _cast(value: Any, dtype: Optional[np.dtype]) -> Any:
    """Floating arrays cast to ``dtype`` (others unchanged)."""
    if dtype is None or not hasattr(value, "dtype") or not _is_floating(value.dtype) or value.dtype == dtype:
        return value
    return value.astype(dtype)


def _select_units(module: Any, units: Any) -> List[Tuple[str, Any]]:
    """``(name, submodule)`` of each unit, checked (see the module note)."""
    named = module.named_modules()
    if units is None:
        return [(name, child) for name, child in module.named_children() if child.parameters()]
    units = list(units)
    names = {id(m): name for name, m in named}
    out = []
    for i, unit in enumerate(units):
        if id(unit) not in names:
            raise ConfigurationError(f"FSDP units[{i}] ({type(unit).__name__}) is not a submodule of the model")
        if unit is module:
            raise ConfigurationError(f"FSDP units[{i}] is the model itself; list its submodules instead")
        out.append((names[id(unit)], unit))
    for a_name, a in out:
        for b_name, b in out:
            if a is not b and any(m is b for m in a.modules()):
                raise ConfigurationError(f"FSDP units {a_name!r} and {b_name!r} are nested; units must be disjoint")
    return [(n, m) for n, m in out if m.parameters()]


def _assign_parameters(module: Any, units: List[Tuple[str, Any]]) -> List[Tuple[str, Any, List[Tuple[str, Any]]]]:
    """Each unit's named parameters, then the root's leftovers (name ROOT), checked."""
    owner: Dict[int, str] = {}
    plan = []
    for name, unit in units:
        params = unit.named_parameters(prefix=name)
        for pname, p in params:
            if id(p) in owner:
                raise ConfigurationError(f"parameter {pname!r} is shared by FSDP units {owner[id(p)]!r} and "
                                         f"{name!r}; put the modules that share it into one unit")
            owner[id(p)] = name
        plan.append((name, unit, params))
    leftovers = [(n, p) for n, p in module.named_parameters() if id(p) not in owner]
    if leftovers:
        plan.append((ROOT, module, leftovers))
    for name, _, params in plan:
        dtypes = sorted({str(p.dtype) for _, p in params})
        if len(dtypes) > 1:
            raise ConfigurationError(f"FSDP unit {name!r} mixes parameter dtypes {dtypes}; a flat parameter has "
                                     "one dtype, so split the unit (units=[...])")
        if not _is_floating(params[0][1].dtype):
            raise ConfigurationError(f"FSDP unit {name!r} has parameters of dtype {dtypes[0]}, not floating")
    return plan


class FullyShardedDataParallel:
    """Sharded data parallelism (ZeRO-2/3, hybrid) over a process group.

    Used like DDP: ``out = fsdp(x); fsdp.backward(grad)``, with the optimizer
    built over ``fsdp.parameters()`` (this rank's master shards). Wrapping
    copies rank 0's parameter values to every rank, then shards them.

    Args:
        module: the model (an ``axonhpc.nn.Module``).
        group: the process group (None: the current world's).
        sharding_strategy: a ``ShardingStrategy`` (or its name).
        cpu_offload: a ``CPUOffload`` (or its name, or a bool).
        mixed_precision: a ``MixedPrecision``, or None for none.
        units: the submodules to wrap as units (None: each top-level child
            with parameters).
        ranks_per_node: HYBRID_SHARD only: shard over consecutive blocks of
            this many group ranks instead of the nodes MPI reports (lets one
            machine act as several nodes).
        prefetch: how many units ahead to gather while the current unit
            computes (0: none); at most ``1 + prefetch`` units are gathered at once.

    Raises:
        ConfigurationError: before any communication but the model check,
            for a bad option, a model without parameters, units that are not
            disjoint submodules, a unit mixing dtypes, or a group that
            ``ranks_per_node`` does not divide.
        ModelMismatchError: the ranks of the group hold different models
            (parameter names, shapes, dtypes, units), or another rank's model
            failed the checks above; raised on every rank before anything
            else is sent.
    """

    def __init__(self, module: Any, group: Any = None, sharding_strategy: Any = ShardingStrategy.FULL_SHARD,
                 cpu_offload: Any = CPUOffload.NONE, mixed_precision: Optional[MixedPrecision] = None,
                 units: Any = None, ranks_per_node: Optional[int] = None, prefetch: int = 1):
        self.strategy = ShardingStrategy.parse(sharding_strategy)
        self.cpu_offload = CPUOffload.parse(cpu_offload)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ConfigurationError(f"mixed_precision must be an ax.MixedPrecision or None, got "
                                     f"{type(mixed_precision).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigurationError(f"prefetch must be a non-negative int, got {prefetch!r}")
        if ranks_per_node is not None:
            if self.strategy is not ShardingStrategy.HYBRID_SHARD:
                raise ConfigurationError(f"ranks_per_node={ranks_per_node!r} only applies to HYBRID_SHARD, "
                                         f"not {self.strategy.name}")
            if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
                raise ConfigurationError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        self.group = resolve_group(group).require_member("FSDP")
        named = module.named_parameters()
        plan: List[Tuple[str, Any, List[Tuple[str, Any]]]] = []
        problem = None
        try:
            if not named:
                raise ConfigurationError(f"FSDP needs a module with parameters; {type(module).__name__} has none")
            for _, m in module.named_modules():
                if "forward" in m.__dict__ or "backward" in m.__dict__:
                    raise ConfigurationError(f"{type(m).__name__} is already wrapped (by another FSDP?)")
            plan = _assign_parameters(module, _select_units(module, units))
            # Host or device buffers, chosen once; a model in both kinds of memory is refused before any message.
            ops = flat_ops_for([p.data for _, p in named], [n for n, _ in named], "FSDP")
        except AxonError as exc:
            problem = exc
        # Before any other message: every rank holds the same model and units, or every rank raises.
        check_same_model(self.group, f"FSDP over group {self.group.name}", parameter_lines(named), problem,
                         settings=[f"units: {[name for name, _, _ in plan]}"])
        if ranks_per_node is not None and self.group.size % ranks_per_node:
            raise ConfigurationError(f"ranks_per_node={ranks_per_node} does not divide the group size "
                                     f"{self.group.size}")
        self.module = module
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch
        mp = mixed_precision or MixedPrecision()
        # -- communication starts here --
        self.shard_group, self.replicate_group = self._build_groups(ranks_per_node)
        all_params = [p for _, p in module.named_parameters()]
        broadcast_arrays([p.data for p in all_params] + module.buffers(), self.group)
        if mp.buffer_dtype is not None:
            for m in module.modules():
                for name, b in m.named_buffers(recurse=False):
                    if _is_floating(b.dtype):
                        setattr(m, name, b.astype(mp.buffer_dtype))
        self.master_dtype = np.dtype(all_params[0].dtype)
        self.compute_dtype = mp.param_dtype
        placement = Placement(self.cpu_offload, ops)
        self._tracker = MemoryTracker(self._persistent_bytes)
        self.comm = CommCounter()  # the collectives the units issue (see fsdp_memory)
        self._units: List[FlatUnit] = []
        for name, unit_module, params in plan:
            compute = mp.param_dtype or np.dtype(params[0][1].dtype)
            self._units.append(FlatUnit(name, unit_module, params, self.shard_group, self.replicate_group, compute,
                                        mp.reduce_dtype or compute, placement, self._tracker, self.comm))
        share_shards(self._units, self.shard_group)
        self._root = self._units[-1] if self._units[-1].name == ROOT else None
        self._hooked = [u for u in self._units if u is not self._root]
        for unit in self._hooked:
            self._install(unit)
        self._forward_order: List[FlatUnit] = []
        self._last_order: List[FlatUnit] = list(self._hooked)
        self._pending: Optional[PendingReduction] = None
        self._reduced: set = set()
        self._no_sync_depth = 0
        self._syncing = True
        self._pinned = False

    # -- groups ----------------------------------------------------------------------------
    def _build_groups(self, ranks_per_node: Optional[int]) -> Tuple[Any, Any]:
        pg = self.group
        if self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            return pg, None
        if self.strategy is ShardingStrategy.NO_SHARD:
            return None, pg
        color = pg.rank // ranks_per_node if ranks_per_node is not None else pg.world.node_rank
        shard = pg.split(color, pg.rank)
        sizes = all_gather(np.array([shard.size], dtype=np.int64), pg).reshape(-1)
        if len(set(sizes.tolist())) != 1:
            raise ConfigurationError(f"HYBRID_SHARD needs the same number of ranks on every node; the node "
                                     f"groups have sizes {sizes.tolist()} (pass ranks_per_node to choose)")
        replicate = pg.split(shard.rank, pg.rank)
        return shard, replicate

    @property
    def shard_world_size(self) -> int:
        """Ranks one flat parameter is sharded over (1 for NO_SHARD)."""
        return self.shard_group.size if self.shard_group is not None else 1

    @property
    def shard_rank(self) -> int:
        """This rank's index among the shard group (its shard's position)."""
        return self.shard_group.rank if self.shard_group is not None else 0

    @property
    def is_shard_writer(self) -> bool:
        """True on the ranks that write this shard to a checkpoint (the first replica of each shard)."""
        return self.replicate_group is None or self.replicate_group.rank == 0

    # -- hooks -------------------------------------------------------------------------------
    def _install(self, unit: FlatUnit) -> None:
        module = unit.module
        inner_forward, inner_backward = module.forward, module.backward

        label = unit.name or "<root>"

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._pre_forward(unit)
            with tracing.span(f"forward {label}"):
                out = inner_forward(*args, **kwargs)
            self._post_forward(unit)
            return out

        def backward(grad_out: Any) -> Any:
            self._pre_backward(unit)
            with tracing.span(f"backward {label}"):
                grad_in = inner_backward(grad_out)
            self._post_backward(unit)
            return grad_in

        object.__setattr__(module, "forward", forward)
        object.__setattr__(module, "backward", backward)

    def remove_hooks(self) -> None:
        """Gather the parameters for good and unwrap the units (the module works alone again)."""
        self.gather_parameters()
        for unit in self._units:
            unit.release_module_params()
        for unit in self._hooked:
            for attr in ("forward", "backward"):
                unit.module.__dict__.pop(attr, None)
        self._hooked = []

    def _progress(self) -> None:
        for unit in self._units:
            unit.progress()
        if self._pending is not None:
            self._pending.progress()

    def _prefetch(self, order: List[FlatUnit], unit: FlatUnit) -> None:
        if not self.prefetch or unit not in order:
            return
        at = order.index(unit)
        for nxt in order[at + 1:at + 1 + self.prefetch]:
            nxt.start_gather(async_op=True)

    def _pre_forward(self, unit: FlatUnit) -> None:
        unit.gather()
        self._forward_order.append(unit)
        self._prefetch(self._last_order, unit)
        self._progress()

    def _post_forward(self, unit: FlatUnit) -> None:
        if self.strategy.frees_after_forward and not self._pinned:
            unit.free()

    def _pre_backward(self, unit: FlatUnit) -> None:
        unit.gather()
        self._prefetch(self._forward_order[::-1], unit)
        self._progress()

    def _post_backward(self, unit: FlatUnit) -> None:
        if self._syncing:
            self._reduce(unit)
        if not self._pinned:
            unit.free()

    def _reduce(self, unit: FlatUnit) -> None:
        self._finish_pending()  # one reduction in flight at a time
        self._pending = unit.start_reduction()
        self._reduced.add(unit)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.finish()

    # -- forward / backward ------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model with each unit gathered just in time (see the module note).

        Returns:
            The model's output (cast to the master dtype under mixed precision).
        """
        if not self._pinned:
            for unit in self._units:  # parameters gathered before the last optimizer step are stale
                unit.free()
        for unit in self._units:
            unit.new_step()
        self._forward_order = []
        if self._root is not None:
            self._root.gather()
        if self.compute_dtype is not None:
            args = tuple(_cast(a, self.compute_dtype) for a in args)
            kwargs = {k: _cast(v, self.compute_dtype) for k, v in kwargs.items()}
        out = self.module(*args, **kwargs)
        if self.compute_dtype is not None:
            out = _cast(out, self.master_dtype)
        return out

    def backward(self, grad_out: Any) -> Any:
        """Backward through the model; on return the master shards hold the averaged gradients.

        Inside ``no_sync()`` gradients only accumulate, unsharded, in the
        module's Parameters; the next backward outside (or ``sync_gradients``)
        reduces the sum. Gradients add into the master shards' ``grad`` until
        the optimizer's ``zero_grad``.

        Returns:
            The gradient with respect to the model's input.
        """
        if self.compute_dtype is not None:
            grad_out = _cast(grad_out, self.compute_dtype)
        self._syncing = self._no_sync_depth == 0
        self._reduced = set()
        for unit in self._units:
            unit.drop_markers()  # layers add into p.grad: it must be None or a real gradient
        try:
            grad_in = self.module.backward(grad_out)
            if self._syncing:
                for unit in self._units:
                    if unit not in self._reduced:
                        self._reduce(unit)
                self._finish_pending()
        finally:
            self._last_order = [u for u in self._forward_order if u in self._hooked] or self._last_order
            if not self._pinned:
                for unit in self._units:
                    unit.free()
        return grad_in

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Average each unit's gradient with ``hook(state, bucket)`` instead of a reduce-scatter.

        ``bucket.kind`` is "reduce_scatter": the hook's ``Work`` must return
        this rank's averaged part of ``bucket.buffer`` (see
        ``parallel.comm_hooks``; ``fp16_compress_hook`` and
        ``bf16_compress_hook`` send 16-bit floats). Replicas of HYBRID_SHARD
        are still averaged with a plain all-reduce afterwards.

        Raises:
            ConfigurationError: a hook is already registered.
            ArgumentTypeError: ``hook`` is not callable (a ``TypeError``).
        """
        if not callable(hook):
            raise ArgumentTypeError(f"a communication hook must be callable, got {type(hook).__name__}")
        if any(unit.comm_hook is not None for unit in self._units):
            raise ConfigurationError("this FSDP already has a communication hook")
        for index, unit in enumerate(self._units):
            unit.comm_hook = (state, hook, index)

    def sync_gradients(self) -> None:
        """Reduce the unsharded gradients the module's Parameters hold now (after ``no_sync`` backwards)."""
        for unit in self._units:
            self._reduce(unit)
        self._finish_pending()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates unsharded gradients locally (no communication)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # -- full parameters ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _resharding_on_exit(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.reshard_parameters()

    def gather_parameters(self) -> Any:
        """Collective: the module's Parameters hold the full values until ``reshard_parameters()``.

        Usable as a context manager (``with fsdp.gather_parameters(): ...``)
        that reshards on exit, e.g. for evaluation or for reading the
        weights. Changes written into the gathered arrays are not written
        back to the shards; use ``load_state_dict`` for that.

        Returns:
            A context manager that calls ``reshard_parameters()`` on exit.
        """
        for unit in self._units:
            unit.new_step()  # the optimizer may have changed the masters since the last gather
            unit.gather()
        self._pinned = True
        return self._resharding_on_exit()

    def reshard_parameters(self) -> None:
        """Free the gathered parameters (they are gathered again when needed)."""
        self._pinned = False
        for unit in self._units:
            unit.free()

    # -- gradients -----------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Collective: scale the gradient shards so the global gradient norm is at most ``max_norm``.

        The norm is that of all gradients of the model together, computed
        from the shards (each element counted once) and reduced across the
        shard group: the same number single-process ``clip_grad_norm`` gives.

        Args:
            max_norm: largest allowed norm.
            norm_type: p of the p-norm; ``float("inf")`` for the largest absolute value.

        Returns:
            The global norm before clipping.

        Raises:
            InvalidArgumentError: ``norm_type`` is not positive (a ``ValueError``).
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise InvalidArgumentError(f"clip_grad_norm norm_type must be positive, got {norm_type}")
        grads = [u.shard.grad for u in self._units if u.shard.grad is not None]
        xp = array_module(grads[0]) if grads else np
        inf = np.isinf(norm_type)
        local = 0.0
        for g in grads:
            g64 = xp.abs(g.astype(np.float64))
            local = max(local, float(g64.max()) if g.size else 0.0) if inf else local + float((g64 ** norm_type).sum())
        value = np.array([local], dtype=np.float64)
        if self.shard_group is not None and self.shard_group.size > 1:
            all_reduce(value, ReduceOp.MAX if inf else ReduceOp.SUM, self.shard_group)
        total = float(value[0]) if inf else float(value[0]) ** (1.0 / norm_type)
        coef = min(float(max_norm) / (total + 1e-6), 1.0)
        if coef < 1.0:
            for g in grads:
                g *= coef
        return total

    # -- the optimizer's view ------------------------------------------------------------------
    def parameters(self) -> List[Any]:
        """This rank's master shards (one Parameter per unit), for the optimizer."""
        return [u.shard for u in self._units]

    def named_parameters(self) -> List[Tuple[str, Any]]:
        """``(unit name + ".flat_param", shard)`` per unit ("flat_param" for the root)."""
        return [((u.name + ".flat_param") if u.name != ROOT else "flat_param", u.shard) for u in self._units]

    @property
    def units(self) -> List[FlatUnit]:
        """The flat units, root last."""
        return list(self._units)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the shards' gradients and any unsharded gradients of the module."""
        for unit in self._units:
            unit.shard.zero_grad(set_to_none)
            for p in unit.params:
                p.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> "FullyShardedDataParallel":
        """Training mode for the wrapped module."""
        self.module.train(mode)
        return self

    def eval(self) -> "FullyShardedDataParallel":
        """Evaluation mode for the wrapped module."""
        self.module.eval()
        return self

    # -- memory ----------------------------------------------------------------------------------
    def _persistent_bytes(self) -> Dict[str, int]:
        params = grads = 0
        for unit in getattr(self, "_units", []):
            p, g = unit.persistent_bytes()
            params += p
            grads += g
        return {"params": params, "grads": grads}

    def memory_stats(self, optimizer: Any = None) -> Dict[str, int]:
        """Bytes this rank holds now and at its peak, counted from the arrays FSDP owns.

        Args:
            optimizer: the optimizer over ``fsdp.parameters()``; its state
                arrays are counted (now, and as present throughout for the peak).

        Returns:
            ``{"params", "grads", "optimizer", "gathered_params",
            "unsharded_grads", "communication", "current", "peak"}`` in bytes
            (see ``fsdp_memory``'s note for what is counted).
        """
        opt_bytes = 0
        if optimizer is not None:
            for state in optimizer.state:
                opt_bytes += sum(int(v.nbytes) for v in state.values() if hasattr(v, "nbytes"))
        return self._tracker.snapshot({"optimizer": opt_bytes})

    def reset_peak_memory_stats(self) -> None:
        """Start measuring the peak anew from the current bytes."""
        self._tracker.reset_peak()

    def memory_estimate(self, optimizer_bytes: Optional[float] = None) -> FSDPMemoryStats:
        """The ZeRO-formula estimate for this model, shard group and strategy.

        Parameters and gradients count the master dtype's bytes (the shards
        FSDP keeps); the stage is 3 for FULL_SHARD and HYBRID_SHARD (over the
        node group), 2 for SHARD_GRAD_OP, 0 for NO_SHARD.

        Args:
            optimizer_bytes: K, optimizer bytes per parameter (None: two
                master-dtype words, Adam's moments).

        Returns:
            The per-rank ``FSDPMemoryStats``.
        """
        itemsize = self.master_dtype.itemsize
        k = 2 * itemsize if optimizer_bytes is None else optimizer_bytes
        numel = sum(u.numel for u in self._units)
        return FSDPMemoryStats.estimate(numel, self.shard_world_size, self.strategy.zero_stage,
                                        param_bytes=itemsize, grad_bytes=itemsize, optimizer_bytes=k)

    # -- state dicts -----------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True) -> "OrderedDict[str, Any]":
        """Collective: the model's full state dict (names and order of ``module.state_dict()``).

        Args:
            rank0_only: build it on group rank 0 only (the others return an
                empty dict and hold no full copy).

        Returns:
            name -> numpy/cupy array (master dtype), or an empty dict off rank 0 with ``rank0_only``.
        """
        values: Dict[int, Any] = {}
        keep = not rank0_only or self.group.rank == 0
        for unit in self._units:
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
        for key, (owner, name, kind) in self.module._state_targets().items():
            out[key] = values[id(owner._parameters[name])] if kind == "param" else owner._buffers[name].copy()
        return out

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Collective: ``full_state_dict(rank0_only=False)``."""
        return self.full_state_dict(rank0_only=False)

    def sharded_state_dict(self, optimizer: Any = None) -> Dict[str, Any]:
        """This rank's shards (and optimizer state shards) with their global index ranges.

        Plain data (arrays, numbers, strings, lists, dicts) that ``checkpoint.save``
        stores; ``load_state_dict`` on any world size accepts a list of them.

        Args:
            optimizer: the optimizer over ``fsdp.parameters()``, or None.

        Returns:
            See ``fsdp_state.sharded_state``.
        """
        return sharded_state(self, optimizer)

    def load_state_dict(self, state: Any, optimizer: Any = None) -> None:
        """Load a full state dict, a sharded state dict, or a list of sharded ones (any world size).

        A full state dict (name -> array, as ``module.state_dict()``) must be
        given on every rank; each keeps its slice. Sharded dicts saved on N
        ranks are reassembled for this group's shards whatever N was, with
        the optimizer state when ``optimizer`` is given.

        Args:
            state: the state to load.
            optimizer: the optimizer over ``fsdp.parameters()`` (sharded state only).

        Raises:
            StateDictError: before anything changes, for missing or
                mismatched entries, or shards that do not cover this rank's range.
        """
        self.prepare_load(state, optimizer)()

    def prepare_load(self, state: Any, optimizer: Any = None) -> Callable[[], None]:
        """Check ``state`` as ``load_state_dict`` would, and return the function that loads it.

        Nothing changes until the returned function is called, so a
        collective loader can make every rank agree first (see
        ``checkpoint.load_sharded``).

        Returns:
            ``apply()``, which copies the values in and drops gathered parameters.

        Raises:
            StateDictError: as ``load_state_dict``.
        """
        if isinstance(state, dict) and "units" not in state:
            write = prepare_sharded_load(self, [full_to_sharded(self, state)], None)
        else:
            write = prepare_sharded_load(self, state if isinstance(state, list) else [state], optimizer)

        def apply() -> None:
            write()
            for unit in self._units:
                unit.new_step()
            self.reshard_parameters()

        return apply


FSDP = FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "FSDP"]
