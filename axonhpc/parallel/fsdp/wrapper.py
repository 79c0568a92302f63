"""FullyShardedDataParallel: ZeRO-2/3 sharding of parameters, gradients and optimizer state.

[Note: mixed precision]
With ``param_dtype=float16`` shards are cast before the all-gather (half the traffic), gradients are reduced
in ``reduce_dtype`` and added into the float32 master shard, and the output is cast back to the master dtype
so the loss is computed in full precision. Pair float16 with ``GradScaler``.

[Note: a failed step]
Forward and backward are collective (all-gathers, reduce-scatters, the replicas' all-reduces), so one that
raises on some ranks would leave the others waiting in the next unit's collective. The failing rank first
waits for its own gathers and reductions in flight (the others made them too), then takes part in the others'
next call on its shard group, and on its replicate group, as a refusal: they raise ``CollectiveRefusedError``
naming it and its error. A rank refused on its shard group tells its replicate group in turn, so with
HYBRID_SHARD every replica hears of it. Errors the group raised alike tell nothing more there; after a
timeout or a dead peer nothing is sent.
"""
from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ...buffers import flat_ops_for
from ...collectives.core import refuse_call
from ...errors import GROUP_FAILURES, ArgumentTypeError, CollectiveMismatchError, ConfigurationError
from ...groups import resolve_group
from ...nn import Module, call_backward, require_module
from .flat_param import FlatUnit, Placement, share_shards
from .config import CPUOffload, MixedPrecision, ShardingStrategy, cast, is_floating
from .hooks import UnitHooks
from .memory import CommCounter, FSDPMemoryStats, MemoryTracker, memory_estimate, memory_stats, persistent_bytes
from .state import ROOT, full_state_dict, load_state, prepare_load, sharded_state
from .units import assign_parameters, build_groups, select_units
from ..grad_norm import clip_grad_norm
from ..replicate import broadcast_arrays
from ..same_model import check_model_arrays, compared_model, parameter_lines
from ..wrapping import WrapperModes


_SAME = ("every rank must build the same model (the same layers, sizes and dtypes, in the same order) and pass the "
         "same FSDP options (sharding_strategy, cpu_offload, mixed_precision, ranks_per_node, prefetch, units)")


