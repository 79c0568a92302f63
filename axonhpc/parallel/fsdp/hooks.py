"""FSDP's step choreography: ``UnitHooks`` gathers, prefetches, frees and reduces the units around their compute.

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
all-gathers in the same order. Not so the reductions: a unit whose backward
does not run on one rank (a layer skipped for this rank's batch) would be
reduced at the end there and in its place elsewhere, and two units of one
size would swap gradients without any check seeing a difference. So the
reductions go in one order on every rank, the hooked units' reversed (the
order a backward reaches them when the units are listed in forward order,
as the default plan lists a Sequential's): a unit whose backward has run is
reduced once every unit before it in that order has been; at the end of
``backward`` the rest are reduced in that order, zeros where a rank had no
gradient, then the root. Units listed out of forward order still give the
right gradients; their reductions just wait for the end of the backward.

[Note: a unit no rank's backward reached]
Reduced zeros would give such a unit a zero gradient, and momentum, Adam's
moments and weight decay would move it where a single process (and DDP with
``find_unused_parameters``) leaves a parameter without a gradient alone. The
same holds for one parameter of a unit that was used (a branch taken only
sometimes). So a syncing backward ends with one small MAX all-reduce of a
flag per unit parameter (over the shard group, then the replicas): parameter
i of a unit stands in its gradient if the gradient stood for it before the
backward (kept, not set to None: [Note: parameters without a gradient inside
a unit] in ``flat_param``) or any rank had a gradient for it in any of the
reductions since (``no_sync`` micro-steps included). A unit none of whose
parameters stands gets None back, and the optimizer skips it; otherwise the
optimizer steps only the pieces of the parameters that stand. Not in a CUDA
graph capture: a graph replays the same writes into every gradient buffer,
so there every parameter keeps its (zero) gradient, as before.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ...backends import ReduceOp
from ...collectives import all_reduce
from ...cuda import capture
from ...nn import call_backward
from ...observe import tracing
from .config import ShardingStrategy
from .flat_param import FlatUnit, PendingReduction


class UnitHooks:
    """The hooks on one FSDP's unit modules and the state of the step they drive (see the note).

    Args:
        units: every unit, the root (if any) last.
        root: the root unit (gathered for the whole step, not hooked), or None.
        strategy: the sharding strategy (whether a forward frees its unit).
        prefetch: how many units ahead to gather.

    Attributes:
        hooked: the units whose modules carry the hooks (none after ``uninstall``).
        pinned: the parameters stay gathered (``gather_all``) until ``free_all``.
        syncing: this backward reduces the gradients (outside ``no_sync``).
    """

    def __init__(self, units: List[FlatUnit], root: Optional[FlatUnit], strategy: ShardingStrategy, prefetch: int):
        self.units = units
        self.root = root
        self.strategy = strategy
        self.prefetch = prefetch
        self.hooked = [u for u in units if u is not root]
        for unit in self.hooked:
            self._install(unit)
        self.forward_order: List[FlatUnit] = []
        self.last_order: List[FlatUnit] = list(self.hooked)
        self.pending: Optional[PendingReduction] = None
        self.reduced: set = set()
        self.order: List[FlatUnit] = self.hooked[::-1]  # the reductions' order, every rank's (see the note)
        self.ready: set = set()  # units whose backward has run in this backward, not reduced yet
        self.next_reduced = 0  # where in ``order`` the reductions are
        # unit -> per parameter: its gradient was reduced here, or the shard's gradient stood for it before
        self.had_grads: Dict[FlatUnit, List[bool]] = {}
        self.syncing = True
        self.pinned = False

    # -- the hooks -------------------------------------------------------------------------
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

        def backward(grad_out: Any, input_grad: bool = True) -> Any:
            self._pre_backward(unit)
            with tracing.span(f"backward {label}"):
                grad_in = call_backward(inner_backward, grad_out, input_grad)
            self._post_backward(unit)
            return grad_in

        object.__setattr__(module, "forward", forward)
        object.__setattr__(module, "backward", backward)

    def uninstall(self) -> None:
        """Unwrap the unit modules (their class's ``forward`` and ``backward`` again)."""
        for unit in self.hooked:
            for attr in ("forward", "backward"):
                unit.module.__dict__.pop(attr, None)
        self.hooked = []

    def _progress(self) -> None:
        for unit in self.units:
            unit.progress()
        if self.pending is not None:
            self.pending.progress()

    def _prefetch(self, order: List[FlatUnit], unit: FlatUnit) -> None:
        if not self.prefetch or unit not in order:
            return
        at = order.index(unit)
        for nxt in order[at + 1:at + 1 + self.prefetch]:
            nxt.start_gather(async_op=True)

    def _pre_forward(self, unit: FlatUnit) -> None:
        unit.gather()
        self.forward_order.append(unit)
        self._prefetch(self.last_order, unit)
        self._progress()

    def _post_forward(self, unit: FlatUnit) -> None:
        if self.strategy.frees_after_forward and not self.pinned:
            unit.free()

    def _pre_backward(self, unit: FlatUnit) -> None:
        unit.gather()
        self._prefetch(self.forward_order[::-1], unit)
        self._progress()

    def _post_backward(self, unit: FlatUnit) -> None:
        if self.syncing:
            if unit in self.reduced:  # a second backward through the unit (a module used twice): its new part
                self._reduce(unit)
            else:
                self.ready.add(unit)
                self._reduce_ready()
        if not self.pinned:
            unit.free()

    def _reduce(self, unit: FlatUnit) -> None:
        self._finish_pending()  # one reduction in flight at a time
        flags = self.had_grads.get(unit)
        if flags is None:  # the unit's first reduction in this backward: what its gradient stood for before
            flags = self.had_grads[unit] = unit.prior_flags()
        self.pending = unit.start_reduction(flags)
        self.reduced.add(unit)

    def _reduce_ready(self) -> None:
        """Reduce the units whose turn it is in ``order`` and whose backward has run."""
        while self.next_reduced < len(self.order) and self.order[self.next_reduced] in self.ready:
            self._reduce(self.order[self.next_reduced])
            self.next_reduced += 1

    def _reduce_rest(self) -> None:
        """The end of a syncing backward: the units not reduced yet, in ``order`` then the root; then drop the
        zero gradient of every unit no rank had a gradient for, and mark the parameters without one
        ([Note: a unit no rank's backward reached])."""
        for unit in self.order[self.next_reduced:]:
            self._reduce(unit)
        self.next_reduced = len(self.order)
        for unit in self.units:
            if unit not in self.reduced:
                self._reduce(unit)
        self._finish_pending()
        self._drop_gradients_nobody_had()

    def _drop_gradients_nobody_had(self) -> None:
        units = [u for u in self.units if u in self.had_grads]
        if capture.capturing():  # a graph replays its writes into every gradient: nothing to drop (see the note)
            for unit in units:
                unit.set_grad_flags([True] * len(unit.params))
            self.had_grads = {}
            return
        groups = [g for g in (units[0].shard_group, units[0].replicate_group) if g is not None and g.size > 1] \
            if units else []
        local = [flag for u in units for flag in self.had_grads[u]]
        if groups:  # one call per group for every parameter's flag
            flags = np.array(local, dtype=np.int32)
            for group in groups:
                all_reduce(flags, ReduceOp.MAX, group)
            everywhere = bool(flags.all())
            local = local if everywhere else flags.astype(bool).tolist()
        else:
            everywhere = all(local)
        at = 0
        for unit in units:
            count = len(unit.params)
            unit.set_grad_flags([True] * count if everywhere else local[at:at + count])
            at += count
        self.had_grads = {}

    def _finish_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.finish()

    # -- the step ------------------------------------------------------------------------------
    def start_forward(self) -> None:
        """Before the model's forward: drop stale gathered parameters, gather the root (collective)."""
        if not self.pinned:
            for unit in self.units:  # parameters gathered before the last optimizer step are stale
                unit.free()
        for unit in self.units:
            unit.new_step()
        self.forward_order = []
        if self.root is not None:
            self.root.gather()

    def run_backward(self, backward: Callable[[Any], Any], grad_out: Any, syncing: bool) -> Any:
        """Run ``backward(grad_out)`` (the model's) under the hooks; reduce what it left (collective if ``syncing``).

        Returns:
            What ``backward`` returned.
        """
        self.syncing = syncing
        self.reduced = set()
        self.ready = set()
        self.next_reduced = 0
        self.had_grads = {}
        for unit in self.units:
            unit.drop_markers()  # layers add into p.grad: it must be None or a real gradient
        try:
            grad_in = backward(grad_out)
            if self.syncing:
                self._reduce_rest()
        except Exception:
            self.abandon()
            raise
        finally:
            self.last_order = [u for u in self.forward_order if u in self.hooked] or self.last_order
            if not self.pinned:
                for unit in self.units:
                    unit.free()
        return grad_in

    def abandon(self) -> None:
        """The step failed on this rank: wait for every all-gather and reduction in flight and keep none of them,
        so nothing writes into this rank's buffers later and the next step starts from a quiet group. The module
        Parameters' unreduced gradients are dropped: part of them is the failed backward's."""
        for unit in self.units:
            unit.abandon_gather()
            for p in unit.params:
                p.grad = None
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.abandon()

    def reduce_all(self) -> None:
        """Reduce every unit's unsharded gradients now, one at a time (collective)."""
        self.reduced = set()
        self.next_reduced = 0
        self.had_grads = {}
        self._reduce_rest()

    def gather_all(self) -> None:
        """Gather every unit's full parameters and keep them (pinned) until ``free_all`` (collective)."""
        for unit in self.units:
            unit.new_step()  # the optimizer may have changed the masters since the last gather
            unit.gather()
        self.pinned = True

    def free_all(self) -> None:
        """Free every unit's gathered parameters and unpin them."""
        self.pinned = False
        for unit in self.units:
            unit.free()


__all__ = ["UnitHooks"]
