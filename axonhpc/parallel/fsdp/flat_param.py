"""One FSDP unit: its parameters flattened into a padded flat parameter, sharded over a group.

[Note: the flat parameter]
Padding gets zero gradients and so stays zero under elementwise optimizers (LAMB's per-tensor norms would see
the flat shard instead of the tensors). Freeing leaves each module Parameter an empty (0,) placeholder, so a
layer computing with a freed parameter fails on the shape instead of using stale values (though ``.sum()`` of
an empty array is 0: code outside a unit's forward and backward must use ``gather_parameters()``).

[Note: parameters without a gradient inside a unit]
One process steps a parameter only while its ``grad`` is not None. The flat shard has one gradient for the
whole unit, so it is a segmented Parameter (``optim.Segments``, [Note: segmented parameters] there): its
``segments`` name the piece of each unit parameter this rank's shard holds, and ``grad_flags`` which unit
parameters the shard's gradient stands for. A reduction ORs in the parameters that had a gradient on this
rank; the end of a syncing backward agrees the flags over the ranks ([Note: a unit no rank's backward
reached] in ``hooks``) and sets them on ``shard.segments``, and the optimizer leaves the pieces of the others
alone, values and state, with Adam's step counted per parameter. A gradient that was None before the backward
stands for no parameter yet; one kept (zeroed, not dropped) stands for what it stood for.

[Note: an optimizer over the module's own Parameters]
``optim.SGD(model.parameters())`` instead of ``fsdp.parameters()`` would silently update nothing, so a
reduced module Parameter's ``grad`` is a ``MovedGradient`` whose arithmetic raises ``UsageError`` saying what
to pass; the optimizer's first ``step()`` raises on every rank alike, before it changes anything.

[Note: shards in shared memory]
When the shard group is one node's, the shards are host arrays gathered uncast and reach
``SHARED_SHARDS_MIN_BYTES``, they live in one shared-memory window, so an all-gather copies each byte once.
A too small ``/dev/shm`` is refused on every rank alike, and the shards stay private with a warning.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import numpy as np

from ..._dtypes import to_host
from ...backends import ReduceOp
from ...buffers import HOST, FlatOps, FlatShard
from ...collectives import all_gather, all_reduce, reduce_scatter, shared_memory_array
from ...collectives.shm_path import in_shared_memory
from ...errors import SharedMemoryError, UsageError
from ...observe.log import get_logger
from ..comm_hooks import GradBucket, finished
from ...nn import Parameter
from ...optim.segments import Segments
from .config import CPUOffload


class Placement:
    """Where master shards live (see the module note), for ``offload`` and the model's memory ``ops``."""

    def __init__(self, offload: CPUOffload, ops: FlatOps):
        self.offload = offload
        self.ops = ops
        self.device = not ops.host_memory
        self.host_master = self.device and offload.any

    @property
    def master_ops(self) -> FlatOps:
        """The flat-buffer operations of the memory the master shards and their gradients live in."""
        return HOST if self.host_master else self.ops

    def master(self, array: Any) -> Any:
        """The array the master shard keeps: a host copy when offloading a device model."""
        return to_host(array) if self.host_master else array

    def to_compute(self, shard: Any, dtype: np.dtype) -> Any:
        """The shard as the compute dtype on the compute device (cast on the host: half the copy)."""
        out = shard if shard.dtype == dtype else shard.astype(dtype)
        return self.ops.from_host(out) if self.host_master else out

    def to_master(self, grad: Any) -> Any:
        """A reduced gradient shard moved to where the master lives."""
        return to_host(grad) if self.host_master else grad


# Shards smaller than this together stay private: their window would be held for the life of the
# process (freeing it is collective) for all-gathers that take microseconds anyway.
SHARED_SHARDS_MIN_BYTES = 1 << 20