def _checked_options(sharding_strategy: Any, cpu_offload: Any, mixed_precision: Any, ranks_per_node: Any,
                     prefetch: Any, group_size: int) -> Tuple[ShardingStrategy, CPUOffload, MixedPrecision]:
    """The parsed strategy and offload, and the mixed precision (an all-None one for None), or ConfigurationError
    naming the bad option: meant inside the model check, so that every rank hears of one rank's bad option."""
    strategy = ShardingStrategy.parse(sharding_strategy)
    offload = CPUOffload.parse(cpu_offload)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ConfigurationError(f"mixed_precision must be an ax.MixedPrecision or None, got "
                                 f"{type(mixed_precision).__name__} {mixed_precision!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigurationError(f"prefetch must be a non-negative int, got {prefetch!r}")
    if ranks_per_node is not None:
        if strategy is not ShardingStrategy.HYBRID_SHARD:
            raise ConfigurationError(f"ranks_per_node={ranks_per_node!r} only applies to HYBRID_SHARD, "
                                     f"not {strategy.name}")
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ConfigurationError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if group_size % ranks_per_node:
            raise ConfigurationError(f"ranks_per_node={ranks_per_node} does not divide the group size {group_size}")
    return strategy, offload, mixed_precision or MixedPrecision()


class FullyShardedDataParallel(WrapperModes):
    """Sharded data parallelism (ZeRO-2/3, hybrid) over a process group; used like DDP, optimizer over ``fsdp.parameters()``.

    Args:
        sharding_strategy, cpu_offload: a ``ShardingStrategy`` / ``CPUOffload`` or its name (a bool for offload).
        units: the submodules to wrap as units (None: each top-level child with parameters).
        ranks_per_node: HYBRID_SHARD only: shard over blocks of this many consecutive group ranks, not MPI's nodes.
        prefetch: units gathered ahead while one computes.

    Raises:
        ConfigurationError: before any communication but the model check, for a bad option, a model without
            parameters, overlapping units, a unit mixing dtypes, or a group ``ranks_per_node`` does not divide.
        ModelMismatchError: on every rank, the ranks hold different models or passed different options (naming
            the first that differs and each rank's value), or another rank failed the checks above.
    """

    def __init__(self, module: Any, group: Any = None, sharding_strategy: Any = ShardingStrategy.FULL_SHARD,
                 cpu_offload: Any = CPUOffload.NONE, mixed_precision: Optional[MixedPrecision] = None,
                 units: Any = None, ranks_per_node: Optional[int] = None, prefetch: int = 1):
        self.group = resolve_group(group).require_member("FSDP")
        named = module.named_parameters() if isinstance(module, Module) else []
        # Before any other message: every rank holds the same model, units and options, or every rank raises
        # (a bad option on one rank too: the others would otherwise wait for it in the first gather).
        with compared_model(self.group, f"FSDP over group {self.group.name}", hint=_SAME) as described:
            self.strategy, self.cpu_offload, mp = _checked_options(sharding_strategy, cpu_offload, mixed_precision,
                                                                   ranks_per_node, prefetch, self.group.size)
            require_module(module, "FSDP")
            if not named:
                raise ConfigurationError(f"FSDP needs a module with parameters; {type(module).__name__} has none")
            check_model_arrays(module, "FSDP")
            for _, m in module.named_modules():
                if "forward" in m.__dict__ or "backward" in m.__dict__:
                    raise ConfigurationError(f"{type(m).__name__} is already wrapped (by another FSDP?)")
            plan = assign_parameters(module, select_units(module, units))
            # Host or device buffers, chosen once; a model in both kinds of memory is refused before any message.
            ops = flat_ops_for([p.data for _, p in named], [n for n, _ in named], "FSDP")
            described.lines = parameter_lines(named)
            described.settings = [f"sharding_strategy: {self.strategy.name}", f"cpu_offload: {self.cpu_offload.name}",
                                  f"mixed_precision: param_dtype={mp.param_dtype}, reduce_dtype={mp.reduce_dtype}, "
                                  f"buffer_dtype={mp.buffer_dtype}", f"ranks_per_node: {ranks_per_node}",
                                  f"prefetch: {prefetch}", f"units: {[name for name, _, _ in plan]}"]
        self.module = module
        self.mixed_precision = mixed_precision
        # -- communication starts here --
        self.shard_group, self.replicate_group = build_groups(self.strategy, self.group, ranks_per_node)
        all_params = [p for _, p in module.named_parameters()]
        broadcast_arrays([p.data for p in all_params] + module.buffers(), self.group)
        if mp.buffer_dtype is not None:
            for m in module.modules():
                for name, b in m.named_buffers(recurse=False):
                    if is_floating(b.dtype):
                        setattr(m, name, b.astype(mp.buffer_dtype))
        self.master_dtype = np.dtype(all_params[0].dtype)
        self.compute_dtype = mp.param_dtype
        placement = Placement(self.cpu_offload, ops)
        self._master_ops = placement.master_ops  # where the master shards and their gradients live
        self._units: List[FlatUnit] = []
        self._tracker = MemoryTracker(functools.partial(persistent_bytes, self))
        self.comm = CommCounter()  # the collectives the units issue (see the package's memory module)
        for name, unit_module, params in plan:
            compute = mp.param_dtype or np.dtype(params[0][1].dtype)
            self._units.append(FlatUnit(name, unit_module, params, self.shard_group, self.replicate_group, compute,
                                        mp.reduce_dtype or compute, placement, self._tracker, self.comm))
        share_shards(self._units, self.shard_group)
        root = self._units[-1] if self._units[-1].name == ROOT else None
        self._hooks = UnitHooks(self._units, root, self.strategy, prefetch)  # the step's choreography

    @property
    def prefetch(self) -> int:
        """How many units ahead are gathered while the current unit computes (settable)."""
        return self._hooks.prefetch

    @prefetch.setter
    def prefetch(self, value: int) -> None:
        self._hooks.prefetch = value

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
    def remove_hooks(self) -> None:
        """Gather the parameters for good and unwrap the units (the module works alone again)."""
        self.gather_parameters()
        for unit in self._units:
            unit.release_module_params()
        self._hooks.uninstall()

    # -- forward / backward ------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model with each unit gathered just in time; the output is in the master dtype.

        Collective; if it raises on some ranks, the others raise ``CollectiveRefusedError`` ([Note: a failed step]).
        """
        try:
            self._hooks.start_forward()
            if self.compute_dtype is not None:
                args = tuple(cast(a, self.compute_dtype) for a in args)
                kwargs = {k: cast(v, self.compute_dtype) for k, v in kwargs.items()}
            out = self.module(*args, **kwargs)
        except Exception as exc:
            self._hooks.abandon()
            self._fail_step(exc)
            raise
        if self.compute_dtype is not None:
            out = cast(out, self.master_dtype)
        return out

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Backward through the model; on return the master shards hold the averaged gradients (outside ``no_sync()``).

        Collective; if it raises on some ranks, the others raise ``CollectiveRefusedError`` ([Note: a failed step]).
        """
        try:
            if self.compute_dtype is not None:
                grad_out = cast(grad_out, self.compute_dtype)
            backward = functools.partial(call_backward, self.module.backward, input_grad=input_grad)
            return self._hooks.run_backward(backward, grad_out, syncing=self.syncing)  # it abandons what failed
        except Exception as exc:
            self._fail_step(exc)
            raise

    def _fail_step(self, problem: Exception) -> None:
        """This rank's forward or backward raised and waited for what it had in flight: tell the groups whose
        ranks still wait for it ([Note: a failed step]). Raises ``problem`` once it told one."""
        told = False
        for pg in (self.shard_group, self.replicate_group):
            if pg is None or pg.size == 1:
                continue
            if isinstance(problem, GROUP_FAILURES) and not (
                    isinstance(problem, CollectiveMismatchError)
                    and set(getattr(problem, "ranks", ())) != set(pg.ranks)):
                continue  # raised alike on this group's ranks already, or the group is broken (timeout, dead peer)
            try:
                refuse_call(pg, "FSDP step", problem)
            except Exception as exc:  # noqa: BLE001 - refuse_call raises the problem it told of
                if exc is not problem:
                    raise
            told = True
        if told:
            raise problem

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Average each unit's gradient with ``hook(state, bucket)`` (``bucket.kind`` "reduce_scatter") instead of a reduce-scatter.

        Raises ConfigurationError if a hook is registered already, ArgumentTypeError if ``hook`` is not callable.
        """
        if not callable(hook):
            raise ArgumentTypeError(f"a communication hook must be callable, got {type(hook).__name__}")
        if any(unit.comm_hook is not None for unit in self._units):
            raise ConfigurationError("this FSDP already has a communication hook")
        for index, unit in enumerate(self._units):
            unit.comm_hook = (state, hook, index)

    def sync_gradients(self) -> None:
        """Reduce the unsharded gradients the module's Parameters hold now (after ``no_sync`` backwards)."""
        self._hooks.reduce_all()

    # -- full parameters ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _resharding_on_exit(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.reshard_parameters()

    def gather_parameters(self) -> Any:
        """Collective: a context manager in which the Parameters hold the full values (changes are not written back)."""
        self._hooks.gather_all()
        return self._resharding_on_exit()

    def reshard_parameters(self) -> None:
        """Free the gathered parameters (they are gathered again when needed)."""
        self._hooks.free_all()

    # -- gradients -----------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Collective: scale the gradient shards so the global ``norm_type`` norm is at most ``max_norm``; returns it unclipped.

        The norm is summed over the shard group; the arguments are compared over the whole FSDP group, so
        replicas (NO_SHARD, HYBRID_SHARD) cannot clip alike-held shards by different factors.

        Raises:
            InvalidArgumentError: a non-positive ``norm_type``, or a ``max_norm`` that is not a number or is NaN;
                the group's other ranks raise ``CollectiveRefusedError`` naming this rank.
            CollectiveMismatchError: on every rank, the ranks passed different ``norm_type`` or ``max_norm``
                (naming the range of each); nothing is scaled.
        """
        grads = [u.shard.grad for u in self._units if u.shard.grad is not None]
        return clip_grad_norm(grads, max_norm, norm_type, sum_over=[self.shard_group],
                              check_over=[self.group])

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

    # -- memory ----------------------------------------------------------------------------------
    def memory_stats(self, optimizer: Any = None) -> Dict[str, int]:
        """Bytes this rank holds now and at its peak, by kind, counted from the arrays FSDP owns (and ``optimizer``'s)."""
        return memory_stats(self._tracker, optimizer)

    def reset_peak_memory_stats(self) -> None:
        """Start measuring the peak anew from the current bytes."""
        self._tracker.reset_peak()

    def memory_estimate(self, optimizer_bytes: Optional[float] = None) -> FSDPMemoryStats:
        """The per-rank ZeRO-formula estimate; ``optimizer_bytes`` per parameter (None: two master-dtype words)."""
        return memory_estimate(self, optimizer_bytes)

    # -- state dicts -----------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True) -> "OrderedDict[str, Any]":
        """Collective: the model's full state dict; with ``rank0_only`` the other ranks return an empty dict."""
        return full_state_dict(self, rank0_only)

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Collective: ``full_state_dict(rank0_only=False)``."""
        return self.full_state_dict(rank0_only=False)

    def sharded_state_dict(self, optimizer: Any = None) -> Dict[str, Any]:
        """This rank's shards (and optimizer state shards) with their global index ranges, for ``checkpoint.save``."""
        return sharded_state(self, optimizer)

    def load_state_dict(self, state: Any, optimizer: Any = None) -> None:
        """Collective: load a full state dict (the same on every rank), a sharded one, or a list of sharded ones from any world size.

        Every rank checks its part, then the ranks agree: all load, or none changes anything.

        Raises:
            StateDictError: on every rank alike, before anything changes anywhere, if any rank finds missing or
                mismatched entries, an uncovered range, optimizer state that does not fit ``optimizer``, an empty
                dict (``full_state_dict()``'s default gives one on all ranks but 0), or if the ranks' full
                state dicts differ.
        """
        load_state(self, state, optimizer)

    def prepare_load(self, state: Any, optimizer: Any = None) -> Callable[[], None]:
        """Local: check ``state`` as ``load_state_dict`` would and return ``apply()``, which loads it.

        For a collective loader that makes the ranks agree itself (``checkpoint.load_sharded``) before any calls
        ``apply()``; full state dicts are not compared across ranks here.
        """
        return prepare_load(self, state, optimizer)


FSDP = FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "FSDP"]
