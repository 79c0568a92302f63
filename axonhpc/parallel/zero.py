"""ZeroRedundancyOptimizer: ZeRO stage 1, the optimizer state sharded under DDP.

[Note: one padded flat vector per dtype]
A dtype's parameters form one flat vector padded to a multiple of the group size, so every rank owns an
equal slice (odd sizes work; the last ranks may own only padding). The wrapped optimizer runs over one
shard Parameter per dtype, and one ``all_gather`` per dtype brings the updated slices back.

[Note: exact only for elementwise optimizers]
An update that treats every element on its own (SGD, Adam, AdamW) gives the same numbers on a slice as on
the whole parameter, so ZeRO-1 equals DDP and padding stays zero. One that looks across elements (LAMB's or
LARS's per-parameter norm) would see slices cutting across parameters and compute something else.

[Note: the shard follows the parameters]
The owned slice is copied from the live parameters at every ``step``: one copy of 1/N of the model, which
keeps the wrapper right when values change behind its back (``load_state_dict``, ``sync_parameters()``).

[Note: a parameter without a gradient]
As in PyTorch, a parameter whose ``grad`` is None is left as it is, values and optimizer state; but every
rank makes the step's all-gathers whatever its gradients, so one rank's ``zero_grad(set_to_none=True)``
cannot leave the others waiting: its slices go out unchanged. A dtype none of whose parameters has a
gradient here is skipped by the wrapped optimizer (its shard's ``grad`` is None), state included. Within a
dtype the slice is one segmented Parameter ([Note: segmented parameters] in ``optim.segments``): its
``segments`` say which parameters have a gradient, and the optimizer steps only their pieces, each with
its own step count, as it would step the parameters one by one.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, NoReturn, Optional, Tuple

from .._dtypes import check_array, dtype_groups
from ..buffers import FlatOps, FlatShard, flat_ops_for
from ..collectives import all_gather
from ..collectives.core import refuse_call
from ..errors import ConfigurationError, ShapeError, StateDictError, UsageError
from ..groups import resolve_group
from ..nn.parameter import Parameter
from ..optim.optimizer import Optimizer
from ..optim.segments import Segments
from .fsdp import fsdp_role
from .optimizer_args import build_optimizer, optimizer_settings
from .same_model import compared_model, parameter_lines

_NAME = "ZeroRedundancyOptimizer"


class _DtypeShard:
    """One dtype's parameters as a padded flat vector (``FlatShard``), and this rank's part of it."""

    def __init__(self, params: List[Any], rank: int, world_size: int, ops: FlatOps) -> None:
        self.params = params
        self.rank = rank
        self.flat = FlatShard([p.data.shape for p in params], params[0].data.dtype, world_size, ops)
        self.layout = self.flat.layout
        self.start, self.stop, self.pad = self.flat.bounds(rank)
        self.param = Parameter(ops.zeros(self.flat.part_numel, self.layout.dtype))
        self.param.segments = Segments(len(params), [(i, at, last - first)
                                                     for i, first, last, at in self.flat.spans(rank)])
        self._grad = self.param.grad = ops.zeros(self.flat.part_numel, self.layout.dtype)
        self.copy_values()

    def copy_values(self) -> None:
        """The owned part of the parameters' values into the shard's ``data``."""
        self.flat.pack_part([p.data for p in self.params], self.rank, self.param.data)

    def copy_grads(self) -> None:
        """The owned part of the parameters' gradients (None as zeros) into the shard's ``grad``; ``grad`` is
        None when no parameter has one, so the optimizer skips the shard, and otherwise its ``segments`` say
        which parameters have one ([Note: a parameter without a gradient])."""
        flags = [p.grad is not None for p in self.params]
        if not any(flags):
            self.param.grad = None
            return
        self.param.grad = self._grad
        self.param.segments.set_with_grad(flags)
        self.flat.pack_part([p.grad for p in self.params], self.rank, self.param.grad)

    def gather_into_params(self, group: Any) -> None:
        """All-gather every rank's part and write the values into the parameters in place."""
        if self.layout.numel == 0:
            return  # the same on every rank: nobody sends
        flat = self.param.data if group.size == 1 else all_gather(self.param.data, group).reshape(-1)
        self.flat.unpack(flat, [p.data for p in self.params])

    def describe(self) -> Dict[str, Any]:
        """This rank's index range of the dtype's flat vector, as plain data."""
        return {"dtype": str(self.layout.dtype), "numel": int(self.layout.numel), "start": int(self.start),
                "stop": int(self.stop), "pad": int(self.pad)}


