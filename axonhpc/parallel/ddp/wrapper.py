"""DistributedDataParallel: replicate a model, average its gradients in buckets.

[Note: buckets and their order]
Parameters are bucketed in reverse registration order (backward produces the last layer's gradients first),
with a small first bucket so communication starts early; the plan is a pure function of sizes and dtypes, so
it is identical on every rank. Buckets are all-reduced strictly in plan order, so every rank issues the same
collectives in the same order whatever the hooks do.

[Note: overlap and MPI progress]
With ``OVERLAPPED`` a bucket's ``Iallreduce`` starts as soon as its last gradient is final. MPI libraries such
as MPICH progress a non-blocking collective only while the process is inside MPI, and nothing calls MPI while
numpy computes the next layer's backward, so every grad-ready hook also tests the requests in flight
(``Reducer.progress``). ``ddp.last_step`` records the final wait and how many buckets were already complete,
so the overlap is measured rather than assumed.

When the group is on one node and the gradients reach ``SHARED_BUCKETS_MIN_BYTES``, all buckets live in one
shared-memory window of the node (``bucketing.shared``).

[Note: a failed backward]
Every rank's synchronising backward reduces every bucket, so a backward that raises on one rank (a bug in a
layer, a bad ``grad_out``, a parameter unused there alone) would leave the others waiting for a bucket it
never launches, or, blocking, taking its next step's buckets for this one's. So the failing rank takes part
in the first bucket it did not launch as a refusal (``refuse_call``): the others raise
``CollectiveRefusedError`` naming it and its error, and it raises its own. Both then wait for the buckets
already in flight, so the next step starts from a quiet group. Errors of the collectives themselves
(``GROUP_FAILURES``) are known to the group already and tell nothing. A backward that fails after its last
bucket was launched lets the others finish their step; only this rank raises.

A training forward (outside ``no_sync``) that raises does the same at the others' next collective, their
backward's first bucket: every training forward is followed by a backward on every rank.

[Note: parameters without a gradient]
With ``find_unused_parameters=True`` a parameter may get no gradient in a backward. Its bucket slot is
reduced all the same (zeros where the rank had no gradient), but a parameter whose ``grad`` was None
(``zero_grad(set_to_none=True)``) on every rank, and that no rank's backward reached since, gets None back after
the reduction, as PyTorch's DDP leaves it: the optimizer then skips it (no momentum, moments or weight
decay for it), exactly as it would without DDP. Which ones is one small MIN all-reduce of a flag per
parameter, made only with ``find_unused_parameters=True`` (PyTorch makes the same one there). Without it a
parameter that gets no gradient raises ``UnusedParameterError`` (OVERLAPPED and SYNCHRONOUS alike). "No gradient"
counts every backward since the last synchronisation: the micro-steps of ``no_sync()``, and with ``NO_SYNC`` all
the backwards before ``sync_gradients()``, which checks and restores the same way.

[Note: gradients as bucket views]
With ``gradient_as_bucket_view=True`` each ``p.grad`` is a view into its bucket, so the averaged values need
no copy back; a replaced ``p.grad`` (``zero_grad(set_to_none=True)``) is copied in and the view restored.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from ...backends import ReduceOp
from ...bucketing import GradBucket, GradSyncStrategy, Reducer, plan_buckets, shared_flats
# UnusedParameterError and GradientAfterReductionError are defined in errors (ax.errors.<Name>) and stay
# importable from here, where they were first defined.
from ...errors import (GROUP_FAILURES, ArgumentTypeError, ConfigurationError, GradientAfterReductionError,
                      UnusedParameterError)
from ...buffers import flat_ops_for
from ...collectives import all_reduce
from ...collectives.core import refuse_call
from ...groups import resolve_group
from ...nn import Module, call_backward, require_module
from ...observe import tracing
from .autotune import bucket_bytes
from .join import Joiner
from ..replicate import broadcast_arrays
from ..same_model import check_model_arrays, compared_model, parameter_lines
from ..wrapping import WrapperModes

FIRST_BUCKET_BYTES = 1 << 20  # PyTorch DDP's first bucket: 1 MiB
# Gradients smaller than this stay in private buckets: their window would be held for the life of
# the process (freeing it is collective) for a reduction that MPI does in microseconds anyway.
SHARED_BUCKETS_MIN_BYTES = 1 << 20


class DistributedDataParallel(WrapperModes):
    """Data parallelism: every rank holds the model, gradients are averaged.

    Args:
        module: the model (an ``axonhpc.nn.Module``).
        group: process group to replicate over (None: the current world's).
        bucket_size_mb: cap of a gradient bucket in MiB (the first is at most 1 MiB); None takes
            ``ax.settings.bucket_size_mb``, whose default "auto" measures the size on this machine at start-up
            (``parallel.ddp.autotune``; 25 MiB for threads as ranks, one rank, or ``settings.deterministic``).
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        gradient_as_bucket_view: make each ``p.grad`` a view into its flat bucket.
        strategy: ``GradSyncStrategy.OVERLAPPED`` (all-reduce buckets during backward), ``SYNCHRONOUS`` (one
            pass after backward) or ``NO_SYNC`` (only when ``sync_gradients()`` is called).
        find_unused_parameters: a parameter that got no gradient is synchronised with what its gradient holds;
            when False it raises ``UnusedParameterError`` naming it, instead of leaving the other ranks waiting.

    Raises:
        ConfigurationError: a non-positive bucket size or a module without parameters.
        ModelMismatchError: the ranks hold different models, or another rank's model failed the checks above;
            raised on every rank before anything else is sent.
        NotAMemberError: this rank is not in ``group``.
    """

    def __init__(self, module: Any, group: Any = None, bucket_size_mb: Any = None,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = True,
                 strategy: Any = GradSyncStrategy.OVERLAPPED, find_unused_parameters: bool = False):
        if bucket_size_mb not in (None, "auto") and (isinstance(bucket_size_mb, (str, bool)) or not bucket_size_mb
                                                      or bucket_size_mb <= 0):
            raise ConfigurationError(f"bucket_size_mb must be positive, 'auto' or None, got {bucket_size_mb!r}")
        self.strategy = GradSyncStrategy.parse(strategy)
        self.group = resolve_group(group).require_member("DDP")
        named = list(module.named_parameters()) if isinstance(module, Module) else []
        # Before any other message: every rank holds the same model, or every rank raises (see same_model).
        with compared_model(self.group, f"DDP over group {self.group.name}") as described:
            require_module(module, "DDP")
            if not named:
                raise ConfigurationError(f"DDP needs a module with parameters; {type(module).__name__} has none")
            check_model_arrays(module, "DDP")
            # Host or device buffers, chosen once; a model in both kinds of memory is refused here.
            self._ops = flat_ops_for([p.data for _, p in named], [name for name, _ in named], "DDP")
            described.lines = parameter_lines(named)
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.bucket_bytes = bucket_bytes(self.group, named[0][1].dtype,
                                         sum(int(p.data.nbytes) for _, p in named), bucket_size_mb)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._reducer = Reducer(self.group, self._ops)
        self._buckets, self._bucket_params = self._build_buckets()
        self._ready: List[List[bool]] = []
        self._pending: List[int] = []
        self._reset_ready()
        self._gradless: set = set()  # ids of parameters whose grad was None and that got none since (until a sync)
        self._since_sync: set = set()  # ids of parameters that got a gradient since the last synchronisation
        self._where: Dict[int, Tuple[int, int]] = {}
        for k, params in enumerate(self._bucket_params):
            for slot, p in enumerate(params):
                self._where[id(p)] = (k, slot)
        self._hooks = [p.register_grad_hook(self._on_grad_ready) for p in self._params]
        self._joiner = Joiner(self)  # uneven inputs: see join.py
        self._overlapping = False
        self._tracking = False  # in a synchronising backward: the hooks record which gradients are final
        self.last_step: Dict[str, Any] = {}
        self.sync_parameters()

    # -- plan ------------------------------------------------------------------------------
    def _build_buckets(self) -> Tuple[List[GradBucket], List[List[Any]]]:
        order = list(range(len(self._params) - 1, -1, -1))  # reverse registration order
        specs = [(self._params[i].size, self._params[i].dtype) for i in order]
        first = min(FIRST_BUCKET_BYTES, self.bucket_bytes)
        plan = plan_buckets(specs, self.bucket_bytes, first_bucket_size=first)
        groups = [[order[m] for m in members] for _, members in plan]
        params = [[self._params[i] for i in idx] for idx in groups]
        # One shared window for every bucket when the whole group is on one node (collective; see
        # [Note: buckets in shared memory] in bucketing.shared).
        flats = (shared_flats(params, self.group, SHARED_BUCKETS_MIN_BYTES) if self._ops.host_memory
                 else [None] * len(groups))
        buckets = [GradBucket.of_views(k, [p.shape for p in ps], ps[0].dtype, self._ops,
                                       [self._names[i] for i in idx], self.group, flat)
                   for k, (idx, ps, flat) in enumerate(zip(groups, params, flats))]
        return buckets, params

    @property
    def bucket_plan(self) -> List[List[str]]:
        """Parameter names of each bucket, in all-reduce order."""
        return [list(b.names) for b in self._buckets]

    # -- replication -----------------------------------------------------------------------
    def sync_parameters(self) -> None:
        """Copy rank 0's parameters and buffers into every rank (collective)."""
        broadcast_arrays(self._model_arrays(), self.group)

    def _model_arrays(self) -> List[Any]:
        return [p.data for p in self._params] + [b for _, b in self.module.named_buffers()]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; first copy rank 0's buffers if ``broadcast_buffers`` (in ``join()``: the lowest active).

        A training forward that raises tells the group, whose next collective is this step's backward
        ([Note: a failed backward]); in eval mode a forward is this rank's own affair.
        """
        training = bool(getattr(self.module, "training", True))
        self._broadcast_buffers(self._joiner.before_forward(training))
        try:
            with tracing.span("forward"):
                return self.module(*args, **kwargs)
        except Exception as exc:
            if training and self._syncing() and not isinstance(exc, GROUP_FAILURES):
                refuse_call(self.group, "DDP forward", exc)
            raise

    def _broadcast_buffers(self, src: int) -> None:
        if self.broadcast_buffers:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                broadcast_arrays(buffers, self.group, src=src)

    # -- backward --------------------------------------------------------------------------
    def _attach_grads(self) -> None:
        """Make every ``p.grad`` its bucket view (or a separate array), keeping its values."""
        for bucket, params in zip(self._buckets, self._bucket_params):
            for p, view in zip(params, bucket.views):
                if p.grad is None:
                    self._gradless.add(id(p))
                if self.gradient_as_bucket_view:
                    if p.grad is not view:
                        if p.grad is None:
                            view[...] = 0
                        else:
                            view[...] = p.grad
                        p.grad = view
                elif p.grad is None:
                    p.grad = self._ops.xp.zeros(p.shape, dtype=p.dtype)

    def _syncing(self) -> bool:
        return self.syncing and self.strategy is not GradSyncStrategy.NO_SYNC

    def backward(self, grad_out: Any, input_grad: bool = True) -> Any:
        """Backward through the module; on return gradients hold the group average.

        Inside ``no_sync()`` (or with ``NO_SYNC``) gradients only accumulate locally; the next backward outside
        averages the sum. ``input_grad=False`` lets the first layer skip d loss / d input (the result may be None).

        Raises:
            UnusedParameterError: a parameter got no gradient (see ``find_unused_parameters``).
            GradientAfterReductionError: a gradient changed after its bucket's all-reduce began (a parameter used
                twice under OVERLAPPED; use SYNCHRONOUS for such models).
        """
        syncing = self._syncing()
        self._joiner.before_backward(syncing)
        self._reducer.reset()
        self._reset_ready()
        try:
            self._attach_grads()
            self._tracking = syncing
            self._overlapping = syncing and self.strategy is GradSyncStrategy.OVERLAPPED
            start = time.perf_counter()
            try:
                grad_in = call_backward(self.module.backward, grad_out, input_grad)
            finally:
                self._overlapping = self._tracking = False
            backward_s = time.perf_counter() - start
            recorder = tracing.active()
            if recorder is not None:
                recorder.add("backward", "compute", start, start + backward_s)
            if syncing:
                self._finish(backward_s)
        except Exception as exc:
            if syncing:
                self._fail_step(exc)
            raise
        return grad_in

    def _fail_step(self, problem: Exception) -> None:
        """This rank's synchronising backward raised: tell the group if it still waits for buckets, then wait
        for the reductions in flight ([Note: a failed backward]). Raises ``problem`` when it told the group."""
        self._since_sync.clear()
        self._gradless.clear()
        try:
            if self._launches < len(self._buckets) and not isinstance(problem, GROUP_FAILURES):
                bucket = self._buckets[self._launches]
                overlapped = self.strategy is GradSyncStrategy.OVERLAPPED
                refuse_call(resolve_group(self.group), "all_reduce", problem, bucket.buffer, async_op=overlapped)
        finally:
            self._reducer.abandon()

    def _reset_ready(self) -> None:
        """No gradient final yet, no bucket launched (the grad-ready hooks fill ``_ready`` during backward)."""
        self._ready = [[False] * len(ps) for ps in self._bucket_params]
        self._pending = [len(ps) for ps in self._bucket_params]
        self._next_launch = 0
        self._launches = 0  # buckets launched in this step, by either strategy

    def _on_grad_ready(self, param: Any) -> None:
        self._since_sync.add(id(param))
        self._gradless.discard(id(param))
        if not self._tracking:
            return
        k, slot = self._where[id(param)]
        if self._ready[k][slot]:
            if self._overlapping and k < self._next_launch:
                raise GradientAfterReductionError(
                    f"parameter {self._buckets[k].names[slot]!r} received a second gradient after its bucket {k} "
                    "was already being all-reduced (is it used twice in forward?); use "
                    "strategy=GradSyncStrategy.SYNCHRONOUS for models with shared parameters"
                )
            return
        self._ready[k][slot] = True
        self._pending[k] -= 1
        if self._overlapping:
            self._launch_ready()
            self._reducer.progress()  # drive MPI progress of the reductions in flight (see the module note)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch, async_op=True)
            self._next_launch += 1

    def _reduce_op(self) -> ReduceOp:
        """AVG, or SUM when ``join`` divides by the active ranks instead (see ``_divisor``)."""
        if self._joiner.divides_by_active and self._reducer.hook is None:
            return ReduceOp.SUM
        return ReduceOp.AVG

    def _divisor(self) -> Any:
        """What the buckets' sums are divided by: the active ranks (``join(divide_by_initial_world_size=False)``)."""
        return self._joiner.state.active if self._reduce_op() is ReduceOp.SUM else None

    def _launch(self, k: int, async_op: bool) -> None:
        bucket = self._buckets[k]
        if not self.gradient_as_bucket_view:  # copied in now, written back by complete()
            bucket.copies = [p.grad for p in self._bucket_params[k]]
        self._reducer.launch(bucket, self._reduce_op(), async_op)
        self._launches += 1

    def _launch_all(self, async_op: bool) -> None:
        """Launch every bucket in plan order and complete them (collective)."""
        for k in range(len(self._buckets)):
            self._launch(k, async_op)
        self._reducer.complete(self._divisor())

    def _restore_gradless(self) -> None:
        """Collective: a parameter that no rank gave a gradient since its ``grad`` was None gets None back, so the
        optimizer skips it as it would without DDP ([Note: parameters without a gradient])."""
        flags = np.array([id(p) in self._gradless for p in self._params], dtype=np.int32)
        all_reduce(flags, ReduceOp.MIN, self.group)
        for p, none_everywhere in zip(self._params, flags.tolist()):
            if none_everywhere:
                p.grad = None
        self._gradless.clear()

    def _check_unused(self, backward: bool = True) -> None:
        """UnusedParameterError (without ``find_unused_parameters``) for a parameter that got no gradient in this
        backward or another since the last synchronisation ([Note: parameters without a gradient]); for
        ``sync_gradients`` (not ``backward``), one whose ``grad`` was None and got none since (a gradient set by
        hand counts)."""
        since, gradless = self._since_sync, self._gradless
        unused = [name for b, ready, params in zip(self._buckets, self._ready, self._bucket_params)
                  for name, ok, p in zip(b.names, ready, params)
                  if (not ok and id(p) not in since if backward else id(p) in gradless)]
        if unused and not self.find_unused_parameters:
            raise UnusedParameterError(
                f"parameters {unused} received no gradient in this backward (nor in the backwards accumulated since "
                "the last synchronisation); pass find_unused_parameters=True to DDP to synchronise their (zero) "
                "gradients, or remove them from the model"
            )
        self._pending = [0] * len(self._pending)

    def _finish(self, backward_s: float) -> None:
        start = time.perf_counter()
        self._check_unused()
        if self.strategy is GradSyncStrategy.OVERLAPPED:
            self._launch_ready()
            # Counted from what the hooks saw, without a probe of our own: a
            # test drives MPI progress, and that work belongs in the wait.
            done_before_wait = self._reducer.complete(self._divisor())
        else:  # SYNCHRONOUS: one pass after backward, in plan order
            self._launch_all(async_op=False)
            done_before_wait = 0
        if self.find_unused_parameters:
            self._restore_gradless()
        self._since_sync.clear()
        self._gradless.clear()
        wait_s = time.perf_counter() - start
        self.last_step = {"backward_s": backward_s, "final_wait_s": wait_s, "buckets": len(self._buckets),
                          "completed_before_wait": done_before_wait}

    def sync_gradients(self) -> None:
        """Average the gradients across the group now (collective), bucket by bucket: with ``NO_SYNC``, what the
        backwards since the last synchronisation accumulated.

        Raises:
            UnusedParameterError: a parameter got no gradient in any of those backwards (without
                ``find_unused_parameters``; with it, one that had none on every rank keeps ``grad`` None, as after a
                synchronising backward). The other ranks get ``CollectiveRefusedError`` naming it.
        """
        self._reducer.reset()
        self._reset_ready()
        try:
            self._attach_grads()
            self._check_unused(backward=False)
            self._launch_all(async_op=False)
        except Exception as exc:
            self._fail_step(exc)
            raise
        if self.find_unused_parameters:
            self._restore_gradless()
        self._since_sync.clear()
        self._gradless.clear()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Average each bucket with ``hook(state, bucket)`` instead of an all-reduce.

        ``bucket.kind`` is "all_reduce"; when the hook's ``Work`` completes (or at once if it returns None)
        ``bucket.buffer`` must hold the group average (see ``parallel.comm_hooks``). Raises ConfigurationError if a
        hook is registered already, ArgumentTypeError if ``hook`` is not callable.
        """
        if not callable(hook):
            raise ArgumentTypeError(f"a communication hook must be callable, got {type(hook).__name__}")
        if self._reducer.hook is not None:
            raise ConfigurationError("this DDP already has a communication hook")
        self._reducer.hook = (state, hook)

    # -- uneven inputs ----------------------------------------------------------------------
    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             optimizer: Any = None) -> Iterator[None]:
        """Collective: train on uneven inputs; a rank whose data ends first shadows the others.

        Wrap the whole loop; each rank leaves its loop when its own data ends, and the exit returns once every rank
        has finished (see ``join.py``)::

            with ddp.join(optimizer=opt):
                for x, y in my_batches:          # a different count on each rank
                    opt.zero_grad()
                    loss = loss_fn(ddp(x), y)
                    ddp.backward(loss_fn.backward())
                    opt.step()

        Inside, every training forward outside ``no_sync`` must be followed by ``ddp.backward``.

        Args:
            divide_by_initial_world_size: divide the gradient sum by the group size (joined ranks count as zeros)
                or, when False, by the number of ranks still active.
            enable: False makes the context do nothing (same code on even inputs).
            optimizer: stepped on a joined rank after each gradient it shadows, so its state follows the others.

        Raises:
            ConfigurationError: nested ``join``, or active ranks disagree on ``no_sync`` in one iteration (raised
                on every rank together).
        """
        with self._joiner.join(divide_by_initial_world_size, enable, optimizer, self._reducer.hook is not None):
            yield

    @property
    def last_join(self) -> Dict[str, Any]:
        """What the last ``join`` recorded: ``iterations`` (forwards per group rank) and ``shadowed`` (here)."""
        return self._joiner.last

    def _reduce_zeros(self) -> None:
        """A joined rank's backward: all-reduce zero gradients in plan order, as the active ranks do (see join.py)."""
        self._attach_grads()
        for bucket, params in zip(self._buckets, self._bucket_params):
            bucket.buffer[...] = 0
            if not self.gradient_as_bucket_view:
                for p in params:
                    p.grad[...] = 0
        # The same blocking or nonblocking calls as the active ranks: MPI never
        # matches a nonblocking collective with a blocking one.
        self._launch_all(async_op=self.strategy is GradSyncStrategy.OVERLAPPED)

    # -- the wrapped module ------------------------------------------------------------------
    def parameters(self) -> List[Any]:
        """The wrapped module's parameters (for the optimizer)."""
        return self.module.parameters()

    def named_parameters(self) -> List[Tuple[str, Any]]:
        """The wrapped module's named parameters."""
        return self.module.named_parameters()

    def state_dict(self):
        """The wrapped module's state dict (identical on every rank)."""
        return self.module.state_dict()

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True):
        """Load into the wrapped module."""
        return self.module.load_state_dict(state, strict=strict)

    def zero_grad(self) -> None:
        """Zero every gradient in place (bucket views stay views)."""
        for p in self._params:
            p.zero_grad()

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the module stays usable alone)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


DDP = DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDP", "UnusedParameterError", "GradientAfterReductionError",
           "FIRST_BUCKET_BYTES"]
