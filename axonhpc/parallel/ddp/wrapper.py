"""DistributedDataParallel: replicate a model, average its gradients in buckets.

[Note: buckets and their order]
Parameters are grouped into flat buckets by ``plan_buckets`` over the
parameters in *reverse* registration order (backward produces the last
layer's gradients first), with a small first bucket so that communication
starts early, and ``bucket_size_mb`` as the cap; a bucket holds one dtype.
The plan is a pure function of the parameters' sizes and dtypes, so it is
identical on every rank. Buckets are all-reduced strictly in plan order: a
bucket whose gradients are ready waits for the buckets before it, so every
rank issues the same collectives in the same order whatever the hooks do.

[Note: overlap and MPI progress]
With ``OVERLAPPED`` each parameter's grad-ready hook (fired by the layer that
computed the gradient, during backward) counts down its bucket; when a
bucket's last gradient is final its non-blocking all-reduce (``Iallreduce``)
starts at once. MPI libraries such as MPICH move a non-blocking collective
forward only while the process is inside MPI, and nothing else calls MPI
while numpy computes the next layer's backward. So every hook also tests
the requests in flight (``MPI_Testall``): the transfer makes progress
between layers, and by the time backward ends most buckets are done.
``ddp.last_step`` records, per backward, how long the final wait took (all
of the synchronisation after backward: launching the last buckets and
waiting for every reduction) and how many buckets the hooks had already seen
complete, so the overlap can be measured rather than assumed.

[Note: buckets in shared memory]
When every rank of the group is on one node (and ``shm_collectives`` is not
"off"), and the gradients add up to at least ``SHARED_BUCKETS_MIN_BYTES``,
all buckets live in one shared-memory window allocated at
construction (``collectives.shared_memory_array``; collective, once), so a
bucket's all-reduce reduces straight from the other ranks' buckets with no
copy in (``collectives.shm_path``). Otherwise each bucket's buffer comes
from the model's memory (``buffers.FlatBucket``: numpy, or cupy's pool). A ``/dev/shm`` too
small for the window is refused on every rank alike (``SharedMemoryError``,
before anything is written); DDP then keeps private buckets, with a warning.

[Note: gradients as bucket views]
With ``gradient_as_bucket_view=True`` each ``p.grad`` is a view into its
bucket's flat buffer: layers accumulate straight into the buffer that is
all-reduced, and the averaged values need no copy back. If something
replaces ``p.grad`` (``zero_grad(set_to_none=True)``), the next backward
copies it into the bucket and restores the view.

[Note: uneven inputs and join]
Every backward all-reduces every bucket, so a rank that runs out of data
early would leave the others waiting in their next all-reduce. Inside
``ddp.join()`` each forward first all-gathers two flags per rank (still
active, will this iteration synchronise gradients). A rank whose loop has
ended enters the context's exit and *shadows* the others: for each of their
iterations it answers the flag exchange as joined, takes part in the buffer
broadcast, and all-reduces zero gradients in plan order, so the active ranks'
collectives always find a partner. By default the sum is still divided by the
initial world size (PyTorch's default; joined ranks add zeros), or with
``divide_by_initial_world_size=False`` by the number of active ranks. Given an
``optimizer``, a joined rank steps it with the averaged gradients it received,
so its parameters and optimizer state stay those of the active ranks. When
every rank has joined, the rank that ran the most iterations broadcasts its
parameters and buffers, so all ranks leave the context with one model.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from ... import tracing
from ..._dtypes import array_module
from ...bucketing import GradSyncStrategy, plan_buckets
from ...collectives import all_gather, all_reduce, shared_memory_array
from ...collectives.shm_path import in_shared_memory
from ...backends import ReduceOp
# UnusedParameterError and GradientAfterReductionError are defined in errors (ax.errors.<Name>) and stay
# importable from here, where they were first defined.
from ...errors import (ArgumentTypeError, AxonError, ConfigurationError, GradientAfterReductionError,
                      SharedMemoryError, UnusedParameterError)
from ...log import get_logger
from ...buffers import HOST, FlatBucket, FlatOps, flat_ops_for
from ...groups import resolve_group
from .autotune import bucket_bytes
from ..comm_hooks import GradBucket, finished
from ..replicate import broadcast_arrays
from ..same_model import check_same_model, parameter_lines

FIRST_BUCKET_BYTES = 1 << 20  # PyTorch DDP's first bucket: 1 MiB
# Gradients smaller than this stay in private buckets: their window would be held for the life of
# the process (freeing it is collective) for a reduction that MPI does in microseconds anyway.
SHARED_BUCKETS_MIN_BYTES = 1 << 20


_FORWARD, _BACKWARD = 1, 2
_PHASES = {_FORWARD: "forward", _BACKWARD: "backward"}


class _JoinState:
    """What ``DistributedDataParallel.join`` tracks while it is open."""

    def __init__(self, divide_by_initial_world_size: bool, optimizer: Any):
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.optimizer = optimizer
        self.iterations = 0  # forwards this rank ran inside the context
        self.active = 0  # ranks active in the current iteration
        self.shadowed = 0  # iterations this rank shadowed after its own data ended


class _Bucket:
    """One flat bucket of gradients (a ``FlatBucket``) and the state of its current reduction."""

    def __init__(self, index: int, params: List[Any], names: List[str], ops: FlatOps, flat: Any = None):
        self.index = index
        self.params = params
        self.names = names
        # In the node's shared window when ``flat`` is given (its all-reduce reads the other ranks'
        # buckets in place), else in the model's memory; each gradient a view of it either way.
        bucket = FlatBucket([p.shape for p in params], params[0].dtype, ops, flat)
        self.flat, self.views = bucket.flat, bucket.views
        self.pending = len(params)
        self.ready = [False] * len(params)
        self.work = None
        self.launched = False
        self.done = False  # its reduction was seen complete during backward

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)
        self.work = None
        self.launched = False
        self.done = False


class DistributedDataParallel:
    """Data parallelism: every rank holds the model, gradients are averaged.

    Args:
        module: the model (an ``axonhpc.nn.Module``).
        group: process group to replicate over (None: the current world's).
        bucket_size_mb: cap of a gradient bucket in MiB (the first bucket is
            at most 1 MiB, so communication starts early); None takes
            ``ax.settings.bucket_size_mb``, whose default "auto" measures the
            size on this machine at start-up (``parallel.ddp.autotune``; 25 MiB
            for threads as ranks, one rank, or ``settings.deterministic``).
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        gradient_as_bucket_view: make each ``p.grad`` a view into its flat bucket.
        strategy: ``GradSyncStrategy.OVERLAPPED`` (all-reduce buckets during
            backward), ``SYNCHRONOUS`` (one pass after backward) or
            ``NO_SYNC`` (never, unless ``sync_gradients()`` is called).
        find_unused_parameters: a parameter that got no gradient in a
            backward is synchronised with what its gradient holds (zero after
            ``zero_grad``); when False such a parameter raises
            ``UnusedParameterError`` naming it, instead of leaving the other
            ranks waiting for its bucket.

    Raises:
        ConfigurationError: a non-positive bucket size or a module without parameters.
        ModelMismatchError: the ranks of the group hold different models (parameter names,
            shapes, dtypes), or another rank's model failed the checks above; raised on
            every rank before anything else is sent.
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
        named = list(module.named_parameters())
        problem = None
        try:
            if not named:
                raise ConfigurationError(f"DDP needs a module with parameters; {type(module).__name__} has none")
            # Host or device buffers, chosen once; a model in both kinds of memory is refused here.
            self._ops = flat_ops_for([p.data for _, p in named], [name for name, _ in named], "DDP")
        except AxonError as exc:
            problem = exc
        # Before any other message: every rank holds the same model, or every rank raises (see same_model).
        check_same_model(self.group, f"DDP over group {self.group.name}", parameter_lines(named), problem)
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.bucket_bytes = bucket_bytes(self.group, named[0][1].dtype,
                                         sum(int(p.data.nbytes) for _, p in named), bucket_size_mb)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._buckets = self._build_buckets()
        self._where: Dict[int, Tuple[_Bucket, int]] = {}
        for bucket in self._buckets:
            for slot, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, slot)
        self._hooks = [p.register_grad_hook(self._on_grad_ready) for p in self._params]
        self._no_sync_depth = 0
        self._comm_hook: Any = None  # (state, hook): see comm_hooks
        self._join: Any = None
        self._overlapping = False
        self._next_launch = 0
        self.last_step: Dict[str, Any] = {}
        self.last_join: Dict[str, Any] = {}
        self.sync_parameters()

    # -- plan ------------------------------------------------------------------------------
    def _build_buckets(self) -> List[_Bucket]:
        order = list(range(len(self._params) - 1, -1, -1))  # reverse registration order
        specs = [(self._params[i].size, self._params[i].dtype) for i in order]
        first = min(FIRST_BUCKET_BYTES, self.bucket_bytes)
        plan = plan_buckets(specs, self.bucket_bytes, first_bucket_size=first)
        groups = [[order[m] for m in members] for _, members in plan]
        flats = self._shared_flats(groups) if self._ops is HOST else [None] * len(groups)
        return [_Bucket(k, [self._params[i] for i in idx], [self._names[i] for i in idx], self._ops, flat)
                for k, (idx, flat) in enumerate(zip(groups, flats))]

    def _shared_flats(self, groups: List[List[int]]) -> List[Any]:
        """One shared window holding every bucket, 64-byte aligned, or Nones (collective; see the note)."""
        sizes = []
        for idx in groups:
            nbytes = sum(int(self._params[i].data.nbytes) for i in idx)
            sizes.append(-(-nbytes // 64) * 64)
        if sum(sizes) < SHARED_BUCKETS_MIN_BYTES:
            return [None] * len(groups)
        try:
            raw = shared_memory_array(sum(sizes), np.uint8, self.group)
        except SharedMemoryError as exc:  # raised on every rank alike: all keep private buckets
            get_logger("ddp").warning(f"DDP keeps its gradient buckets in private memory: {exc}")
            return [None] * len(groups)
        if not in_shared_memory(raw, self.group):
            return [None] * len(groups)
        flats, offset = [], 0
        for idx, size in zip(groups, sizes):
            dtype = np.dtype(self._params[idx[0]].dtype)
            count = sum(int(self._params[i].size) for i in idx)
            flats.append(raw[offset:offset + count * dtype.itemsize].view(dtype))
            offset += size
        return flats

    @property
    def bucket_plan(self) -> List[List[str]]:
        """Parameter names of each bucket, in all-reduce order."""
        return [list(b.names) for b in self._buckets]

    # -- replication -----------------------------------------------------------------------
    def sync_parameters(self) -> None:
        """Copy rank 0's parameters and buffers into every rank (collective)."""
        arrays = [p.data for p in self._params] + [b for _, b in self.module.named_buffers()]
        broadcast_arrays(arrays, self.group)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; first copy rank 0's buffers if ``broadcast_buffers``.

        Inside ``join()`` the buffers come from the lowest active rank.
        """
        src = 0
        if self._join is not None:
            training = bool(getattr(self.module, "training", True))
            active, _ = self._exchange_join_flags(_FORWARD, training)
            self._join.iterations += 1
            self._join.active = len(active)
            src = int(active[0])
        self._broadcast_buffers(src)
        with tracing.span("forward"):
            return self.module(*args, **kwargs)

    def _broadcast_buffers(self, src: int) -> None:
        if self.broadcast_buffers:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                broadcast_arrays(buffers, self.group, src=src)

    # -- backward --------------------------------------------------------------------------
    def _attach_grads(self) -> None:
        """Make every ``p.grad`` its bucket view (or a separate array), keeping its values."""
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views):
                if self.gradient_as_bucket_view:
                    if p.grad is not view:
                        if p.grad is None:
                            view[...] = 0
                        else:
                            view[...] = p.grad
                        p.grad = view
                elif p.grad is None:
                    p.grad = array_module(p.data).zeros(p.shape, dtype=p.dtype)

    def _syncing(self) -> bool:
        return self._no_sync_depth == 0 and self.strategy is not GradSyncStrategy.NO_SYNC

    def backward(self, grad_out: Any) -> Any:
        """Backward through the module; on return gradients hold the group average.

        Inside ``no_sync()`` (or with the ``NO_SYNC`` strategy) gradients only
        accumulate locally; the next backward outside averages the sum.

        Returns:
            The gradient with respect to the module's input.

        Raises:
            UnusedParameterError: a parameter got no gradient (see
                ``find_unused_parameters``).
            GradientAfterReductionError: a parameter's gradient changed after
                its bucket's all-reduce began (a parameter used twice under
                OVERLAPPED; use SYNCHRONOUS for such models).
        """
        syncing = self._syncing()
        if self._join is not None:
            self._exchange_join_flags(_BACKWARD, syncing)
        self._attach_grads()
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = 0
        self._overlapping = syncing and self.strategy is GradSyncStrategy.OVERLAPPED
        start = time.perf_counter()
        try:
            grad_in = self.module.backward(grad_out)
        finally:
            self._overlapping = False
        backward_s = time.perf_counter() - start
        recorder = tracing.active()
        if recorder is not None:
            recorder.add("backward", "compute", start, start + backward_s)
        if syncing:
            self._finish(backward_s)
        return grad_in

    def _on_grad_ready(self, param: Any) -> None:
        if not self._overlapping:
            return
        bucket, slot = self._where[id(param)]
        if bucket.ready[slot]:
            if bucket.launched:
                raise GradientAfterReductionError(
                    f"parameter {bucket.names[slot]!r} received a second gradient after its bucket {bucket.index} "
                    "was already being all-reduced (is it used twice in forward?); use "
                    "strategy=GradSyncStrategy.SYNCHRONOUS for models with shared parameters"
                )
            return
        bucket.ready[slot] = True
        bucket.pending -= 1
        self._launch_ready()
        # Drive MPI progress of the reductions in flight (see the module note).
        for b in self._buckets[:self._next_launch]:
            if b.work is not None and not b.done:
                b.done = b.work.is_completed()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch], async_op=True)
            self._next_launch += 1

    def _reduce_op(self) -> ReduceOp:
        """AVG, or SUM when ``join`` divides by the active ranks instead (see ``_rescale``)."""
        if self._join is not None and not self._join.divide_by_initial_world_size and self._comm_hook is None:
            return ReduceOp.SUM
        return ReduceOp.AVG

    def _rescale(self) -> None:
        """Divide the buckets' sums by the active ranks (``join(divide_by_initial_world_size=False)``)."""
        if self._reduce_op() is ReduceOp.SUM:
            for bucket in self._buckets:
                array_module(bucket.flat).divide(bucket.flat, self._join.active, out=bucket.flat)

    def _launch(self, bucket: _Bucket, async_op: bool) -> None:
        if not self.gradient_as_bucket_view:
            self._ops.pack([p.grad for p in bucket.params], out=bucket.flat)
        bucket.launched = True
        start = time.perf_counter()
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            grads = GradBucket(bucket.index, bucket.flat, bucket.names, self.group, "all_reduce")
            bucket.work = finished(hook(state, grads))
        else:
            bucket.work = all_reduce(bucket.flat, self._reduce_op(), self.group, async_op=async_op)
        tracing.span_until_done(bucket.work, start, f"bucket {bucket.index}", "buckets",
                                elements=int(bucket.flat.size), dtype=str(bucket.flat.dtype))

    def _check_unused(self) -> None:
        unused = [name for b in self._buckets for name, ok in zip(b.names, b.ready) if not ok]
        if unused and not self.find_unused_parameters:
            raise UnusedParameterError(
                f"parameters {unused} received no gradient in this backward; pass "
                "find_unused_parameters=True to DDP to synchronise their (zero) gradients, "
                "or remove them from the model"
            )
        for b in self._buckets:
            b.pending = 0
            b.ready = [True] * len(b.ready)

    def _finish(self, backward_s: float) -> None:
        if self.strategy is GradSyncStrategy.OVERLAPPED:
            # Counted from what the hooks saw, without a probe of our own: a
            # test drives MPI progress, and that work belongs in the wait.
            done_before_wait = sum(1 for b in self._buckets if b.done)
            start = time.perf_counter()
            self._check_unused()
            self._launch_ready()
            for bucket in self._buckets:
                bucket.work.wait()
            wait_s = time.perf_counter() - start
        else:  # SYNCHRONOUS: one pass after backward, in plan order
            done_before_wait = 0
            start = time.perf_counter()
            for bucket in self._buckets:
                self._launch(bucket, async_op=False)
            wait_s = time.perf_counter() - start
        self._rescale()
        if not self.gradient_as_bucket_view:
            for bucket in self._buckets:
                self._ops.unpack(bucket.flat, [p.grad for p in bucket.params])
        self.last_step = {"backward_s": backward_s, "final_wait_s": wait_s, "buckets": len(self._buckets),
                          "completed_before_wait": done_before_wait}

    def sync_gradients(self) -> None:
        """Average the gradients across the group now (collective), bucket by bucket."""
        self._attach_grads()
        for bucket in self._buckets:
            self._launch(bucket, async_op=False)
        if not self.gradient_as_bucket_view:
            for bucket in self._buckets:
                self._ops.unpack(bucket.flat, [p.grad for p in bucket.params])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally (no communication)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Average each bucket with ``hook(state, bucket)`` instead of an all-reduce.

        See ``parallel.comm_hooks``: ``bucket.kind`` is "all_reduce", and when
        the hook's ``Work`` completes (or at once if it returns None)
        ``bucket.buffer`` must hold the group average. ``fp16_compress_hook``
        and ``bf16_compress_hook`` send 16-bit floats.

        Raises:
            ConfigurationError: a hook is already registered.
            ArgumentTypeError: ``hook`` is not callable (a ``TypeError``).
        """
        if not callable(hook):
            raise ArgumentTypeError(f"a communication hook must be callable, got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise ConfigurationError("this DDP already has a communication hook")
        self._comm_hook = (state, hook)

    # -- uneven inputs ----------------------------------------------------------------------
    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             optimizer: Any = None) -> Iterator[None]:
        """Train on uneven inputs: a rank whose data ends first shadows the others (collective).

        Wrap the whole loop; every rank enters, each leaves its loop when its
        own data ends, and the context's exit returns once every rank has
        finished (see the module note)::

            with ddp.join(optimizer=opt):
                for x, y in my_batches:          # a different count on each rank
                    opt.zero_grad()
                    loss = loss_fn(ddp(x), y)
                    ddp.backward(loss_fn.backward())
                    opt.step()

        Inside, every forward in training mode outside ``no_sync`` must be
        followed by ``ddp.backward`` (that is what the joined ranks expect),
        and gradients are synchronised only by ``backward``.

        Args:
            divide_by_initial_world_size: divide the gradient sum by the group
                size (True: joined ranks count as zeros, the default) or by
                the number of ranks still active (False).
            enable: False makes the context do nothing (same code on even inputs).
            optimizer: stepped on a joined rank after each gradient it shadows,
                so that its parameters and optimizer state follow the active ranks.

        Raises:
            ConfigurationError: nested ``join``, or active ranks disagree on
                ``no_sync`` in one iteration (raised on every rank together).
        """
        if not enable:
            yield
            return
        if self._join is not None:
            raise ConfigurationError("ddp.join() is already open; it cannot be nested")
        if self._comm_hook is not None and not divide_by_initial_world_size:
            raise ConfigurationError("join(divide_by_initial_world_size=False) needs the default reduction; a "
                                     "communication hook always averages over the whole group")
        self._join = _JoinState(bool(divide_by_initial_world_size), optimizer)
        try:
            yield
            self._shadow_until_all_joined()
            self._sync_final_model()
        finally:
            self._join = None

    def _exchange_join_flags(self, phase: int, flag: bool, active: bool = True) -> Tuple[np.ndarray, bool]:
        """All-gather ``(phase, active, flag)`` of every rank.

        ``phase`` is forward or backward (a joined rank gives the phase it
        expects next) and ``flag`` says "training mode" (forward) or "will
        synchronise gradients" (backward). Every rank sees the same rows, so
        a disagreement raises on all of them together.

        Returns:
            The active group ranks, and whether they set the flag.
        """
        rows = all_gather(np.array([phase, int(active), int(active and flag)], dtype=np.int64), self.group)
        active_ranks = np.flatnonzero(rows[:, 1])
        if len(active_ranks) and len(set(rows[:, 0].tolist())) > 1:
            where = {k: _PHASES.get(int(row[0]), "?") for k, row in enumerate(rows)}
            raise ConfigurationError(
                f"inside ddp.join() the group ranks are at different points of an iteration ({where}): every "
                "forward in training mode must be followed by ddp.backward"
            )
        flagged = np.flatnonzero(rows[:, 2])
        if len(flagged) and not np.array_equal(flagged, active_ranks):
            what = "training mode in forward" if phase == _FORWARD else "synchronising gradients in backward"
            raise ConfigurationError(
                f"inside ddp.join() the active group ranks {active_ranks.tolist()} must agree on {what}, "
                f"but only ranks {flagged.tolist()} do (no_sync or eval mode on the others)"
            )
        return active_ranks, bool(len(flagged))

    def _shadow_until_all_joined(self) -> None:
        """This rank's data has ended: answer the active ranks' collectives until none is left."""
        while True:
            active, training = self._exchange_join_flags(_FORWARD, False, active=False)
            if len(active) == 0:
                return
            self._join.active = len(active)
            self._join.shadowed += 1
            self._broadcast_buffers(int(active[0]))
            if training:
                _, syncing = self._exchange_join_flags(_BACKWARD, False, active=False)
                if syncing:
                    self._shadow_backward()

    def _shadow_backward(self) -> None:
        """All-reduce zero gradients in plan order, as a backward would; step the optimizer if given."""
        self._attach_grads()
        # The same blocking or nonblocking calls as the active ranks: MPI never
        # matches a nonblocking collective with a blocking one.
        overlapped = self.strategy is GradSyncStrategy.OVERLAPPED
        for bucket in self._buckets:
            bucket.flat[...] = 0
            if not self.gradient_as_bucket_view:
                for p in bucket.params:
                    p.grad[...] = 0
            self._launch(bucket, async_op=overlapped)
        if overlapped:
            for bucket in self._buckets:
                bucket.work.wait()
        self._rescale()
        if not self.gradient_as_bucket_view:
            for bucket in self._buckets:
                self._ops.unpack(bucket.flat, [p.grad for p in bucket.params])
        if self._join.optimizer is not None:
            self._join.optimizer.step()

    def _sync_final_model(self) -> None:
        """Every rank takes the parameters and buffers of the rank that ran the most iterations."""
        counts = all_gather(np.array([self._join.iterations], dtype=np.int64), self.group)[:, 0]
        self.last_join = {"iterations": counts.tolist(), "shadowed": self._join.shadowed}
        arrays = [p.data for p in self._params] + [b for _, b in self.module.named_buffers()]
        broadcast_arrays(arrays, self.group, src=int(np.argmax(counts)))

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

    def train(self, mode: bool = True) -> "DistributedDataParallel":
        """Training mode for the wrapped module."""
        self.module.train(mode)
        return self

    def eval(self) -> "DistributedDataParallel":
        """Evaluation mode for the wrapped module."""
        self.module.eval()
        return self

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