def share_shards(units: List["FlatUnit"], group: Any) -> bool:
    """Collective: move the units' master shards into one shared window of ``group`` (every rank decides alike)."""
    if group is None or group.size == 1:
        return False
    eligible = [u for u in units if u.ops.host_memory and u.gathers_master]
    sizes = [-(-int(u.shard.data.nbytes) // 64) * 64 for u in eligible]
    if sum(sizes) < SHARED_SHARDS_MIN_BYTES:
        return False
    try:
        raw = shared_memory_array(sum(sizes), np.uint8, group)
    except SharedMemoryError as exc:  # raised on every rank alike: all keep their shards in private memory
        get_logger("fsdp").warning(f"FSDP keeps its shards in private memory: {exc}")
        return False
    if not in_shared_memory(raw, group):
        return False
    offset = 0
    for unit, size in zip(eligible, sizes):
        data = unit.shard.data
        view = raw[offset:offset + data.nbytes].view(data.dtype)
        view[...] = data
        unit.shard.data = view
        offset += size
    return True


class MovedGradient(np.ndarray):
    """A module Parameter's ``grad`` after FSDP reduced it into its unit's shard; arithmetic raises ``UsageError``."""

    message = "this gradient was reduced into an FSDP shard; step an optimizer over fsdp.parameters()"

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None:
            self.message = getattr(obj, "message", MovedGradient.message)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise UsageError(self.message)

    def __repr__(self) -> str:
        return f"MovedGradient({self.message!r})"


# What FSDP made of each Parameter it holds (module Parameters and shards), for the checks of other wrappers.
_MANAGED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def fsdp_role(param: Any) -> Optional[str]:
    """How FSDP holds ``param`` ("the module Parameter 'fc.weight' of FSDP unit 'fc'", ...), or None."""
    try:
        return _MANAGED.get(param)
    except TypeError:  # not weak-referenceable: not a Parameter FSDP made or wrapped
        return None


def moved(grad: Any) -> bool:
    """True for a ``MovedGradient`` marker (a gradient FSDP already reduced into a shard)."""
    return isinstance(grad, MovedGradient)


def _marker(param_name: str, unit_name: str, dtype: Any) -> MovedGradient:
    marker = np.empty(0, dtype=dtype).view(MovedGradient)
    unit = f"FSDP unit {unit_name!r}" if unit_name else "FSDP's root unit"
    marker.message = (
        f"{param_name!r} is the module's own Parameter, whose gradient {unit} reduced into its flat shard: an "
        f"optimizer over model.parameters() would update nothing under FSDP. Build the optimizer over the "
        f"shards instead: optim.SGD(fsdp.parameters(), ...) (for clipping: fsdp.clip_grad_norm)")
    return marker


class FlatUnit:
    """The flat parameter of one FSDP unit (see the module notes).

    Args:
        named_params: ``(name, Parameter)`` of the unit, one dtype.
        shard_group: group the flat parameter is sharded over, or None (this rank alone).
        replicate_group: group the gradient shard is averaged over afterwards, or None.
    """

    def __init__(self, name: str, module: Any, named_params: List[Tuple[str, Parameter]], shard_group: Any,
                 replicate_group: Any, compute_dtype: np.dtype, reduce_dtype: np.dtype, placement: Placement,
                 tracker: Any, counter: Any):
        self.name = name
        self.module = module
        self.param_names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.shard_world = shard_group.size if shard_group is not None else 1
        self.shard_rank = shard_group.rank if shard_group is not None else 0
        self.ops = placement.ops
        self.xp = self.ops.xp
        # The padded flat parameter in the master dtype, and the same arrays in the compute dtype.
        self.flat = FlatShard([p.shape for p in self.params], self.params[0].dtype, self.shard_world, self.ops)
        self.compute_flat = self.flat.with_dtype(compute_dtype)
        self.layout, self.compute_layout = self.flat.layout, self.compute_flat.layout
        self.reduce_dtype = np.dtype(reduce_dtype)
        self.start, self.stop, self.pad = self.flat.bounds(self.shard_rank)
        self.placement = placement
        self.tracker = tracker
        self.counter = counter
        self.comm_hook: Optional[Tuple[Any, Any, int]] = None  # (state, hook, unit index): see comm_hooks
        full = self.flat.pack([p.data for p in self.params])
        self.shard = Parameter(placement.master(full[self.start:self.stop].copy()))
        self.shard.segments = Segments(len(self.params), [(i, at, last - first)
                                                          for i, first, last, at in self.held_spans()])
        # Which unit parameters shard.grad stands for (see the note); a gradient FSDP did not make: all of them.
        self.grad_flags: List[bool] = [True] * len(self.params)
        # The module Parameters' own arrays are released here (views of the master when kept).
        self.full: Optional[Any] = None
        self.persistent_views = self.shard_world == 1 and compute_dtype == self.layout.dtype and not placement.host_master
        self._gather_work = None
        self._gather_src = None
        self._device_shard = None
        self._markers = [_marker(n, name, self.compute_layout.dtype) for n in self.param_names]
        unit = f"FSDP unit {name!r}" if name else "FSDP's root unit"
        for n, p in zip(self.param_names, self.params):
            _MANAGED[p] = f"the module Parameter {n!r} of {unit}"
        _MANAGED[self.shard] = f"the flat shard of {unit} (an fsdp.parameters() entry)"
        self.gathered_bytes = self.compute_layout.padded_numel * compute_dtype.itemsize
        if self.persistent_views:
            self._attach(self.shard.data)
        else:
            self._detach()

    # -- parameters ----------------------------------------------------------------------
    @property
    def gathers_master(self) -> bool:
        """True if the all-gather sends the master shard itself (no cast, no device copy)."""
        return (self.shard_world > 1 and self.compute_layout.dtype == self.layout.dtype
                and not self.placement.host_master)

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters (unpadded)."""
        return self.layout.numel

    @property
    def is_gathered(self) -> bool:
        """True while the module Parameters hold the full values."""
        return self.persistent_views or self.full is not None

    @property
    def gathering(self) -> bool:
        """True while a (prefetched) all-gather is in flight."""
        return self._gather_work is not None

    def _attach(self, flat: Any) -> None:
        for p, view in zip(self.params, self.compute_flat.views(flat)):
            p.data = view

    def _detach(self) -> None:
        for p in self.params:
            p.data = self.xp.empty(0, dtype=self.compute_layout.dtype)

    def _compute_source(self) -> Any:
        if self._device_shard is not None:
            return self._device_shard
        src = self.placement.to_compute(self.shard.data, self.compute_layout.dtype)
        if self.placement.offload.keeps_device_copy and self.placement.host_master:
            self._device_shard = src
        return src

    def new_step(self) -> None:
        """Forget the step's device copy of the shard (the optimizer may have changed the master)."""
        self._device_shard = None

    def start_gather(self, async_op: bool) -> None:
        """Begin gathering the full parameters (nothing if they are gathered or on their way)."""
        if self.is_gathered or self.gathering:
            return
        src = self._compute_source()
        if self.shard_world == 1:
            self._set_full(src if src is not self.shard.data else src.copy())
            return
        if src is not self.shard.data:
            self.tracker.allocate("communication", src.nbytes)
        self._gather_src = src
        self.tracker.allocate("gathered_params", self.gathered_bytes)
        self._gather_work = all_gather(src, self.shard_group, async_op=True)
        self.counter.record("all_gather", self.gathered_bytes, self.shard_world)
        if not async_op:
            self.wait_gather()

    def _set_full(self, full: Any) -> None:
        if self.shard_world == 1:
            self.tracker.allocate("gathered_params", self.gathered_bytes)
        self.full = full
        self._attach(full)

    def wait_gather(self) -> None:
        """Finish an all-gather in flight and point the module Parameters at the result."""
        if self._gather_work is None:
            return
        stacked = self._gather_work.wait()
        self._gather_work = None
        if self._gather_src is not self.shard.data:
            self.tracker.release("communication", self._gather_src.nbytes)
        self._gather_src = None
        self.full = stacked.reshape(-1)
        self._attach(self.full)

    def abandon_gather(self) -> None:
        """The step failed: wait for an all-gather in flight and drop its result (an error of its own is passed
        over: the step's error is the one raised)."""
        work, self._gather_work = self._gather_work, None
        if work is None:
            return
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - a call another rank's refusal stopped raises again here
            pass
        if self._gather_src is not self.shard.data:
            self.tracker.release("communication", self._gather_src.nbytes)
        self._gather_src = None
        self.tracker.release("gathered_params", self.gathered_bytes)

    def gather(self) -> None:
        """Make the full parameters available now (waits for a prefetch in flight)."""
        self.start_gather(async_op=False)
        self.wait_gather()

    def progress(self) -> None:
        """Let MPI move an all-gather in flight forward (see DDP's note on progress)."""
        if self._gather_work is not None:
            self._gather_work.is_completed()

    def free(self) -> None:
        """Drop the full parameters (no-op for persistent views); waits for a gather in flight first."""
        if self.persistent_views:
            return
        self.wait_gather()
        if self.full is None:
            return
        self.full = None
        self.tracker.release("gathered_params", self.gathered_bytes)
        self._detach()

    # -- gradients -----------------------------------------------------------------------
    def prior_flags(self) -> List[bool]:
        """The unit parameters the shard's gradient stands for before a backward adds to it (none if it is None)."""
        if self.shard.grad is None:
            return [False] * len(self.params)
        return list(self.grad_flags)

    def set_grad_flags(self, flags: List[bool]) -> None:
        """The flags the ranks agreed on: no gradient at all if none is set, else which parameters it stands for."""
        self.grad_flags = flags
        if not any(flags):
            self.shard.grad = None
        self.shard.segments.set_with_grad(flags)

    def release_module_params(self) -> None:
        """The module Parameters are the module's alone again (``FSDP.remove_hooks``): no markers, no role."""
        self.drop_markers()
        for p in self.params:
            _MANAGED.pop(p, None)

    def drop_markers(self) -> None:
        """Set back to None the module gradients that are ``MovedGradient`` markers (before a backward)."""
        for p in self.params:
            if moved(p.grad):
                p.grad = None

    def start_reduction(self, flags: List[bool]) -> "PendingReduction":
        """Pack the module gradients (zeros where None), replace them by markers, start the reduce-scatter.

        Sets ``flags[i]`` where parameter ``i`` had a gradient here. ``finish()`` on the result adds it into the
        master shard's gradient.
        """
        # The module gradients in the compute dtype, as many bytes as the parameters (FlatShard.pack
        # takes a missing gradient as zeros and casts another dtype on the way).
        unsharded = self.numel * self.compute_layout.dtype.itemsize
        self.tracker.allocate("unsharded_grads", unsharded)
        grads = [None if p.grad is None or moved(p.grad) else p.grad for p in self.params]
        for i, g in enumerate(grads):
            if g is not None:
                flags[i] = True
        flat = self.compute_flat.pack(grads)
        if flat.dtype != self.reduce_dtype:
            flat = flat.astype(self.reduce_dtype)
        self.tracker.allocate("communication", flat.nbytes)
        for p, marker in zip(self.params, self._markers):
            p.grad = marker  # see the note on an optimizer over the module's own Parameters
        self.tracker.release("unsharded_grads", unsharded)
        if self.shard_world == 1:
            work = None
        elif self.comm_hook is not None:
            state, hook, index = self.comm_hook
            bucket = GradBucket(index, flat, self.param_names, self.shard_group, "reduce_scatter")
            work = finished(hook(state, bucket))
            self.counter.record("reduce_scatter", flat.nbytes, self.shard_world)
        else:
            work = reduce_scatter(flat, ReduceOp.AVG, self.shard_group, async_op=True)
            self.counter.record("reduce_scatter", flat.nbytes, self.shard_world)
        return PendingReduction(self, flat, work)

    def add_grad(self, grad_shard: Any) -> None:
        """Add a reduced gradient shard into the master shard's gradient."""
        grad_shard = self.placement.to_master(grad_shard)
        if self.shard.grad is None:
            self.shard.grad = grad_shard.astype(self.shard.data.dtype, copy=True)  # never a communication buffer
        else:
            self.shard.grad += grad_shard
        # Padding stays exactly zero whatever the reduction did with it.
        if self.pad:
            self.shard.grad[self.shard.grad.size - self.pad:] = 0

    # -- state ---------------------------------------------------------------------------
    def unpadded_range(self) -> Tuple[int, int]:
        """``[start, stop)`` of the master shard inside the unpadded flat parameter."""
        return min(self.start, self.numel), min(self.stop, self.numel)

    def held_spans(self) -> List[Tuple[int, int, int, int]]:
        """``(i, start, stop, at)``: elements ``[start, stop)`` of parameter ``i`` are ``shard.data[at:at + stop - start]``."""
        return self.flat.spans(self.shard_rank)

    def persistent_bytes(self) -> Tuple[int, int]:
        """Bytes of the master shard and of its gradient."""
        grad = self.shard.grad
        return int(self.shard.data.nbytes), int(grad.nbytes) if grad is not None else 0


class PendingReduction:
    """A unit's gradient reduction in flight (see ``FlatUnit.start_reduction``)."""

    def __init__(self, unit: FlatUnit, flat: Any, work: Any):
        self.unit = unit
        self.flat = flat
        self.work = work

    def progress(self) -> None:
        """Let MPI move the reduce-scatter forward."""
        if self.work is not None:
            self.work.is_completed()

    def abandon(self) -> None:
        """The step failed: wait for the reduce-scatter in flight and drop it (its own error passed over)."""
        if self.work is not None:
            try:
                self.work.wait()
            except Exception:  # noqa: BLE001 - the step's error is the one raised
                pass
        self.unit.tracker.release("communication", self.flat.nbytes)
        self.flat = None

    def finish(self) -> None:
        """Wait for the reduce-scatter, average across replicas, add into the master gradient."""
        unit = self.unit
        shard = self.flat if self.work is None else self.work.wait()
        if unit.replicate_group is not None and unit.replicate_group.size > 1:
            all_reduce(shard, ReduceOp.AVG, unit.replicate_group)  # in place
            unit.counter.record("all_reduce", shard.nbytes, unit.replicate_group.size)
        unit.add_grad(shard)
        unit.tracker.release("communication", self.flat.nbytes)
        self.flat = None


__all__ = ["FlatUnit", "PendingReduction", "Placement", "MovedGradient", "moved", "fsdp_role"]