def _check_params(params: Iterable[Any]) -> List[Any]:
    """The parameter list, or ConfigurationError naming what is wrong with it."""
    try:
        params = list(params)
    except TypeError:
        raise ConfigurationError(f"{_NAME}: params must be an iterable of Parameters (e.g. ddp.parameters()), "
                                 f"got a {type(params).__name__}") from None
    if not params:
        raise ConfigurationError(f"{_NAME} got an empty parameter list")
    seen: Dict[int, int] = {}
    for i, p in enumerate(params):
        if not (hasattr(p, "data") and hasattr(p, "grad")):
            raise ConfigurationError(f"{_NAME}: params[{i}] is a {type(p).__name__}, not a Parameter")
        if id(p) in seen:
            raise ConfigurationError(f"{_NAME}: params[{i}] is the same Parameter as params[{seen[id(p)]}] "
                                     f"(shape {tuple(p.data.shape)}, dtype {p.data.dtype}); give each once")
        seen[id(p)] = i
        check_array(p.data, f"{_NAME}: params[{i}].data", writable=True)
    return params


def _check_not_fsdp(params: List[Any]) -> None:
    """UsageError for a Parameter that FSDP holds: FSDP shards the optimizer state already."""
    for i, p in enumerate(params):
        role = fsdp_role(p)
        if role is not None:
            raise UsageError(f"{_NAME}: params[{i}] is {role}; FSDP already shards the parameters, gradients and "
                             f"optimizer state. Under FSDP use a plain optimizer over fsdp.parameters() "
                             f"(optim.Adam(fsdp.parameters(), ...)); {_NAME} is for DDP, over ddp.parameters()")


_SAME = ("every rank must pass the same parameters (the same model's, in the same order), the same optimizer class "
         "and the same hyperparameters")


def _check_optimizer_class(optimizer_class: Any) -> None:
    """ConfigurationError unless an Optimizer subclass or a function (not an Optimizer instance)."""
    if isinstance(optimizer_class, Optimizer):
        raise ConfigurationError(f"{_NAME}: optimizer_class must be an Optimizer class, got an instance of "
                                 f"{type(optimizer_class).__name__}; pass the class and its hyperparameters, "
                                 f"e.g. {_NAME}(optim.{type(optimizer_class).__name__}, params, lr=...)")
    if (not callable(optimizer_class) or isinstance(optimizer_class, type)
            and not issubclass(optimizer_class, Optimizer)):
        raise ConfigurationError(f"{_NAME}: optimizer_class must be a subclass of axonhpc.optim.Optimizer "
                                 f"(e.g. optim.Adam) or a function params -> Optimizer, got {optimizer_class!r}")


