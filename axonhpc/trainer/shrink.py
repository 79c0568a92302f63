"""``DistributedTrainer(fault_tolerance="shrink")``: the loop's steps under ``elastic.ElasticTraining``.

[Note: the same samples at any width]
The run keeps its global batch, ``batch_size`` times the data-parallel width it
started with: on D ranks each takes G / D samples of it. The sampler deals the
epoch's permutation out round-robin, so rank r's k-th batch of b samples holds
the positions r + D (k b + i), and the ranks' k-th batches together are the
positions [k G, (k + 1) G) at every width. After a shrink the survivors
therefore compute the step the uninterrupted run computes, up to the order of
floating-point sums. An epoch's last, partial global batch is dropped, so that
each epoch has the same steps at every width.

[Note: what a rebuild costs]
A recovery builds the strategy anew on the survivors (``ElasticTraining``
calls ``build``): a fresh copy of the model, taken from the one the trainer
was given before it was first wrapped (one more copy of the model per rank
for the whole run), wrapped for the new width, with a new optimizer of the
given one's class and hyperparameters; the gathered state then fills it.

[Note: a rank lost while the trainer is built]
The first world's build (``start``: the strategy's wrapping, then the
checkpoint ``fit`` resumes from) is collective. When a rank dies in it,
``ElasticTraining`` has the survivors agree that it was cut short and call
``start`` again on themselves (``elastic.loop``'s note): a fresh copy of the
model as given, and the checkpoint loaded again, so nothing half-built or
half-loaded is kept. The global batch stays that of the starting width.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..data import DataLoader, DistributedSampler
from ..elastic import ElasticTraining, parse_failures
from ..elastic.loop import Recovery
from ..elastic.respawn import joined
from ..errors import ConfigurationError
from ..groups import current_world
from ..parallel import FSDP
from ..parallel.boxes import fsdp_boxes, replicated_boxes
from ..settings import settings
from .optimizers import check_rebuildable, rebuild_optimizer
from .preemption import Preemption
from .strategies import Setup, build

SHRINKABLE = ("ddp", "fsdp")
WHOLE_STATE = "whole-state"  # under checkpoint_dir: the state when a run cannot go on (load_model_slices reads it)


def replacement_facts() -> Optional[Dict[str, Any]]:
    """In a process spawned to replace a lost rank, what the survivors told it (``elastic.respawn``); else None."""
    from mpi4py import MPI

    return joined(MPI)


def check_options(strategy: str, group: Any, mesh: Any, optimizer: Any, simulate_failure: Optional[str],
                  spares: Any) -> None:
    """Refuse, alike on every rank and before anything is sent, what a shrinking run cannot do.

    Raises:
        ConfigurationError: naming the option and what it must be.
    """
    if strategy not in SHRINKABLE:
        raise ConfigurationError(f"fault_tolerance='shrink' rebuilds data parallelism over the survivors: strategy "
                                 f"must be one of {list(SHRINKABLE)}, got {strategy!r}")
    if group is not None or mesh is not None:
        raise ConfigurationError("fault_tolerance='shrink' trains over the whole job (the world shrinks): leave "
                                 "group and mesh unset")
    if not settings.fault_tolerant:
        raise ConfigurationError("fault_tolerance='shrink' needs fault tolerance: ax.init(fault_tolerant=True) in a "
                                 "job started with axonhpc launch --fault-tolerant (Open MPI with ULFM)")
    check_rebuildable(optimizer)
    parse_failures(simulate_failure)
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ConfigurationError(f"spares must be an int >= 0, got {spares!r}")


class StateView:
    """What ``ElasticTraining`` reads of a model: its dp group, FSDP's engine, and where its state lies."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.dp = setup.dp_group
        self.engine = setup.wrapper
        self.fsdp = isinstance(setup.wrapper, FSDP)

    def parameter_boxes(self, shard_rank: Optional[int] = None, shards: Optional[List[Any]] = None
                        ) -> Dict[str, Tuple[Any, ...]]:
        """The boxes of the state this rank's optimizer updates (``parallel.boxes``); a buddy's with ``shards``."""
        if self.fsdp:
            return fsdp_boxes(self.setup.module, self.engine.units, shard_rank, shards)
        return replicated_boxes(self.setup.module)


class Parts:
    """One world's run: the strategy's setup, as ``ElasticTraining`` takes a build's result."""

    def __init__(self, setup: Setup, abandon: Callable[[], None]):
        self.setup = setup
        self.model = StateView(setup)
        self.optimizer = setup.optimizer
        self.skip = False  # the step's agreed skip (skip_nonfinite_steps), from its communicating half
        self.abandon = abandon

    def update(self) -> None:
        """The step's local half: the optimizer (``ElasticTraining`` calls it)."""
        self.setup.update(self.skip)


