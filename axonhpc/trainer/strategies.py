"""How the trainer wraps a model for each strategy: the wrapper, its optimizer, its data group, its checkpoints.

Every strategy becomes a ``Setup`` with the same small surface, so the
training loop in ``trainer`` has no per-strategy branches:

- ``ddp``: ``DDP(model, group)``; the optimizer as given.
- ``zero1``: ``DDP`` and ``ZeroRedundancyOptimizer`` of the given optimizer's
  class and hyperparameters (or of the callable ``params -> Optimizer`` given
  instead) over the model's parameters.
- ``fsdp``: ``FSDP(model, group, mixed_precision=...)``; the optimizer rebuilt
  (same class and hyperparameters) over the master shards; a ``GradScaler``
  for float16.
- ``tp+dp``: the model already holds tensor-parallel layers over
  ``mesh["tp"]``; ``DDP`` over ``mesh["dp"]``; the data is split over dp.
- ``pipeline``: the model (rank 0's values) is a ``Sequential`` cut into one
  contiguous stage per rank of the group (as equal in layer count as possible); ``Pipeline``
  runs ``num_microbatches`` micro-batches per step, every rank sees the whole
  batch, and the loss lives on the last stage.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, List, Optional

import numpy as np

from ..checkpoint import load_per_rank, load_sharded, save_per_rank, save_sharded
from ..checkpoint.background import AsyncCheckpointer
from ..backends import ReduceOp
from ..collectives import all_reduce, broadcast
from ..errors import ConfigurationError
from ..log import get_logger
from ..optim.optimizer import Optimizer
from ..parallel import DDP, FSDP, GradScaler, MixedPrecision, Pipeline, ZeroRedundancyOptimizer

STRATEGIES = ("ddp", "fsdp", "zero1", "pipeline", "tp+dp")


def check_rebuildable(optimizer: Any) -> None:
    """ConfigurationError unless ``type(optimizer)(params, **optimizer.hyperparameters())`` can be called.

    A strategy that rebuilds the optimizer over other parameters (FSDP's
    shards, ZeRO-1's slices, a pipeline stage's) calls the class with every
    hyperparameter the instance reports. A subclass whose constructor takes
    fewer (``def __init__(self, params, lr)`` over ``optim.SGD``, which reports
    ``momentum`` and the rest too) would fail there with a bare TypeError,
    after the wrapper has already communicated; this check runs first, on
    every rank alike (the same code and optimizer on each), before any message.
    A callable ``params -> Optimizer`` passes.

    Raises:
        ConfigurationError: naming the class, the hyperparameters it does not
            take (or the ones it needs and is not given) and the fix.
    """
    if not isinstance(optimizer, Optimizer):
        return
    cls = type(optimizer)
    hyper = optimizer.hyperparameters()
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to check (a C-implemented class): the call will tell
        return
    try:
        signature.bind(None, **hyper)
    except TypeError as exc:
        taken = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values())
        unknown = [] if takes_any else [name for name in hyper if name not in taken]
        needed = [name for name, p in list(taken.items())[1:] if p.default is inspect.Parameter.empty
                  and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                  and name not in hyper]
        what = []
        if unknown:
            what.append(f"does not take {', '.join(f'{n}={hyper[n]!r}' for n in unknown)}")
        if needed:
            what.append(f"needs {', '.join(needed)}, which hyperparameters() does not report")
        shown = ", ".join(f"{k}={v!r}" for k, v in hyper.items() if k not in unknown)
        raise ConfigurationError(
            f"the strategy rebuilds the optimizer over its own parameters as {cls.__name__}(params, "
            f"**optimizer.hyperparameters()), but {cls.__name__}{signature} "
            f"{' and '.join(what) or f'cannot be called so ({exc})'}; pass a callable instead, e.g. "
            f"optimizer=lambda params: {cls.__name__}(params, {shown})") from None


def rebuild_optimizer(optimizer: Any, params: List[Any]) -> Any:
    """An optimizer of the same class and hyperparameters as ``optimizer`` over ``params``.

    ``optimizer`` may also be a callable ``params -> Optimizer``.

    Raises:
        ConfigurationError: neither an Optimizer nor a callable, or a class that
            cannot be rebuilt from its hyperparameters (``check_rebuildable``).
    """
    if isinstance(optimizer, Optimizer):
        check_rebuildable(optimizer)
        return type(optimizer)(params, **optimizer.hyperparameters())
    if callable(optimizer):
        return optimizer(params)
    raise ConfigurationError(f"optimizer must be an axonhpc.optim.Optimizer or a callable params -> Optimizer, "
                             f"got {type(optimizer).__name__}")


class Setup:
    """One strategy's wrapped model and what the loop needs of it (see the module note)."""

    def __init__(self, strategy: str, module: Any, wrapper: Any, optimizer: Any, group: Any, dp_group: Any,
                 scaler: Optional[GradScaler] = None, pipeline: Optional[Pipeline] = None):
        self.strategy = strategy
        self.module = module
        self.wrapper = wrapper
        self.optimizer = optimizer
        self.group = group
        self.dp_group = dp_group
        self.scaler = scaler
        self.pipeline = pipeline
        self.skip_nonfinite = False  # set by the trainer (settings.skip_nonfinite_steps)
        self.skipped_steps = 0

    @property
    def output_rank(self) -> int:
        """Group rank that holds the model's output (the last pipeline stage; 0 otherwise)."""
        return self.group.size - 1 if self.pipeline is not None else 0

    def no_sync(self, skip: bool) -> Any:
        """The wrapper's ``no_sync()`` when ``skip``, else a context that does nothing."""
        if skip and hasattr(self.wrapper, "no_sync"):
            return self.wrapper.no_sync()
        return contextlib.nullcontext()

    def train_step(self, batches: List[Any], loss_fn: Any) -> float:
        """Forward and backward over the accumulated micro-batches, then the optimizer step.

        Returns:
            The mean loss over this rank's samples of the step (pipeline: on the
            last stage, NaN elsewhere).
        """
        opt = self.optimizer
        opt.zero_grad()
        if self.pipeline is not None:
            (xb, yb), = batches
            loss = self.pipeline.train_step(xb, yb)
            opt.step()
            return float("nan") if loss is None else float(loss)
        total, count = 0.0, 0
        for k, (xb, yb) in enumerate(batches):
            with self.no_sync(k < len(batches) - 1):
                loss = loss_fn(self.wrapper(xb), yb)
                grad = loss_fn.backward() / len(batches)
                self.wrapper.backward(self.scaler.scale(grad) if self.scaler is not None else grad)
            total += float(loss) * len(yb)
            count += len(yb)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        elif not (self.skip_nonfinite and self._skip_for_nonfinite()):
            opt.step()
        return total / max(count, 1)

    def _gradient_holders(self) -> List[Any]:
        """``(name, Parameter)`` whose gradients the optimizer steps on (shards for FSDP)."""
        if self.strategy == "fsdp":
            return list(self.wrapper.named_parameters())
        return [(n, p) for m in self.modules() for n, p in m.named_parameters()]

    def _skip_for_nonfinite(self) -> bool:
        """Collective: True on every rank if any rank has an inf or NaN gradient; the finders say which."""
        bad = [name for name, p in self._gradient_holders()
               if p.grad is not None and p.grad.size and not bool(np.isfinite(p.grad).all())]
        flag = np.array([1.0 if bad else 0.0])
        all_reduce(flag, ReduceOp.MAX, self.group)
        if flag[0]:
            self.skipped_steps += 1
            where = f"non-finite gradients in {bad} on this rank" if bad else "non-finite gradients on another rank"
            get_logger("trainer").warning(f"optimizer step skipped on every rank: {where}")
        return bool(flag[0])

    def predict(self, x: Any) -> Any:
        """The model's output for ``x`` (pipeline: on the last stage, None elsewhere)."""
        if self.pipeline is not None:
            return self.pipeline.forward(x)
        return self.wrapper(x)

    def modules(self) -> List[Any]:
        """The modules whose state this rank holds (its stages, for a pipeline)."""
        if self.pipeline is not None:
            return [self.pipeline.stage_modules[i] for i in self.pipeline.stages]
        return [self.module]

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str, extra: dict, rank_state: dict, writer: Optional[AsyncCheckpointer] = None) -> None:
        """Collective: write a checkpoint directory of this strategy's state.

        Args:
            path: the checkpoint directory.
            extra: where the run was (shared: rank 0's goes into the index).
            rank_state: this rank's own extra state (its Dropout generators).
            writer: an ``AsyncCheckpointer`` over ``self.group`` to start the
                save in the background with (the same directory), or None to
                write it now.
        """
        if self.strategy == "fsdp":
            full_extra = {**extra, "rank0": rank_state}
            if writer is not None:
                writer.save_sharded(path, self.wrapper, self.optimizer, extra=full_extra)
            else:
                save_sharded(path, self.wrapper, self.optimizer, extra=full_extra)
            return
        state = {"modules": [m.state_dict() for m in self.modules()], "optimizer": self.optimizer.state_dict(),
                 "rank": rank_state}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if writer is not None:  # state_dict()s are copies already: the background save needs no second one
            writer.save_per_rank(path, state, extra, copy=False)
        else:
            save_per_rank(path, state, self.group, extra)

    def load(self, path: str) -> tuple:
        """Collective: restore from ``save``; returns ``(extra, rank_state)``."""
        if self.strategy == "fsdp":
            extra = load_sharded(path, self.wrapper, self.optimizer)
            return extra, extra.pop("rank0")
        state, extra = load_per_rank(path, self.group)
        for module, saved in zip(self.modules(), state["modules"]):
            module.load_state_dict(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        return extra, state["rank"]


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
    """Collective: wrap ``model`` for ``strategy`` (see the module note).

    Raises:
        ConfigurationError: an option the strategy cannot take.
    """
    if mixed_precision is not None and strategy != "fsdp":
        raise ConfigurationError(f"mixed_precision needs strategy='fsdp' (strategy is {strategy!r})")
    if strategy == "zero1" and not (isinstance(optimizer, Optimizer) or callable(optimizer)):
        raise ConfigurationError("strategy='zero1' needs an Optimizer instance (its class and hyperparameters are "
                                 "used for the shards) or a callable params -> Optimizer, got "
                                 f"{type(optimizer).__name__}")
    if strategy in ("fsdp", "zero1", "pipeline"):
        check_rebuildable(optimizer)  # before the wrapper sends anything
    if strategy == "ddp":
        wrapper = DDP(model, group=group, **options)
        return Setup(strategy, model, wrapper, optimizer, wrapper.group, wrapper.group)
    if strategy == "zero1":
        wrapper = DDP(model, group=group, **options)
        if isinstance(optimizer, Optimizer):
            zero = ZeroRedundancyOptimizer(type(optimizer), wrapper.parameters(), group=wrapper.group,
                                           **optimizer.hyperparameters())
        else:  # a callable params -> Optimizer, called over the shards
            zero = ZeroRedundancyOptimizer(optimizer, wrapper.parameters(), group=wrapper.group)
        return Setup(strategy, model, wrapper, zero, wrapper.group, wrapper.group)
    if strategy == "fsdp":
        wrapper = FSDP(model, group=group, mixed_precision=mixed_precision, **options)
        scaler = None
        if mixed_precision is not None and mixed_precision.param_dtype == np.float16:
            scaler = GradScaler(group=wrapper.group)
        return Setup(strategy, model, wrapper, rebuild_optimizer(optimizer, wrapper.parameters()), wrapper.group,
                     wrapper.group, scaler)
    if strategy == "tp+dp":
        if mesh is None:
            raise ConfigurationError("strategy='tp+dp' needs mesh=world.mesh(dp=..., tp=...), the mesh the "
                                     "model's tensor-parallel layers were built on")
        wrapper = DDP(model, group=mesh["dp"], **options)
        return Setup(strategy, model, wrapper, optimizer, mesh["dp"].world.default_group if group is None else group,
                     mesh["dp"])
    # pipeline
    from ..groups import resolve_group
    from ..parallel.replicate import broadcast_arrays

    pg = resolve_group(group)
    # Like DDP and FSDP: every stage starts from rank 0's values (each rank built the whole model).
    broadcast_arrays([p.data for p in model.parameters()] + model.buffers(), pg)
    pipe = Pipeline.from_modules(split_stages(model, pg.size), group=pg, loss_fn=loss_fn, **options)
    params = pipe.parameters()  # a stage of parameter-free layers (an activation) has none to optimize
    return Setup(strategy, model, pipe, rebuild_optimizer(optimizer, params) if params else _Nothing(), pg, None,
                 pipeline=pipe)


class _Nothing:
    """The optimizer of a pipeline stage without parameters: every call does nothing."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing to reset."""

    def step(self) -> None:
        """Nothing to update."""

    def state_dict(self) -> dict:
        """No state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def share_from(setup: Setup, value: np.ndarray) -> np.ndarray:
    """``value`` of the output rank on every rank of the group (a pipeline's metrics)."""
    broadcast(value, setup.output_rank, setup.group)
    return value


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


def steps_per_epoch(loader: Any, accumulate: int) -> int:
    """Optimizer steps in one epoch (a trailing incomplete group of batches is dropped)."""
    return len(loader) // accumulate


__all__ = ["STRATEGIES", "Setup", "build", "rebuild_optimizer", "check_rebuildable", "split_stages", "share_from",
           "batches_of", "steps_per_epoch"]
