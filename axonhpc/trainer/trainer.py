"""DistributedTrainer: the training loop, with data, metrics, checkpoints, resume and preemption.

[Note: checkpoints in the background]
With ``async_checkpoints=True`` a checkpoint step only copies this rank's
state; a writer thread writes the files. The save is finished in the calling
thread, where collectives belong: ``poll`` after every step (one small
all-reduce while a save is in flight), and the next checkpoint, the
preemption checkpoint and the end of ``fit`` wait for it. Only a finished
save is renamed to ``ckpt-<step>`` and pruning runs after it, so pruning,
``latest`` and a resume only see complete checkpoints. If ``fit`` raises,
the save in flight is abandoned without communication (the other ranks may
not be there); the next ``fit`` tidies its temporary directory.

[Note: resume]
The sampler's order is a pure function of its seed and the epoch, so a
resumed run skips the steps already done in that epoch and then computes
exactly what the uninterrupted run would have (bit-equal parameters,
tested). FSDP checkpoints reload on another world size; the others need the
world size they were saved with.

Where in the epoch is recorded in samples, not steps: W ranks taking
``order[r::W]`` in batches of B have trained, after k steps, exactly the first
k * B * W samples of the epoch's order (``samples_in_epoch``). A resumed epoch
runs the rest of that order, cut between this world's ranks the way the
sampler cuts (``_rest_of_epoch``): on the same world that is batch for batch
what skipping k steps gives; on another one (FSDP) no sample is lost or seen
twice. A checkpoint from before this was recorded skips steps of this world.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from .._dtypes import array_module
from ..checkpoint import clean_interrupted, latest
from ..checkpoint.background import AsyncCheckpointer
from ..checkpoint.directory import saved_extra
from ..checkpoint.io import broadcast_text, failed_on
from ..backends import ReduceOp
from ..collectives import all_reduce, broadcast, stragglers
from ..data import DataLoader, DistributedSampler
from ..errors import ArgumentTypeError, AxonError, CheckpointError, ConfigurationError
from ..nn import require_module
from ..groups import resolve_group
from ..groups.agreement import all_or_none, who_passed
from ..collectives.refusal import batch_refused, vote
from ..observe.log import get_logger
from ..settings import settings
from .preemption import PREEMPTED_EXIT_CODE, Preemption, PreemptedExit
from .progress import DEFAULT_PERCENT, DEFAULT_SECONDS, Progress, parse_every
from .shrink import Shrinking, check_options, preemption_after
from .strategies import SETUPS, STRATEGIES, Setup, batches_of, build

CHECKPOINT_PATTERN = "ckpt-*"


class _Plan(NamedTuple):
    """What one ``fit`` call runs: its arguments, and the steps of an epoch."""

    epochs: int
    per_epoch: int  # optimizer steps in an epoch
    grad_accumulation: int
    batch_size: int
    eval_arrays: Optional[Sequence[Any]]
    checkpoint_dir: Optional[str]
    checkpoint_every: Optional[int]
    log_file: Optional[str]


def _arrays(data: Any, what: str) -> tuple:
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ConfigurationError(f"{what} must be a pair (inputs, targets) of arrays with one row per sample")
    x, y = data
    if len(x) != len(y):
        raise ConfigurationError(f"{what}: {len(x)} inputs but {len(y)} targets")
    return x, y


def _dtype_kind(a: Any) -> str:
    """numpy's kind letter of an array's dtype, without converting it (a cupy array stays on its device)."""
    dtype = getattr(a, "dtype", None)
    return np.dtype(dtype).kind if dtype is not None else np.asarray(a).dtype.kind


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")


class DistributedTrainer:
    """Train a model with one of the parallel strategies.

    Args:
        optimizer: an ``axonhpc.optim`` optimizer over ``model.parameters()``
            (for ``fsdp``, ``zero1`` and ``pipeline`` one of its class and
            hyperparameters is rebuilt over what the strategy trains), or a
            callable ``params -> optimizer``.
        strategy: "ddp", "fsdp", "zero1", "pipeline" or "tp+dp".
        mesh: for "tp+dp", the ``world.mesh(dp=..., tp=...)`` of the model's
            tensor-parallel layers.
        log_file: JSON-lines metrics file (rank 0); None: ``checkpoint_dir/metrics.jsonl``
            when there is a checkpoint directory.
        progress: rank 0's tqdm bar on a terminal, else a plain line every 10%
            of an epoch or every minute; ``"N%"`` or ``"Ns"`` sets how often;
            False shows nothing.
        exit_on_preemption: raise ``SystemExit(75)`` after the preemption checkpoint.
        on_step: ``on_step(trainer, global_step, loss)``, every rank, after each step.
        on_epoch: ``on_epoch(trainer, record)``, every rank, after each epoch.
        skip_nonfinite_steps: if any rank finds an inf or NaN gradient, every
            rank skips the step. None: ``ax.settings.skip_nonfinite_steps``.
        async_checkpoints: write periodic and end-of-epoch checkpoints in a
            background thread (the preemption checkpoint is always synchronous).
        fault_tolerance: None, or "shrink" ("ddp" and "fsdp", under ``axonhpc
            launch --fault-tolerant``): survivors of a dead rank shrink the world
            and redo the step (docs/fault-tolerance.md).
        simulate_failure: with "shrink": ``"R:K[:where]"`` (``elastic.parse_failures``).
        spares: with "shrink": this many of the highest ranks wait to replace lost ones.
        respawn: with "shrink": where no spare is left, ``MPI_Comm_spawn`` a
            replacement for each rank lost.
        **strategy_options: passed to the wrapper (DDP, FSDP or Pipeline).

    Raises:
        ConfigurationError: an unknown strategy or a bad option, before any communication.
    """

    def __init__(self, model: Any, optimizer: Any, loss_fn: Any, strategy: str = "ddp", group: Any = None,
                 mesh: Any = None, seed: int = 0, log_file: Optional[str] = None, progress: Union[bool, str] = True,
                 keep_checkpoints: int = 3, exit_on_preemption: bool = True,
                 on_step: Optional[Callable[["DistributedTrainer", int, float], None]] = None,
                 on_epoch: Optional[Callable[["DistributedTrainer", Dict[str, Any]], None]] = None,
                 verbose: bool = True, skip_nonfinite_steps: Optional[bool] = None, async_checkpoints: bool = False,
                 fault_tolerance: Optional[str] = None, simulate_failure: Optional[str] = None, spares: int = 0,
                 respawn: bool = False, **strategy_options: Any):
        if strategy not in STRATEGIES:
            raise ConfigurationError(f"unknown strategy {strategy!r}; use one of {list(STRATEGIES)}")
        require_module(model, "DistributedTrainer")
        if not (callable(optimizer) or (callable(getattr(optimizer, "step", None))
                                        and callable(getattr(optimizer, "zero_grad", None)))):
            raise ArgumentTypeError(f"DistributedTrainer optimizer must be an optimizer (with step and zero_grad) or a "
                                    f"callable that builds one from the parameters, got {type(optimizer).__name__}")
        if not (callable(loss_fn) and callable(getattr(loss_fn, "backward", None))):
            raise ArgumentTypeError(f"DistributedTrainer loss_fn must be a loss module (callable, with backward), got "
                                    f"{type(loss_fn).__name__}")
        _positive_int("keep_checkpoints", keep_checkpoints)
        if fault_tolerance == "shrink":
            check_options(strategy, group, mesh, optimizer, simulate_failure, spares)
        elif fault_tolerance is not None:
            raise ConfigurationError(f"fault_tolerance must be None or 'shrink', got {fault_tolerance!r}")
        elif simulate_failure or spares or respawn:
            raise ConfigurationError(f"simulate_failure={simulate_failure!r}, spares={spares!r} and "
                                     f"respawn={respawn!r} need fault_tolerance='shrink'")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.strategy = strategy
        self.group = group
        self.mesh = mesh
        self.seed = int(seed)
        self.log_file = log_file
        self.progress = bool(progress)
        self._progress_every = parse_every(progress) if progress else (DEFAULT_PERCENT, DEFAULT_SECONDS)
        self.keep_checkpoints = keep_checkpoints
        self.exit_on_preemption = exit_on_preemption
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.verbose = verbose
        self.skip_nonfinite_steps = (settings.skip_nonfinite_steps if skip_nonfinite_steps is None
                                     else bool(skip_nonfinite_steps))
        self.async_checkpoints = bool(async_checkpoints)
        self.options = strategy_options
        self.fault_tolerance, self.simulate_failure, self.spares = fault_tolerance, simulate_failure, spares
        self.respawn = bool(respawn)
        self.setup: Optional[Setup] = None
        self._shrinking: Optional[Shrinking] = None
        self._recoveries_seen = 0  # the recoveries said (by rank 0; a rank that took a place says its own)
        self._sync_sums = self._joined = False  # after a recovery: take the epoch's sums from a survivor
        self._mixed_precision: Any = None
        self.global_step = 0
        self.epoch = 0
        self._epoch_samples: Optional[int] = None  # in fit: the samples of every rank trained in this epoch
        self._resumed: Optional[Dict[str, Any]] = None  # what the checkpoint fit resumed from recorded
        self._steps_per_epoch = 0  # in fit: this world's optimizer steps in an epoch
        self.preempted = False
        self.history: List[Dict[str, Any]] = []
        self._preemption: Optional[Preemption] = None
        self._writer: Optional[AsyncCheckpointer] = None

    # -- building ----------------------------------------------------------------------------
    def _ensure_setup(self, mixed_precision: Any) -> Setup:
        if self.setup is None:
            self.setup = build(self.strategy, self.model, self.optimizer, self.loss_fn, self.group, self.mesh,
                               mixed_precision, self.options)
            self.setup.skip_nonfinite = self.skip_nonfinite_steps
            self._mixed_precision = mixed_precision
        elif mixed_precision is not self._mixed_precision and mixed_precision is not None:
            raise ConfigurationError("mixed_precision is fixed when the model is first wrapped (the first fit or "
                                     "evaluate); pass it to the first fit")
        return self.setup

    def request_stop(self) -> None:
        """Ask ``fit`` to stop after the current step, as SIGTERM or SIGUSR1 would."""
        if self._preemption is not None:
            self._preemption.request()

    @property
    def active(self) -> bool:
        """False on a ``spares`` rank that never took a place (after ``fit``: it holds no model); else True."""
        return self._shrinking is None or self._shrinking.active

    @property
    def recoveries(self) -> List[Any]:
        """With ``fault_tolerance="shrink"``: an ``elastic.Recovery`` per recovery so far."""
        return [] if self._shrinking is None else list(self._shrinking.recoveries)

    @property
    def rank(self) -> int:
        """This rank in the trainer's group."""
        return resolve_group(self.group).rank if self.setup is None else self.setup.group.rank

    # -- data -------------------------------------------------------------------------------------
    def _loader(self, x: Any, y: Any, batch_size: int) -> DataLoader:
        return DataLoader((x, y), batch_size, sampler=self.setup.sampler(len(x), self.seed))

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint_dir: str, epoch: int, step_in_epoch: int, background: bool = False) -> str:
        """Collective: write ``checkpoint_dir/ckpt-<global step>`` and prune beyond ``keep_checkpoints``.

        Args:
            background: start the save in a writer thread and return; it is in
                place once ``finish_checkpoint`` (or the next save) finishes it.

        Returns:
            The checkpoint's path.
        """
        self.finish_checkpoint()
        path = os.path.join(checkpoint_dir, f"ckpt-{self.global_step:08d}")
        self._checkpoint_dir_ready(checkpoint_dir)
        extra = {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": self.global_step,
                 "strategy": self.strategy}
        if self._epoch_samples is not None:  # in fit: where in the epoch's order, at any world size ([Note: resume])
            extra["samples_in_epoch"] = self._epoch_samples
            extra["steps_per_epoch"] = self._steps_per_epoch
        if background:
            if self._writer is None or self._writer.group is not self.setup.group:
                self._writer = AsyncCheckpointer(self.setup.group)
            self.setup.save(path, extra, {"rng": self.setup.rng_states()}, writer=self._writer)
            return path
        self.setup.save(path, extra, {"rng": self.setup.rng_states()})
        if self.setup.group.rank == 0:
            self._prune(checkpoint_dir)
        return path

    def finish_checkpoint(self, only_if_written: bool = False) -> Optional[str]:
        """Collective: finish the background checkpoint, then prune old ones; its path, or None.

        Args:
            only_if_written: finish it only if every rank's files are already
                written (one small all-reduce; never waits).

        Raises:
            CheckpointError: on every rank, if any rank failed to write it.
        """
        writer = self._writer
        if writer is None or writer.pending is None:
            return None
        path = writer.pending
        if not (writer.poll() if only_if_written else writer.wait() is not None):
            return None
        if self.setup.group.rank == 0:
            self._prune(os.path.dirname(path))
        return path

    def _checkpoint_dir_ready(self, checkpoint_dir: str, tidy: bool = False) -> Optional[str]:
        """Collective: rank 0 makes ``checkpoint_dir``; with ``tidy`` it also clears the leftovers of killed saves
        and names the newest checkpoint there, returned on every rank (None: there is none).

        Raises:
            CheckpointError: on every rank, if rank 0 could not use the directory.
            ConfigurationError: on every rank, if the ranks name different directories.
        """
        group = self.setup.group
        newest = None
        differ = lambda seen: ConfigurationError(  # noqa: E731
            f"the ranks name different checkpoint directories: {who_passed(seen, group.ranks)}; pass every rank "
            f"the same checkpoint_dir (on a filesystem they share)")
        with all_or_none(group, failed_on(f"preparing checkpoint directory {checkpoint_dir!r}",
                                          ", so no rank writes or reads it"), differ) as vote:
            vote.text = os.path.abspath(checkpoint_dir)
            if group.rank == 0:
                try:
                    os.makedirs(checkpoint_dir, exist_ok=True)
                    if tidy:
                        for line in clean_interrupted(checkpoint_dir):
                            get_logger("trainer").info(f"checkpoint directory {checkpoint_dir}: {line}")
                        newest = latest(checkpoint_dir, CHECKPOINT_PATTERN)
                except OSError as exc:
                    raise CheckpointError(f"checkpoint_dir {checkpoint_dir!r} cannot be used (on group rank 0): "
                                          f"{type(exc).__name__}: {exc}") from exc
        # Rank 0's answer for all: ranks that see the directory differently load the same checkpoint or
        # are told together that they cannot.
        return broadcast_text(newest, group) if tidy else None

    def _prune(self, checkpoint_dir: str) -> None:
        from ..checkpoint.paths import step_regex

        regex = step_regex(CHECKPOINT_PATTERN)
        found = sorted((int(m.group(1)), name) for name in os.listdir(checkpoint_dir)
                       for m in [regex.fullmatch(name)] if m and os.path.isdir(os.path.join(checkpoint_dir, name)))
        for _, name in found[:-self.keep_checkpoints]:
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)

    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        """Collective: restore a checkpoint written by ``save_checkpoint``; returns where the run was."""
        # The strategy first (group rank 0's reading, for all): another strategy's files fail the load in terms
        # of its own format, which do not say why.
        saved = saved_extra(path) if self.setup.group.rank == 0 else None
        written = broadcast_text(saved.get("strategy") if isinstance(saved, dict) and isinstance(
            saved.get("strategy"), str) else None, self.setup.group)
        if written is not None and written != self.strategy:
            raise ConfigurationError(f"{path!r} was written with strategy {written!r}, this trainer uses "
                                     f"{self.strategy!r}")
        extra, rank_state = self.setup.load(path)
        if not isinstance(extra, dict):
            raise CheckpointError(f"{path!r} records no trainer state (its extra is a {type(extra).__name__}, not "
                                  f"a dict): it was not written by DistributedTrainer.save_checkpoint")
        for key in ("epoch", "step_in_epoch", "global_step"):
            value = extra.get(key)
            if type(value) is not int or value < 0:
                raise CheckpointError(f"{path!r} records {key}={value!r}; the trainer writes an integer >= 0 there "
                                      f"(a checkpoint of another program, or an edited index)")
        if extra.get("strategy") != self.strategy:
            raise ConfigurationError(f"{path!r} was written with strategy {extra.get('strategy')!r}, this trainer "
                                     f"uses {self.strategy!r}")
        self.setup.restore_rng_states(rank_state.get("rng", {}))
        self.global_step = int(extra["global_step"])
        return extra

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, train_arrays: Sequence[Any], epochs: int, eval_arrays: Optional[Sequence[Any]] = None,
            batch_size: int = 32, grad_accumulation: int = 1, mixed_precision: Any = None,
            checkpoint_dir: Optional[str] = None, checkpoint_every: Optional[int] = None,
            resume: bool = True) -> List[Dict[str, Any]]:
        """Collective: train for ``epochs`` epochs, resuming from ``checkpoint_dir`` if it holds one.

        Args:
            train_arrays: ``(inputs, targets)``, one row per sample (the same on every rank).
            epochs: total epochs of the run (a resumed run continues up to it).
            batch_size: samples per rank per batch.
            grad_accumulation: batches per optimizer step.
            mixed_precision: an ``ax.MixedPrecision``: FSDP's for "fsdp"; for "ddp"
                and "zero1" its ``param_dtype`` is the ``nn.autocast`` dtype (with a
                ``GradScaler`` for float16).

        Returns:
            One dict per epoch run now: epoch, train loss, eval metrics, seconds.

        Raises:
            ConfigurationError: before any communication, for bad arguments.
            SystemExit: with ``PREEMPTED_EXIT_CODE`` after a preemption checkpoint.
        """
        x, y = _arrays(train_arrays, "train_arrays")
        if eval_arrays is not None:
            _arrays(eval_arrays, "eval_arrays")
        for name, value in (("epochs", epochs), ("batch_size", batch_size), ("grad_accumulation", grad_accumulation)):
            _positive_int(name, value)
        _positive_int("checkpoint_every", checkpoint_every, allow_none=True)
        SETUPS[self.strategy].check_fit(grad_accumulation)
        log_file = self.log_file or (os.path.join(checkpoint_dir, "metrics.jsonl") if checkpoint_dir else None)
        if self.fault_tolerance is not None:
            return self._fit_shrinking(_Plan(epochs, 0, grad_accumulation, batch_size, eval_arrays, checkpoint_dir,
                                             checkpoint_every, log_file), x, y, mixed_precision, resume)
        setup = self._ensure_setup(mixed_precision)
        loader = self._loader(x, y, batch_size)
        plan = _Plan(epochs, self._per_epoch(len(loader), batch_size, grad_accumulation), grad_accumulation,
                     batch_size, eval_arrays, checkpoint_dir, checkpoint_every, log_file)
        start_epoch, skip = self._resume_point(plan, resume)
        start_epoch, done = self._samples_done(plan, len(x), start_epoch, skip)
        self._preemption = Preemption(setup.group)
        self._steps_per_epoch = plan.per_epoch
        try:
            return self._run_epochs(plan, start_epoch, done,
                                    lambda epoch, done: self._train_epoch(plan, x, y, loader, epoch, done))
        finally:
            self._epoch_samples = None

    @staticmethod
    def _per_epoch(batches: int, batch_size: int, grad_accumulation: int) -> int:
        per_epoch = batches // grad_accumulation
        if per_epoch == 0:
            raise ConfigurationError(f"an epoch has no complete step: {batches} batch(es) of {batch_size} per "
                                     f"rank, grad_accumulation={grad_accumulation}")
        return per_epoch

    def _run_epochs(self, plan: "_Plan", start_epoch: int, skip: int,
                    train_epoch: Callable[[int, int], Optional[float]]) -> List[Dict[str, Any]]:
        """Collective: the epochs from ``start_epoch`` (the first ``skip`` steps of it done), their records."""
        records: List[Dict[str, Any]] = []
        try:
            for epoch in range(start_epoch, plan.epochs):
                started = time.perf_counter()
                loss = train_epoch(epoch, skip)
                if loss is None:
                    return self._preempt(records)
                skip = 0
                records.append(self._epoch_ended(plan, epoch, loss, time.perf_counter() - started))
            self._between_steps(self.finish_checkpoint, redo=True)
            if self._shrinking is not None:
                self._shrinking.close()
        except BaseException:
            if self._writer is not None:
                self._writer.abandon()  # no collective here: the other ranks may not reach one
            raise
        finally:
            self._preemption.close()
            self._preemption = None
        return records

    # -- fault_tolerance="shrink" -------------------------------------------------------------------
    def _fit_shrinking(self, plan: "_Plan", x: Any, y: Any, mixed_precision: Any, resume: bool) -> List[Dict[str, Any]]:
        """Collective over the job: ``fit`` under ``elastic.ElasticTraining`` (``shrink``'s module notes)."""
        if self._shrinking is None:
            self._shrinking = Shrinking(self, mixed_precision, plan.batch_size, (plan, resume))
            start: Optional[Tuple[int, int]] = self._shrinking.resume_point
            if self._shrinking.joined:  # a spare or replacement that took a place: where the others are
                self.global_step, start = self._shrinking.elastic.done, None
            if self._shrinking.recoveries:  # that, or ranks lost while the trainer was built
                self._after_recovery()  # it may hold rank 0 now, and say the recovery
                self._joined = self._shrinking.joined
        elif mixed_precision is not None and mixed_precision is not self._mixed_precision:
            raise ConfigurationError("mixed_precision is fixed when the model is first wrapped (the first fit); "
                                     "pass it to the first fit")
        else:
            start = self._resume_point(plan, resume)
        shrinking = self._shrinking
        if not shrinking.active:
            return []  # a spare that never took a place: the run has ended
        per_epoch = shrinking.steps_per_epoch(len(x), plan.grad_accumulation)
        if per_epoch == 0:
            raise ConfigurationError(f"an epoch has no complete step: {len(x)} samples, a global batch of "
                                     f"{shrinking.global_batch}, grad_accumulation={plan.grad_accumulation}")
        plan = plan._replace(per_epoch=per_epoch)
        epoch, skip = divmod(self.global_step, per_epoch) if start is None else start
        self._preemption = preemption_after(self._preemption, self.setup.group)
        return self._run_epochs(plan, epoch, skip, lambda e, k: self._train_epoch_shrinking(plan, x, y, e, k))

    def _train_epoch_shrinking(self, plan: "_Plan", x: Any, y: Any, epoch: int, skip: int) -> Optional[float]:
        """Collective: ``_train_epoch`` whose steps are redone on the survivors after a recovery."""
        self.epoch = epoch
        shrinking = self._shrinking
        first = self.global_step - skip  # the global step before the epoch's first
        total, samples_seen = 0.0, 0
        bar = self._bar(plan.per_epoch, skip, f"epoch {epoch + 1}/{plan.epochs}")
        try:
            while self.global_step - first < plan.per_epoch:
                while self._sync_sums:  # a rank that took a place has none; a recovery in here asks again
                    self._sync_sums, joined, self._joined = False, self._joined, False
                    sums = self._between_steps(lambda: self._survivors_sums(total, samples_seen, joined))
                    if sums is not None:
                        total, samples_seen = sums
                loader = shrinking.loader(x, y, self.seed)  # the current world's
                loader.set_epoch(epoch)
                setup = self.setup
                for batches in batches_of(loader, plan.grad_accumulation, self.global_step - first):
                    done = shrinking.step(batches)
                    self.global_step = shrinking.elastic.done
                    self._after_recovery()
                    if done is not None:
                        mean, samples = done
                        total += mean * samples
                        samples_seen += samples
                        self._after_step(plan, epoch, mean, bar)
                        if self._between_steps(lambda: self._checkpoint_after_step(plan, epoch,
                                                                                   self.global_step - first)):
                            return None
                    if self.setup is not setup or self.global_step - first >= plan.per_epoch:
                        break  # after a recovery: the new world's loader, from the step the survivors are at
        finally:
            if bar is not None:
                bar.close()
        return total / max(samples_seen, 1)

    def _survivors_sums(self, total: float, samples: int, joined: bool) -> Tuple[float, int]:
        """Collective: the epoch's loss sum and samples so far, as the lowest survivor of the recovery has them."""
        group = self.setup.group
        root = np.array([group.size if joined else group.rank], dtype=np.int64)
        all_reduce(root, ReduceOp.MIN, group)
        sums = np.array([total, samples], dtype=np.float64)
        broadcast(sums, int(root[0]), group)
        return float(sums[0]), int(sums[1])

    def _between_steps(self, fn: Callable[[], Any], redo: bool = False) -> Any:
        """Collective: ``fn()``; under "shrink", None (or, ``redo``, done again) after a recovery in it."""
        if self._shrinking is None:
            return fn()
        out = self._shrinking.call(fn, redo)
        self._after_recovery()
        return out

    def _after_recovery(self) -> None:
        """After a recovery the run is on a new world: say so, and rebind what the old one's group held."""
        recoveries = self.recoveries
        if len(recoveries) == self._recoveries_seen:
            return
        for record in recoveries[self._recoveries_seen:]:
            self._say(record.line())
        self._recoveries_seen = len(recoveries)
        self._sync_sums = True
        self._preemption = preemption_after(self._preemption, self.setup.group)

    def _abandon_save(self) -> None:
        """Local, after ranks were lost: drop a background save in flight (the previous checkpoint stays)."""
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None

    def _resume_point(self, plan: "_Plan", resume: bool) -> Tuple[int, int]:
        """Collective: ``(epoch, steps done in it)`` to start from: the newest checkpoint's, loaded, or (0, 0).

        First the run's files: the metrics file and the checkpoint directory, checked on rank 0 for every rank.
        """
        last = self._checkpoint_dir_ready(plan.checkpoint_dir, tidy=True) if plan.checkpoint_dir else None
        self._log_file_ready(plan.log_file)
        if last is None:
            return 0, 0
        if not resume:
            raise ConfigurationError(
                f"fit(resume=False): checkpoint_dir {plan.checkpoint_dir!r} holds an earlier run's checkpoints "
                f"(newest {os.path.basename(last)}); this run's would be written among them, and pruning (the "
                f"newest {self.keep_checkpoints} by step are kept) could delete its own. Pass resume=True to go "
                f"on from it, or give this run an empty checkpoint_dir")
        where = self.load_checkpoint(last)
        self._resumed = where
        epoch, skip = int(where["epoch"]), int(where["step_in_epoch"])
        if skip >= plan.per_epoch:
            epoch, skip = epoch + 1, 0
        # Epochs are counted from 1 in every line the trainer prints ("epoch   3 ..."), here too.
        self._say(f"resuming from {last} at epoch {epoch + 1}/{plan.epochs}"
                  + (f", step {skip + 1} of {plan.per_epoch}" if skip else ""))
        return epoch, skip

    def _train_epoch(self, plan: "_Plan", x: Any, y: Any, loader: DataLoader, epoch: int,
                     done: int) -> Optional[float]:
        """Collective: the steps of one epoch after its first ``done`` samples (of every rank); their mean loss, or
        None once preempted."""
        self.epoch = epoch
        self._epoch_samples = done
        width = self._data_rank()[1]
        if done:  # the rest of the epoch's order, cut for this world ([Note: resume])
            loader = self._rest_of_epoch(x, y, plan.batch_size, epoch, done)
        loader.set_epoch(epoch)
        step = max(0, plan.per_epoch - len(loader) // plan.grad_accumulation) if done else 0
        total, samples_seen = 0.0, 0
        bar = self._bar(plan.per_epoch, step, f"epoch {epoch + 1}/{plan.epochs}")
        for batches in batches_of(loader, plan.grad_accumulation, 0):
            if step >= plan.per_epoch:
                break
            mean = self.setup.train_step(batches, self.loss_fn)  # over every rank's samples
            samples = sum(len(b[1]) for b in batches)
            total += mean * samples
            samples_seen += samples
            self._epoch_samples += samples * width
            step += 1
            self.global_step += 1
            self._after_step(plan, epoch, mean, bar)
            if self._checkpoint_after_step(plan, epoch, step):
                if bar is not None:
                    bar.close()
                return None
        if bar is not None:
            bar.close()
        return total / max(samples_seen, 1)

    def _rest_of_epoch(self, x: Any, y: Any, batch_size: int, epoch: int, done: int) -> DataLoader:
        """This rank's loader for epoch ``epoch`` after its first ``done`` samples: the epoch's order (what the
        sampler of one rank gives) without them, cut between this world's data-parallel ranks as the sampler cuts."""
        rank, width = self._data_rank()
        whole = DistributedSampler(len(x), 1, 0, shuffle=True, seed=self.seed, drop_last=True)
        whole.set_epoch(epoch)
        rest = whole.indices()[done:]
        return DataLoader((x, y), batch_size, sampler=rest[rank::width][:len(rest) // width])

    def _data_rank(self) -> Tuple[int, int]:
        """``(rank, size)`` of this rank among the ranks that split the data (1 where every rank sees it all)."""
        dp = self.setup.dp_group
        return (0, 1) if dp is None else (dp.rank, dp.size)

    def _samples_done(self, plan: "_Plan", n: int, epoch: int, skip: int) -> Tuple[int, int]:
        """``(epoch, samples of every rank already trained in it)`` to start from ([Note: resume]): what the
        checkpoint resumed from recorded, whatever world wrote it; ``skip`` steps of this world's for an older one."""
        where, self._resumed = self._resumed, None
        width = self._data_rank()[1]
        if where is None or "samples_in_epoch" not in where:
            return epoch, skip * plan.batch_size * plan.grad_accumulation * width
        done, steps = where["samples_in_epoch"], where.get("steps_per_epoch")
        for key, value in (("samples_in_epoch", done), ("steps_per_epoch", steps)):
            if type(value) is not int or value < 0:
                raise CheckpointError(f"the checkpoint records {key}={value!r}; the trainer writes an integer "
                                      f">= 0 there (an edited index)")
        epoch = int(where["epoch"])
        if where["step_in_epoch"] >= steps or done >= n:  # it was saved at the end of its epoch
            return epoch + 1, 0
        return epoch, done

    def _after_step(self, plan: "_Plan", epoch: int, mean: float, bar: Optional[Progress]) -> None:
        """Log, show and report the step just done."""
        self._log(plan.log_file, {"epoch": epoch + 1, "step": self.global_step, "loss": mean})
        if bar is not None:
            bar.update(mean)
        if self.on_step is not None:
            self.on_step(self, self.global_step, mean)

    def _checkpoint_after_step(self, plan: "_Plan", epoch: int, step: int) -> bool:
        """Collective: a checkpoint if one is due (or a preemption asks); True when the ranks agreed to stop."""
        stop = self._preemption.agreed()
        every = plan.checkpoint_every
        if plan.checkpoint_dir and (stop or (every and self.global_step % every == 0)):
            background = self.async_checkpoints and not stop  # a preemption one is on disk at once
            if self._shrinking is not None:
                self._shrinking.fail_point("save")
            self.save_checkpoint(plan.checkpoint_dir, epoch, step, background=background)
        else:
            self.finish_checkpoint(only_if_written=True)
        return stop

    def _epoch_ended(self, plan: "_Plan", epoch: int, loss: float, seconds: float) -> Dict[str, Any]:
        """Collective: ``_end_epoch``; after a recovery in it the survivors go on to the next epoch, not redoing it."""
        record = self._between_steps(lambda: self._end_epoch(plan, epoch, loss, seconds))
        if record is None:
            record = {"epoch": epoch + 1, "loss": loss, "seconds": seconds}
            get_logger("trainer").warning(f"epoch {epoch + 1}'s evaluation, checkpoint and report were cut short by "
                                          f"a lost rank; the run goes on with epoch {epoch + 2}")
            self.history.append(record)
        return record

    def _end_epoch(self, plan: "_Plan", epoch: int, loss: float, seconds: float) -> Dict[str, Any]:
        """Collective: evaluate, checkpoint, log and report the epoch; its record."""
        record = {"epoch": epoch + 1, "loss": loss, "seconds": seconds}
        if plan.eval_arrays is not None:
            record.update({f"eval_{k}": v for k, v in self.evaluate(plan.eval_arrays, plan.batch_size).items()})
        record.update(self._straggler())
        if plan.checkpoint_dir:
            self.save_checkpoint(plan.checkpoint_dir, epoch, plan.per_epoch, background=self.async_checkpoints)
        self.history.append(record)
        self._log(plan.log_file, record)
        if self.verbose:
            self._say(f"epoch {epoch + 1:3d}  " + "  ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                                                            for k, v in record.items() if k != "epoch"))
        if self.on_epoch is not None:
            self.on_epoch(self, record)
        return record

    def _straggler(self) -> Dict[str, Any]:
        """Collective: ``{"straggler", "straggler_share", "straggler_late_ms"}`` per ``collectives.stragglers``, or ``{}``."""
        group = self.setup.group
        if group.size == 1:
            return {}
        facts = stragglers.summary(group)
        rank = facts["straggler"]
        box = np.array([-1.0 if rank is None else rank, 0.0, 0.0])
        if rank is not None:
            box[1:] = facts["ranks"][rank]["share"], facts["ranks"][rank]["late_ms"]
        broadcast(box, src=0, group=group)
        if box[0] < 0:
            return {}
        return {"straggler": int(box[0]), "straggler_share": float(box[1]), "straggler_late_ms": float(box[2])}

    def _preempt(self, records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        self.preempted = True
        self._say(f"preempted after step {self.global_step}: checkpoint written, exiting with "
                  f"{PREEMPTED_EXIT_CODE} so a requeued run resumes")
        if self.exit_on_preemption:
            raise PreemptedExit()
        return records

    def evaluate(self, eval_arrays: Sequence[Any], batch_size: int = 256) -> Dict[str, float]:
        """Collective: mean loss (and accuracy for integer targets) over the whole set, reduced across ranks."""
        x, y = _arrays(eval_arrays, "eval_arrays")
        setup = self._ensure_setup(None)
        mine = setup.eval_rows(len(x))
        for m in setup.modules():
            m.eval()
        classes = _dtype_kind(y) in "iu"  # integer targets: class labels, so accuracy is reported too
        sums = np.zeros(3)  # loss * n, correct, n
        problem: Optional[AxonError] = None
        try:
            for start in range(0, max(len(mine), 1), batch_size):
                rows = mine[start:start + batch_size]
                out = (setup.predict(x[array_module(x).asarray(rows)])
                       if len(rows) or setup.forward_needs_every_rank() else None)
                if out is None or not len(rows) or problem is not None:
                    continue  # after a refusal: the predictions go on, they may be collective
                targets = y[array_module(y).asarray(rows)]  # on y's own device (numpy or cupy)
                try:
                    sums[0] += float(self.loss_fn(out, targets)) * len(rows)
                except AxonError as exc:  # refused on every rank below ([Note: a batch refused on one rank])
                    problem = exc
                    continue
                if classes and out.ndim == 2:
                    sums[1] += float((out.argmax(axis=1) == targets).sum())
                sums[2] += len(rows)
        finally:
            for m in setup.modules():
                m.train()
        vote(setup.group, problem, batch_refused(setup.group, "evaluate"))
        setup.sum_metrics(sums)
        result = {"loss": sums[0] / sums[2] if sums[2] else float("nan")}
        if classes:
            result["accuracy"] = sums[1] / sums[2] if sums[2] else float("nan")
        return result

    # -- output --------------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def _bar(self, total: int, initial: int, desc: str) -> Optional[Progress]:
        if not self.progress or self.rank != 0:
            return None
        return Progress(total, initial, desc, self._progress_every)

    def _log(self, log_file: Optional[str], record: Dict[str, Any]) -> None:
        if log_file is None or self.rank != 0:
            return
        # Rank 0 alone writes here, so an error must not leave this rank (the others would wait for it in
        # the next collective): fit checked the file before training; a later failure is logged.
        try:
            with open(log_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            get_logger("trainer").warning(f"could not write the metrics record {record} to {log_file!r}: "
                                          f"{type(exc).__name__}: {exc}")

    def _log_file_ready(self, log_file: Optional[str]) -> None:
        """Collective: rank 0 opens ``log_file`` for appending (making its directory); else ConfigurationError
        on every rank."""
        if log_file is None:
            return
        group = self.setup.group
        with all_or_none(group, lambda failed: ConfigurationError(
                f"log_file {log_file!r} cannot be written on group rank 0 (see the error raised there)")):
            if group.rank == 0:
                try:
                    os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
                    with open(log_file, "a"):
                        pass
                except OSError as exc:
                    raise ConfigurationError(f"log_file {log_file!r} cannot be written: "
                                             f"{type(exc).__name__}: {exc}") from exc


__all__ = ["DistributedTrainer", "PREEMPTED_EXIT_CODE"]