class Shrinking:
    """A trainer's fault tolerance: the ``ElasticTraining`` over its steps, and how a world's setup is built.

    Args:
        trainer: the ``DistributedTrainer``.
        mixed_precision: ``fit``'s (fixed by the first fit).
        batch_size: ``fit``'s samples per rank at the starting width.
        resume: ``(plan, resume)`` for the first world's ``_resume_point``; when
            the run cannot go on, the whole state is saved in ``plan.checkpoint_dir/whole-state``.

    Collective over the job (on a spare it returns once it trains or the run has ended: ``active``).
    """

    def __init__(self, trainer: Any, mixed_precision: Any, batch_size: int, resume: Tuple[Any, bool]):
        if mixed_precision is not None and mixed_precision.param_dtype == np.float16:
            raise ConfigurationError("fault_tolerance='shrink' does not carry a float16 loss scaler's state across a "
                                     "recovery: use bfloat16 (MixedPrecision(param_dtype=ml_dtypes.bfloat16)) or float32")
        self.trainer = trainer
        self.mixed_precision = mixed_precision
        self.template = copy.deepcopy(trainer.model)  # a rebuild's model, before any wrapper touched it
        world = current_world()
        replacing = replacement_facts() if trainer.respawn else None  # spawned to replace a lost rank
        width = world.world_size - trainer.spares if replacing is None else replacing["width"]
        if width < 1:
            raise ConfigurationError(f"spares={trainer.spares} leaves no rank to train on {world.world_size}")
        self.global_batch = batch_size * width
        self.resume_point: Tuple[int, int] = (0, 0)
        self._resume = resume  # loaded by every build of the first world (``start``), on whichever ranks build it
        self._built = False
        plan = resume[0]
        save = os.path.join(plan.checkpoint_dir, WHOLE_STATE) if plan.checkpoint_dir else None
        self.elastic = ElasticTraining(self.build, simulate_failure=trainer.simulate_failure, spares=trainer.spares,
                                       save=save, respawn=trainer.respawn, start=self.start)
        if self.elastic.active and not self.joined:
            self.elastic.done = trainer.global_step  # a resumed run; a spare that took a place was told by the others

    @property
    def active(self) -> bool:
        """Whether this rank trains (False: a spare that never took a place, once the run has ended)."""
        return self.elastic.active

    @property
    def joined(self) -> bool:
        """Whether this rank took a lost rank's place in a running run (a spare or a replacement): it has the
        state the others had, and their step, not the checkpoint's (a build of the first world cut short is not)."""
        return any(not record.fresh for record in self.elastic.recoveries)

    @property
    def recoveries(self) -> List[Recovery]:
        """One ``Recovery`` per recovery so far."""
        return self.elastic.recoveries

    def build(self, world: Any) -> Parts:
        """Collective over ``world``: the strategy over all of it, for ``ElasticTraining`` (see the module note)."""
        t = self.trainer
        if self.global_batch % world.world_size:
            raise ConfigurationError(f"the global batch of {self.global_batch} samples does not split evenly over "
                                     f"{world.world_size} data-parallel ranks")
        if self._built:
            module = copy.deepcopy(self.template)
            optimizer = rebuild_optimizer(t.optimizer, module.parameters())
        else:
            module, optimizer = t.model, t.optimizer
        self._built = True
        setup = build(t.strategy, module, optimizer, t.loss_fn, world.default_group, None, self.mixed_precision,
                      t.options)
        setup.skip_nonfinite = t.skip_nonfinite_steps
        t.setup, t.model, t._mixed_precision = setup, module, self.mixed_precision
        return Parts(setup, t._abandon_save)

    def start(self, world: Any) -> Parts:
        """Collective over ``world``: ``build``, then the checkpoint to resume from loaded (the first world's)."""
        parts = self.build(world)
        self.resume_point = self.trainer._resume_point(*self._resume)
        return parts

    def loader(self, x: Any, y: Any, seed: int) -> DataLoader:
        """This rank's share of every global batch at the current width (see the module note)."""
        dp = self.trainer.setup.dp_group
        sampler = DistributedSampler(len(x), dp.size, dp.rank, shuffle=True, seed=seed, drop_last=True)
        return DataLoader((x, y), self.global_batch // dp.size, sampler=sampler, drop_last=True)

    def steps_per_epoch(self, n: int, grad_accumulation: int) -> int:
        """Optimizer steps in an epoch of ``n`` samples: whole global batches, the same at every width."""
        return n // self.global_batch // grad_accumulation

    def step(self, batches: List[Any]) -> Optional[Tuple[float, int]]:
        """Collective: one step; ``(mean loss, samples)`` of the global batch, or None to redo it after a recovery."""
        t = self.trainer

        def communicating_half(parts: Parts) -> Tuple[float, int]:
            loss, parts.skip = parts.setup.backward_step(batches, t.loss_fn)  # the global batch's mean
            return loss, sum(len(b[1]) for b in batches) * parts.setup.dp_group.size

        return self.elastic.step(communicating_half)

    def call(self, fn: Callable[[], Any], redo: bool) -> Any:
        """Collective: ``fn()`` between steps; after a recovery in it, redone on the survivors if ``redo``, else None."""
        while True:
            seen = len(self.recoveries)
            out = self.elastic.call(lambda parts: fn())
            if len(self.recoveries) == seen or not redo:
                return out

    def fail_point(self, where: str) -> None:
        """Die here if ``simulate_failure`` names this rank, this point and the steps done now."""
        self.elastic.fail_point(where)

    def close(self) -> None:
        """Collective, after the last step: let the spares go."""
        self.elastic.close()


def preemption_after(old: Optional[Preemption], group: Any) -> Preemption:
    """A ``Preemption`` over the rebuilt world's group that keeps ``old``'s request."""
    requested = old is not None and old.requested
    if old is not None:
        old.close()
    new = Preemption(group)
    new.requested = requested
    return new


__all__ = ["Shrinking", "SHRINKABLE", "check_options", "preemption_after"]