class ZeroRedundancyOptimizer:
    """ZeRO stage 1 under plain DDP: each rank keeps and updates 1/N of the optimizer state, then all-gathers.

    Exact only for elementwise optimizers (see the module notes). A parameter whose ``grad`` is None keeps its
    values, as in PyTorch; ``step()`` makes its all-gathers on every rank whatever the gradients.
    Hyperparameters can be read and set on the wrapper (``opt.lr = 0.01``).

    Args:
        optimizer_class: an ``axonhpc.optim.Optimizer`` subclass, or a function ``params -> Optimizer``.
        params: the model's parameters, each once, with the same values on every rank.
        **optimizer_args: hyperparameters for ``optimizer_class``.

    Attributes:
        optimizer: the wrapped optimizer, over this rank's shard Parameters.
        params: the model's parameters, in the order given.
        group: the process group.

    Raises:
        ConfigurationError: a bad ``optimizer_class``, empty or duplicate ``params``, or hyperparameters the
            wrapped optimizer rejects (or does not take: its ``TypeError``); before any communication but the
            model check.
        UsageError: a parameter is one FSDP holds (FSDP shards the optimizer state itself).
        ModelMismatchError: on every rank, the ranks passed different parameters, optimizer classes or
            hyperparameters (naming the first that differs and each rank's value), or one of the errors above
            was raised on another rank (naming it and its error).
        UnsupportedDtypeError, NonContiguousBufferError, ReadOnlyBufferError: a parameter cannot be gathered into.
    """

    def __init__(self, optimizer_class: Any, params: Iterable[Any], group: Any = None,
                 **optimizer_args: Any) -> None:
        group = resolve_group(group).require_member(_NAME)
        # Before any other message: every rank shards the same parameters with the same optimizer and
        # hyperparameters, or every rank raises (one rank's bad lr too: the others would wait in step()).
        with compared_model(group, f"{_NAME} over group {group.name}", hint=_SAME) as described:
            _check_optimizer_class(optimizer_class)
            params = _check_params(params)
            _check_not_fsdp(params)
            ops = flat_ops_for([p.data for p in params], what=_NAME)  # one kind of memory, or a clear refusal
            shards = [_DtypeShard(members, group.rank, group.size, ops)
                      for members in dtype_groups(params, lambda p: p.data)]
            optimizer = build_optimizer(_NAME, optimizer_class, [s.param for s in shards], optimizer_args)
            described.lines = parameter_lines((f"params[{i}]", p) for i, p in enumerate(params))
            described.settings = optimizer_settings(optimizer, optimizer_args)
        self.optimizer: Optimizer = optimizer
        self.params: List[Any] = params
        self.group = group
        self._shards = shards
        # Set last: from here on, assigning one of these names goes to the wrapped optimizer.
        self._hyperparameter_names: Tuple[str, ...] = tuple(self.optimizer.hyperparameters())

    # -- hyperparameters pass through to the wrapped optimizer ---------------------------------
    def __getattr__(self, name: str) -> Any:
        names = self.__dict__.get("_hyperparameter_names", ())
        if name in names:
            return getattr(self.__dict__["optimizer"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_hyperparameter_names", ()):
            setattr(self.optimizer, name, value)
        else:
            object.__setattr__(self, name, value)

    def hyperparameters(self) -> Dict[str, Any]:
        """The wrapped optimizer's current hyperparameters by name."""
        return self.optimizer.hyperparameters()

    # -- training --------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the model parameters' gradients, as a plain optimizer does (``set_to_none`` drops them)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def step(self) -> None:
        """Collective: update this rank's slice, then all-gather every parameter, on every rank.

        A parameter whose ``grad`` is None keeps its values; a rank with no gradient at all still sends its
        slices, unchanged, so the others never wait for it ([Note: a parameter without a gradient]).

        Raises:
            ShapeError: a gradient has the wrong shape, before anything changes; the other ranks raise
                ``CollectiveRefusedError`` naming this rank instead of waiting in the all-gather.
        """
        problem = self._check_grads()
        if problem is not None:
            self._refuse(problem)
        for shard in self._shards:
            shard.copy_values()
            shard.copy_grads()
        if any(shard.param.grad is not None for shard in self._shards):
            self.optimizer.step()
        for shard in self._shards:
            shard.gather_into_params(self.group)

    def _check_grads(self) -> Optional[ShapeError]:
        """The error of the first gradient whose shape is not its parameter's, or None."""
        for i, p in enumerate(self.params):
            if p.grad is not None and tuple(p.grad.shape) != tuple(p.data.shape):
                return ShapeError(f"{_NAME}.step: params[{i}].grad has shape {tuple(p.grad.shape)}, the parameter "
                                  f"has {tuple(p.data.shape)}")
        return None

    def _refuse(self, problem: ShapeError) -> NoReturn:
        """Raise ``problem`` here and ``CollectiveRefusedError`` on the other ranks, in the all-gather they enter."""
        if self.group.size > 1 and any(shard.layout.numel for shard in self._shards):
            refuse_call(self.group, "all_gather", problem)
        raise problem

    # -- inspection and state --------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (0 before the first step: the state is created lazily)."""
        return int(sum(v.nbytes for entry in self.optimizer.state for v in entry.values() if hasattr(v, "nbytes")))

    def shard_ranges(self) -> List[Dict[str, Any]]:
        """This rank's ``dtype``, ``numel``, ``start``, ``stop`` and ``pad`` of each dtype's padded flat vector."""
        return [shard.describe() for shard in self._shards]

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the optimizer state and its index ranges, as plain data (copies, no pickle)."""
        return {"optimizer": self.optimizer.state_dict(), "shards": self.shard_ranges(),
                "rank": int(self.group.rank), "world_size": int(self.group.size)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this rank's shard of optimizer state saved on the same rank and group size (not the parameters).

        Raises StateDictError, before anything changes, if the keys, group size or shard ranges differ, or the
        wrapped optimizer rejects its part.
        """
        expected = {"optimizer", "shards", "rank", "world_size"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise StateDictError(f"{_NAME} state dict must have keys {sorted(expected)}, got {keys}")
        mine = {"shards": self.shard_ranges(), "rank": int(self.group.rank), "world_size": int(self.group.size)}
        theirs = {k: state_dict[k] for k in mine}
        if theirs != mine:
            raise StateDictError(f"{_NAME}: the state dict was saved by rank {theirs['rank']} of "
                                 f"{theirs['world_size']} with shards {theirs['shards']}; this is rank "
                                 f"{mine['rank']} of {mine['world_size']} with shards {mine['shards']}")
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def __repr__(self) -> str:
        ranges = ", ".join(f"{s['dtype']}[{s['start']}:{s['stop']}] of {s['numel']}" for s in self.shard_ranges())
        return (f"{_NAME}({type(self.optimizer).__name__}, {len(self.params)} parameters, "
                f"rank {self.group.rank} of {self.group.size}: {ranges})")


__all__ = ["ZeroRedundancyOptimizer"]
