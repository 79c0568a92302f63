"""How the trainer wraps a model for each strategy: one ``Setup`` subclass per strategy.

Every ``Setup`` has the same small surface (train a step, predict, the
modules this rank holds, save and load, how the data is split and metrics
summed), so the loop in ``trainer`` has no per-strategy branches.
``SETUPS`` maps each strategy's name to its class; ``build`` checks the
arguments alike on every rank, before anything is sent.

[Note: pipeline stages]
``pipeline`` cuts rank 0's ``Sequential`` into one contiguous stage per rank
(equal layer counts as far as possible); every rank sees the whole batch and
the loss lives on the last stage.

[Note: a partial batch]
A ``Pipeline`` splits a batch into ``num_microbatches`` M equal micro-batches,
but an epoch's last batch (or an evaluation set) need not be a multiple of M.
Such a batch of n rows runs in the largest micro-batch count that divides n
(at most M; 1 for a prime n), on a second ``Pipeline`` over the same stage
modules, built once per count. Its micro-batches are equal, so the gradient
is still that of the mean loss over the batch's samples, and the output the
same rows in order: nothing is dropped, padded or refused.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import numpy as np

from .._dtypes import array_module, finite_flags, is_cupy_array, is_low_precision_float
from ..cuda import capture
from ..checkpoint import (capture_rng_state, load_per_rank, load_sharded, restore_rng_state, save_per_rank,
                          save_sharded)
from ..checkpoint.background import AsyncCheckpointer
from ..checkpoint.io import failed_on, gather_text
from ..checkpoint.rng import rng_state_from_text, rng_state_text
from ..backends import ReduceOp
from ..collectives import all_reduce, broadcast
from ..data import DistributedSampler
from ..errors import AxonError, CheckpointError, ConfigurationError
from ..collectives.refusal import batch_refused
from ..groups.agreement import agree, all_or_none
from ..observe.log import get_logger
from ..nn import autocast, call_backward
from ..optim.optimizer import Optimizer
from ..parallel import DDP, FSDP, GradScaler, MixedPrecision, Pipeline, ZeroRedundancyOptimizer
from .optimizers import NoOptimizer, check_rebuildable, rebuild_optimizer


def loss_scaler(mixed_precision: Optional[MixedPrecision], group: Any) -> Optional[GradScaler]:
    """A ``GradScaler`` over ``group`` for float16 parameters; None otherwise (bfloat16 keeps float32's range)."""
    if mixed_precision is not None and mixed_precision.param_dtype == np.float16:
        return GradScaler(group=group)
    return None


class Setup:
    """A strategy's wrapped model and what the loop needs of it; the base class is plain data parallelism."""

    name = ""  # the strategy's name, as DistributedTrainer takes it
    takes_mixed_precision = False  # accepts fit(mixed_precision=...)
    autocasts = False  # takes it as nn.autocast(param_dtype) around the forward (the model's own layers)
    rebuilds_optimizer = False  # builds its own optimizer of the given one's class (check_rebuildable first)

    def __init__(self, module: Any, wrapper: Any, optimizer: Any, group: Any, dp_group: Any,
                 scaler: Optional[GradScaler] = None):
        self.module = module
        self.wrapper = wrapper
        self.optimizer = optimizer
        self.group = group
        self.dp_group = dp_group
        self.scaler = scaler
        self.skip_nonfinite = False  # set by the trainer (settings.skip_nonfinite_steps)
        self.skipped_steps = 0
        self.compute_dtype: Any = None  # the autocast dtype of every forward, for autocasting setups

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def check(cls, optimizer: Any, mixed_precision: Optional[MixedPrecision]) -> None:
        """Refuse what this strategy cannot take; local, the same on every rank, before anything is sent.

        Raises:
            ConfigurationError: naming the option and the strategy.
        """
        if mixed_precision is not None and not cls.takes_mixed_precision:
            raise ConfigurationError(f"mixed_precision needs strategy 'fsdp', 'ddp' or 'zero1' (strategy is "
                                     f"{cls.name!r})")
        if mixed_precision is not None and cls.autocasts:
            mp = mixed_precision
            if mp.param_dtype is None or not is_low_precision_float(mp.param_dtype):
                raise ConfigurationError(f"strategy={cls.name!r} runs mixed precision as nn.autocast(param_dtype): "
                                         f"param_dtype must be float16 or bfloat16, got {mp.param_dtype}")
            if mp.reduce_dtype is not None or mp.buffer_dtype is not None:
                raise ConfigurationError(
                    f"strategy={cls.name!r} reduces the master gradients in their own dtype and leaves buffers "
                    f"alone: reduce_dtype and buffer_dtype are for strategy='fsdp' (got {mp})")
        if cls.rebuilds_optimizer:
            check_rebuildable(optimizer)

    @classmethod
    def check_fit(cls, grad_accumulation: int) -> None:
        """Refuse ``fit`` arguments this strategy cannot take (local, before anything is sent)."""

    def autocasting(self, mixed_precision: Optional[MixedPrecision]) -> "Setup":
        """Run every forward under ``nn.autocast(mixed_precision.param_dtype)`` (a ``GradScaler`` for float16); returns self."""
        if mixed_precision is not None:
            self.compute_dtype = mixed_precision.param_dtype
            self.scaler = loss_scaler(mixed_precision, self.group)
        return self

    # Each subclass has ``build(model, optimizer, loss_fn, group, mesh, mixed_precision, options)``: collective,
    # it wraps the model and returns the Setup.

    # -- a step ----------------------------------------------------------------------------------
    @property
    def output_rank(self) -> int:
        """Group rank that holds the model's output."""
        return 0

    def no_sync(self, skip: bool) -> Any:
        """The wrapper's ``no_sync()`` when ``skip``, else a context that does nothing."""
        if skip and hasattr(self.wrapper, "no_sync"):
            return self.wrapper.no_sync()
        return contextlib.nullcontext()

    def train_step(self, batches: List[Any], loss_fn: Any) -> float:
        """Collective: forward and backward over the accumulated micro-batches, then the optimizer step.

        Returns:
            The step's mean loss over the samples of every rank (the same on every rank).
        """
        loss, skip = self.backward_step(batches, loss_fn)
        self.update(skip)
        return loss

    def backward_step(self, batches: List[Any], loss_fn: Any) -> Tuple[float, bool]:
        """Collective: the step's communicating half, forward and backward; ``(mean loss of every rank's samples,
        skip the update)``. The gradient is that of the same mean: each batch's loss weighs by its samples.

        Raises:
            AxonError: the loss refused this rank's batch (a target out of range, a shape), on this rank, and
                ``CollectiveRefusedError`` naming it on the others, before any optimizer step.
        """
        self.optimizer.zero_grad()
        losses, read = [], []
        problem: Optional[AxonError] = None
        body_done = False
        # Each micro-batch's mean loss weighs by its share of the step's samples, so a partial last batch
        # counts per sample, like the reported loss; equal batches divide by their count exactly as before.
        step_samples = sum(len(yb) for _, yb in batches)
        try:
            with capture.defer_reads():  # device losses are read once every backward is queued ([Note: deferred reads])
                for k, (xb, yb) in enumerate(batches):
                    with self.no_sync(k < len(batches) - 1):
                        with self.compute():
                            out = self.wrapper(xb)
                            try:
                                loss = loss_fn(out, yb)
                            except AxonError as exc:  # [Note: a batch refused on one rank]
                                problem, loss = problem or exc, None
                        parts = step_samples / len(yb)  # len(batches) when the batches are equal
                        if loss is None:
                            grad = array_module(out).zeros_like(out)
                        elif self.scaler is None:
                            grad = loss_fn.backward() / parts
                        else:  # scaled in the loss's float32, before the gradient is rounded to float16
                            grad = loss_fn.backward(self.scaler.scale(1.0) / parts)
                        call_backward(self.wrapper.backward, grad, input_grad=False)  # the input is data
                    losses.append((loss, len(yb)))
                if problem is None and any(is_cupy_array(loss) for loss, _ in losses):
                    # the losses' sum read in the same read as the targets' checks
                    capture.defer_check(sum(loss * n for loss, n in losses).reshape(1),
                                        lambda v: read.append(float(v[0])))
                body_done = True
        except AxonError as exc:
            if not body_done:
                raise  # not the loss's: the forward's or the backward's own error
            problem = problem or exc  # a deferred check of a device batch's targets, read as the block ended
        total = 0.0 if problem is not None else read[0] if read else sum(float(loss) * n for loss, n in losses)
        mean = self._step_mean(total, sum(n for _, n in losses), problem)
        skip = self.scaler is None and self.skip_nonfinite and self._skip_for_nonfinite()
        return mean, skip

    def _step_mean(self, total: float, count: int, problem: Optional[AxonError]) -> float:
        """Collective: the step's mean loss over the samples of every rank, from one all-reduce that also carries
        the vote on a refused batch ([Note: a batch refused on one rank]); raises on every rank after a refusal.

        Over the whole group: tensor-parallel peers add the same loss and count, which leaves the mean as it is.
        """
        values = np.array([total, count, 0.0 if problem is None else 1.0])
        if self.group.size > 1:
            all_reduce(values, ReduceOp.SUM, self.group)
        if values[2]:
            agree(self.group, problem, batch_refused(self.group, "the training step"))
        return float(values[0] / values[1]) if values[1] else float("nan")

    def update(self, skip: bool = False) -> None:
        """The optimizer step (through the loss scaler, which may skip it), unless ``skip``."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not skip:
            self.optimizer.step()

    def _gradient_holders(self) -> List[Any]:
        """``(name, Parameter)`` whose gradients the optimizer steps on."""
        return [(n, p) for m in self.modules() for n, p in m.named_parameters()]

    def _skip_for_nonfinite(self) -> bool:
        """Collective: True on every rank if any rank has an inf or NaN gradient; the finders say which."""
        holders = [(name, p) for name, p in self._gradient_holders() if p.grad is not None]
        bad = [name for (name, _), finite in zip(holders, finite_flags([p.grad for _, p in holders])) if not finite]
        flag = np.array([1.0 if bad else 0.0])
        all_reduce(flag, ReduceOp.MAX, self.group)
        if flag[0]:
            self.skipped_steps += 1
            where = f"non-finite gradients in {bad} on this rank" if bad else "non-finite gradients on another rank"
            get_logger("trainer").warning(f"optimizer step skipped on every rank: {where}")
        return bool(flag[0])

    def compute(self) -> Any:
        """``nn.autocast(compute_dtype)`` for an autocasting setup with mixed precision, else a context doing nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return autocast(self.compute_dtype)

    def predict(self, x: Any) -> Any:
        """The model's output for ``x`` (computed as in training: under autocast with mixed precision)."""
        with self.compute():
            return self.wrapper(x)

    def modules(self) -> List[Any]:
        """The modules whose state this rank holds."""
        return [self.module]

    def rng_states(self) -> Dict[str, Any]:
        """The random generators of this rank's modules (Dropout's), by module name, for a checkpoint."""
        states = {}
        for module in self.modules():
            for name, m in module.named_modules():
                rng = m.__dict__.get("_rng")
                if isinstance(rng, np.random.Generator):
                    states[name or "<root>"] = capture_rng_state(rng)
        return states

    def restore_rng_states(self, states: Dict[str, Any]) -> None:
        """Put back the generators ``rng_states`` returned, by module name."""
        for module in self.modules():
            for name, m in module.named_modules():
                key = name or "<root>"
                if key in states and isinstance(m.__dict__.get("_rng"), np.random.Generator):
                    object.__setattr__(m, "_rng", restore_rng_state(states[key]))

    # -- data and metrics ------------------------------------------------------------------------
    def sampler(self, n: int, seed: int) -> DistributedSampler:
        """This rank's share of ``n`` training samples: a shuffled, equal part per data-parallel rank."""
        return DistributedSampler(n, self.dp_group.size, self.dp_group.rank, shuffle=True, seed=seed,
                                  drop_last=True)

    def eval_rows(self, n: int) -> np.ndarray:
        """The rows of an ``n``-row evaluation set this rank scores: ``r, r + D, ...`` (every row once)."""
        return np.arange(self.dp_group.rank, n, self.dp_group.size)

    def forward_needs_every_rank(self) -> bool:
        """True when every rank must take part in each forward, even with no rows of its own."""
        return False

    def sum_metrics(self, values: np.ndarray) -> np.ndarray:
        """Collective: ``values`` (sums and counts) summed over the data-parallel ranks, in place."""
        if self.dp_group.size > 1:
            all_reduce(values, ReduceOp.SUM, self.dp_group)
        return values

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str, extra: dict, rank_state: dict, writer: Optional[AsyncCheckpointer] = None) -> None:
        """Collective: write a checkpoint directory of this strategy's state.

        Args:
            extra: where the run was (rank 0's goes into the index).
            rank_state: this rank's own extra state (its Dropout generators).
            writer: an ``AsyncCheckpointer`` over ``self.group`` to save in the
                background with, or None to write now.
        """
        state = {"modules": [m.state_dict() for m in self.modules()], "optimizer": self.optimizer.state_dict(),
                 "rank": rank_state}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if writer is not None:  # state_dict()s are copies already: the background save needs no second one
            writer.save_per_rank(path, state, extra, copy=False)
        else:
            save_per_rank(path, state, self.group, extra)

    def load(self, path: str) -> tuple:
        """Collective: restore from ``save``; returns ``(extra, rank_state)``.

        Every rank checks its state against its modules and optimizer first; if any rank's does not fit, every
        rank raises and none has changed anything.
        """
        state, extra = load_per_rank(path, self.group)
        modules = self.modules()
        with all_or_none(self.group, failed_on(f"restoring checkpoint {path!r}", ", so no rank changed anything")):
            saved_modules = state.get("modules") if isinstance(state, dict) else None
            if not isinstance(saved_modules, list) or len(saved_modules) != len(modules):
                raise CheckpointError(f"{path!r} holds {type(saved_modules).__name__} module states on this rank, "
                                      f"not a list of {len(modules)} (this strategy's modules here)")
            for module, saved in zip(modules, saved_modules):
                module.check_state_dict(saved)
            check = getattr(self.optimizer, "check_state_dict", None)
            if check is not None:
                check(state.get("optimizer"))
        for module, saved in zip(modules, saved_modules):
            module.load_state_dict(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        return extra, state["rank"]


class DDPSetup(Setup):
    """``ddp``: the model in ``DDP`` over the group; the optimizer as given."""

    name = "ddp"
    takes_mixed_precision = True
    autocasts = True

    @classmethod
    def build(cls, model: Any, optimizer: Any, loss_fn: Any, group: Any, mesh: Any,
              mixed_precision: Optional[MixedPrecision], options: dict) -> Setup:
        """Collective: ``DDP(model, group)``."""
        wrapper = DDP(model, group=group, **options)
        return cls(model, wrapper, optimizer, wrapper.group, wrapper.group).autocasting(mixed_precision)


class Zero1Setup(Setup):
    """``zero1``: ``DDP``, and the optimizer's state sharded over the group (``ZeroRedundancyOptimizer``)."""

    name = "zero1"
    rebuilds_optimizer = True
    takes_mixed_precision = True
    autocasts = True

    @classmethod
    def check(cls, optimizer: Any, mixed_precision: Optional[MixedPrecision]) -> None:
        """Also refuse an optimizer that is neither an Optimizer nor a callable ``params -> Optimizer``."""
        if not (isinstance(optimizer, Optimizer) or callable(optimizer)):
            raise ConfigurationError("strategy='zero1' needs an Optimizer instance (its class and hyperparameters "
                                     "are used for the shards) or a callable params -> Optimizer, got "
                                     f"{type(optimizer).__name__}")
        super().check(optimizer, mixed_precision)

    @classmethod
    def build(cls, model: Any, optimizer: Any, loss_fn: Any, group: Any, mesh: Any,
              mixed_precision: Optional[MixedPrecision], options: dict) -> Setup:
        """Collective: ``DDP`` and a ``ZeroRedundancyOptimizer`` of the optimizer's class over its parameters."""
        wrapper = DDP(model, group=group, **options)
        if isinstance(optimizer, Optimizer):
            zero = ZeroRedundancyOptimizer(type(optimizer), wrapper.parameters(), group=wrapper.group,
                                           **optimizer.hyperparameters())
        else:  # a callable params -> Optimizer, called over the shards
            zero = ZeroRedundancyOptimizer(optimizer, wrapper.parameters(), group=wrapper.group)
        return cls(model, wrapper, zero, wrapper.group, wrapper.group).autocasting(mixed_precision)


class FSDPSetup(Setup):
    """``fsdp``: the model in ``FSDP``; the optimizer over the master shards; sharded checkpoints."""

    name = "fsdp"
    takes_mixed_precision = True
    rebuilds_optimizer = True

    @classmethod
    def build(cls, model: Any, optimizer: Any, loss_fn: Any, group: Any, mesh: Any,
              mixed_precision: Optional[MixedPrecision], options: dict) -> Setup:
        """Collective: ``FSDP(model, group, mixed_precision=...)``; a ``GradScaler`` for float16 parameters."""
        wrapper = FSDP(model, group=group, mixed_precision=mixed_precision, **options)
        return cls(model, wrapper, rebuild_optimizer(optimizer, wrapper.parameters()), wrapper.group,
                   wrapper.group, loss_scaler(mixed_precision, wrapper.group))

    def _gradient_holders(self) -> List[Any]:
        """The shards' ``(name, Parameter)``: the optimizer steps on those."""
        return list(self.wrapper.named_parameters())

    def save(self, path: str, extra: dict, rank_state: dict, writer: Optional[AsyncCheckpointer] = None) -> None:
        """Collective: a sharded checkpoint (loadable on another world size). Its extra holds every rank's own
        state (as ``rng_state_text``, by group rank) and the loss scaler's, which the shards do not."""
        full_extra = {**extra, "ranks": gather_text(rng_state_text(rank_state), self.group)}
        if self.scaler is not None:
            full_extra["scaler"] = self.scaler.state_dict()
        if writer is not None:
            writer.save_sharded(path, self.wrapper, self.optimizer, extra=full_extra)
        else:
            save_sharded(path, self.wrapper, self.optimizer, extra=full_extra)

    def load(self, path: str) -> tuple:
        """Collective: restore from ``save``; returns ``(extra, rank_state)``.

        A rank the saving run did not have (resumed on more ranks) keeps its own generators. A checkpoint
        written before every rank's state was kept gives each rank group rank 0's.
        """
        extra = load_sharded(path, self.wrapper, self.optimizer)
        scaler = extra.pop("scaler", None)
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        ranks = extra.pop("ranks", None)
        if ranks is None:
            return extra, extra.pop("rank0", {})
        mine = self.group.rank
        return extra, rng_state_from_text(ranks[mine]) if mine < len(ranks) else {}


class TensorDataSetup(Setup):
    """``tp+dp``: a model of tensor-parallel layers over ``mesh["tp"]``, in ``DDP`` over ``mesh["dp"]``."""

    name = "tp+dp"

    @classmethod
    def build(cls, model: Any, optimizer: Any, loss_fn: Any, group: Any, mesh: Any,
              mixed_precision: Optional[MixedPrecision], options: dict) -> Setup:
        """Collective: ``DDP(model, mesh["dp"])``.

        Raises:
            ConfigurationError: no mesh was given.
        """
        if mesh is None:
            raise ConfigurationError("strategy='tp+dp' needs mesh=world.mesh(dp=..., tp=...), the mesh the "
                                     "model's tensor-parallel layers were built on")
        wrapper = DDP(model, group=mesh["dp"], **options)
        return cls(model, wrapper, optimizer, mesh["dp"].world.default_group if group is None else group, mesh["dp"])


class PipelineSetup(Setup):
    """``pipeline``: one stage per rank; every rank sees every sample; the output is on the last stage."""

    name = "pipeline"
    rebuilds_optimizer = True

    def __init__(self, module: Any, pipeline: Pipeline, optimizer: Any, group: Any, options: Optional[dict] = None):
        super().__init__(module, pipeline, optimizer, group, None)
        self.pipeline = pipeline
        self._options = dict(options or {})  # Pipeline's, to build one for a partial batch
        self._partial: Dict[int, Pipeline] = {}  # micro-batch count -> the pipeline for batches that take it

    @classmethod
    def check_fit(cls, grad_accumulation: int) -> None:
        """Refuse ``grad_accumulation``: a pipeline accumulates over its micro-batches."""
        if grad_accumulation != 1:
            raise ConfigurationError("strategy='pipeline' accumulates over its micro-batches; use "
                                     "num_microbatches instead of grad_accumulation")

    @classmethod
    def build(cls, model: Any, optimizer: Any, loss_fn: Any, group: Any, mesh: Any,
              mixed_precision: Optional[MixedPrecision], options: dict) -> Setup:
        """Collective: rank 0's values everywhere, the model cut into stages, a ``Pipeline`` over the group."""
        from ..groups import resolve_group
        from ..parallel.replicate import broadcast_arrays

        pg = resolve_group(group)
        # Like DDP and FSDP: every stage starts from rank 0's values (each rank built the whole model).
        broadcast_arrays([p.data for p in model.parameters()] + model.buffers(), pg)
        pipe = Pipeline.from_modules(split_stages(model, pg.size), group=pg, loss_fn=loss_fn, **options)
        params = pipe.parameters()  # a stage of parameter-free layers (an activation) has none to optimize
        return cls(model, pipe, rebuild_optimizer(optimizer, params) if params else NoOptimizer(), pg, options)

    @property
    def output_rank(self) -> int:
        """The last stage holds the model's output."""
        return self.group.size - 1

    def train_step(self, batches: List[Any], loss_fn: Any) -> float:
        """One pipelined step over the batch's micro-batches, then the optimizer step.

        Returns:
            The mean loss, which the last stage computed, on every rank.
        """
        self.optimizer.zero_grad()
        (xb, yb), = batches
        loss = self.pipeline_for(len(xb)).train_step(xb, yb)
        self.optimizer.step()
        return float(self.sum_metrics(np.array([float("nan") if loss is None else float(loss)]))[0])

    def pipeline_for(self, n: int) -> Pipeline:
        """Collective the first time for each count: the pipeline for a batch of ``n`` rows ([Note: a partial batch]).

        The trainer's own pipeline when ``num_microbatches`` M divides ``n``; else one over the same stages with
        the largest micro-batch count below M that divides ``n`` (built once per count). Every rank sees the
        same batch, so every rank picks the same one.
        """
        m = self.pipeline.num_microbatches
        if n < 1 or n % m == 0:
            return self.pipeline  # (an empty batch: the pipeline's own error)
        count = max(k for k in range(1, min(m, n) + 1) if n % k == 0)
        if count not in self._partial:
            options = {**self._options, "num_microbatches": count}
            self._partial[count] = Pipeline.from_modules(self.pipeline.stage_modules, group=self.group,
                                                         loss_fn=self.pipeline.loss_fn, **options)
        return self._partial[count]

    def predict(self, x: Any) -> Any:
        """Collective: the output on the last stage, None elsewhere."""
        return self.pipeline_for(len(x)).forward(x)

    def modules(self) -> List[Any]:
        """This rank's stages."""
        return [self.pipeline.stage_modules[i] for i in self.pipeline.stages]

    def sampler(self, n: int, seed: int) -> DistributedSampler:
        """Every sample, shuffled: each rank of a pipeline sees the whole batch."""
        return DistributedSampler(n, 1, 0, shuffle=True, seed=seed)

    def eval_rows(self, n: int) -> np.ndarray:
        """Every row: each stage takes part in every forward."""
        return np.arange(n)

    def forward_needs_every_rank(self) -> bool:
        """True: a forward passes through every stage."""
        return True

    def sum_metrics(self, values: np.ndarray) -> np.ndarray:
        """Collective: the last stage's ``values`` on every rank (it alone computed the loss)."""
        broadcast(values, self.output_rank, self.group)
        return values


SETUPS: Dict[str, Type[Setup]] = {cls.name: cls for cls in (DDPSetup, FSDPSetup, Zero1Setup, PipelineSetup,
                                                            TensorDataSetup)}
STRATEGIES = tuple(SETUPS)


def split_stages(model: Any, n: int) -> List[Any]:
    """Cut a Sequential into ``n`` contiguous Sequentials of as equal a layer count as possible.

    Raises:
        ConfigurationError: not a Sequential, or fewer layers than stages.
    """
    from ..nn import Sequential

    if not isinstance(model, Sequential):
        raise ConfigurationError(f"strategy='pipeline' needs an nn.Sequential to cut into stages, got "
                                 f"{type(model).__name__}")
    layers = list(model)
    if len(layers) < n:
        raise ConfigurationError(f"strategy='pipeline' on {n} ranks needs at least {n} layers; the model has "
                                 f"{len(layers)}")
    bounds = np.linspace(0, len(layers), n + 1).round().astype(int)
    return [Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def build(strategy: str, model: Any, optimizer: Any, loss_fn: Any, group: Any, mesh: Any,
          mixed_precision: Optional[MixedPrecision], options: dict) -> Setup:
    """Collective: wrap ``model`` for ``strategy`` (see the module note), its arguments checked first.

    Raises:
        ConfigurationError: an option the strategy cannot take.
    """
    cls = SETUPS[strategy]
    cls.check(optimizer, mixed_precision)
    return cls.build(model, optimizer, loss_fn, group, mesh, mixed_precision, options)


def batches_of(loader: Any, accumulate: int, skip: int) -> Iterator[List[Any]]:
    """Groups of ``accumulate`` loader batches (an optimizer step each), the first ``skip`` groups left out."""
    group: List[Any] = []
    done = 0
    for batch in loader:
        group.append(batch)
        if len(group) == accumulate:
            if done >= skip:
                yield group
            done += 1
            group = []


__all__ = ["STRATEGIES", "SETUPS", "Setup", "DDPSetup", "Zero1Setup", "FSDPSetup", "TensorDataSetup", "PipelineSetup",
           "build", "rebuild_optimizer", "check_rebuildable", "split_stages", "batches_of"]
