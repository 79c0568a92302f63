"""ParameterServer: the object every rank builds; it runs a ``Worker`` or a ``ServerLoop`` and delegates to it."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..._choices import parse_choice
from ...buffers import flat_ops_for
# ParameterServerError and PeerFailedError live in errors (ax.errors.<Name>) and stay importable from here.
from ...errors import ConfigurationError, ParameterServerError, PeerFailedError
from ...groups import resolve_group
from ...nn.parameter import Parameter
from ...optim.optimizer import Optimizer
from ...optim.sgd import SGD
from ..optimizer_args import build_optimizer, optimizer_settings
from ..replicate import broadcast_arrays
from ..same_model import check_model_arrays, compared_model, parameter_lines
from .protocol import MODES, NAME, Mode
from .server import ServerLoop, noted
from .slices import Slices
from .worker import Worker

_HINT = (f"every rank of the group must build the same model (the same layers, sizes and dtypes, in the same "
         f"order) and pass {NAME} the same num_servers, mode, max_staleness, optimizer_class and hyperparameters")


def _parse_mode(mode: Any) -> str:
    return parse_choice(Mode, mode, f"{NAME} mode").value


def _check_staleness(mode: str, max_staleness: Any) -> Optional[int]:
    if mode == "sync":
        if max_staleness is None or isinstance(max_staleness, bool) or max_staleness != 0:
            raise ConfigurationError(
                f"{NAME}: max_staleness={max_staleness!r} applies to mode='async' only; in sync mode every "
                "gradient is applied to the parameters it was computed on (staleness 0), so leave it at 0")
        return 0
    if max_staleness is None:
        return None
    if isinstance(max_staleness, bool) or not hasattr(max_staleness, "__index__") or int(max_staleness) < 0:
        raise ConfigurationError(f"{NAME}: max_staleness must be an integer >= 0 (or None for no bound), "
                                 f"got {max_staleness!r}")
    return int(max_staleness)


def _check_optimizer_class(optimizer_class: Any) -> type:
    if isinstance(optimizer_class, Optimizer):
        raise ConfigurationError(f"{NAME}: optimizer_class must be an Optimizer class, got an instance of "
                                 f"{type(optimizer_class).__name__}; the servers build it over their shards, so "
                                 f"pass the class and its hyperparameters, e.g. "
                                 f"optimizer_class=optim.{type(optimizer_class).__name__}, lr=...")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise ConfigurationError(f"{NAME}: optimizer_class must be a subclass of axonhpc.optim.Optimizer "
                                 f"(e.g. optim.SGD), got {optimizer_class!r}")
    return optimizer_class


class ParameterServer:
    """Parameter server training: the last ``num_servers`` ranks hold parameter shards and the optimizer, workers compute.

    Built on every rank of ``group``. Servers call ``serve()`` until every worker has finished; workers
    ``pull()``, compute gradients and ``push()`` them (``step()`` is both). Usage in docs/parameter-server.md.
    ``mode="sync"``: every update averages one gradient per worker, in worker order (equal to DDP over the
    workers). ``mode="async"``: each gradient is applied as it arrives, at most ``max_staleness`` server updates
    after its pull (None: no bound; 0 in sync mode).

    Args:
        model: built on every rank; group rank 0's values are copied to every rank.
        num_servers: in ``[1, group.size - 1]``.
        optimizer_class: the ``axonhpc.optim.Optimizer`` subclass the servers run over their slices (default
            ``optim.SGD``, whose own default lr is 1e-3); ``**optimizer_args`` its hyperparameters.

    Attributes:
        model, group, mode, max_staleness, num_servers, num_workers: as given or derived.
        server_index, worker_index: this rank's number in its role, None in the other.
        optimizer: on a server, the optimizer over its slices; None on workers.

    Raises:
        ConfigurationError: a model without parameters, a group of one rank, a bad ``num_servers``, mode,
            ``max_staleness``, optimizer class or hyperparameter (one it does not take or rejects).
        UnsupportedDtypeError, NonContiguousBufferError, ReadOnlyBufferError: a parameter or buffer cannot be
            sent in place.
        ModelMismatchError: the ranks built different models (a parameter's name, dtype or shape) or passed
            different settings (``num_servers``, mode, ``max_staleness``, optimizer and hyperparameters), or
            another rank raised one of the errors above; every rank raises, before anything else is sent.
        NotAMemberError: this rank is not in ``group``.
    """

    def __init__(self, model: Any, group: Any = None, num_servers: int = 1, mode: str = "sync",
                 max_staleness: Optional[int] = 0, *, optimizer_class: Any = SGD, **optimizer_args: Any) -> None:
        group = resolve_group(group).require_member(NAME)
        named = list(model.named_parameters()) if hasattr(model, "named_parameters") else None
        # Every check runs inside the model comparison (see same_model): a refusal on one rank, or
        # another model or setting on one rank, raises on every rank before anything else is sent.
        with compared_model(group, f"{NAME} over group {group.name}", hint=_HINT) as described:
            if named is None:
                raise ConfigurationError(f"{NAME} needs an axonhpc.nn.Module, got a {type(model).__name__}")
            if not named:
                raise ConfigurationError(f"{NAME} needs a model with parameters; {type(model).__name__} has none")
            mode = _parse_mode(mode)
            max_staleness = _check_staleness(mode, max_staleness)
            optimizer_class = _check_optimizer_class(optimizer_class)
            size = group.size
            if size < 2:
                raise ConfigurationError(f"{NAME} needs a group of at least 2 ranks (1 server and 1 worker), "
                                         f"group {group.name} has {size}")
            if isinstance(num_servers, bool) or not hasattr(num_servers, "__index__") \
                    or not 1 <= int(num_servers) <= size - 1:
                raise ConfigurationError(f"{NAME}: num_servers={num_servers!r} must be an integer between 1 and "
                                         f"the group size - 1 = {size - 1} (at least one rank must be a worker)")
            num_servers = int(num_servers)
            check_model_arrays(model, NAME)
            ops = flat_ops_for([p.data for _, p in named], [n for n, _ in named], NAME)
            slices = Slices([p for _, p in named], num_servers, ops)  # one flat vector per dtype, a part per server
            num_workers = size - num_servers
            rank = group.rank
            server_index = rank - num_workers if rank >= num_workers else None
            # The servers' optimizer over their slices; workers build a throwaway one so
            # that bad hyperparameters fail on every rank alike, before anything is sent.
            length = [sl.part_numel if server_index is not None else 1 for sl in slices.shards]
            shards = [Parameter(ops.zeros(n, sl.dtype)) for sl, n in zip(slices.shards, length)]
            optimizer = build_optimizer(NAME, optimizer_class, shards, optimizer_args)
            described.lines = parameter_lines(named)
            described.settings = [f"mode: {mode!r}", f"num_servers: {num_servers}",
                                  f"max_staleness: {max_staleness!r}"] + optimizer_settings(optimizer, optimizer_args)

        self.model = model
        self.group = group
        self.mode = mode
        self.max_staleness = max_staleness
        self.num_servers = num_servers
        self.num_workers = num_workers
        self.server_index: Optional[int] = server_index
        self.worker_index: Optional[int] = None if server_index is not None else rank
        self.optimizer: Optional[Optimizer] = optimizer if server_index is not None else None
        self._params = [p for _, p in named]
        self._server: Optional[ServerLoop] = None  # the role this rank runs: one of the two
        self._worker: Optional[Worker] = None

        # -- communication starts here --
        self._comm = group.split(0, key=rank)
        self._comm.timeout = group.timeout
        broadcast_arrays([p.data for p in self._params] + [b for _, b in model.named_buffers()], self._comm)
        slices.allocate()
        if server_index is not None:
            slices.pack_values()
            for shard, part in zip(shards, slices.parts(slices.values, server_index)):
                shard.data[...] = part
                shard.grad = ops.zeros(shard.data.size, shard.data.dtype)
            self._server = ServerLoop(self, self._comm, slices, shards)
        else:
            self._worker = Worker(self, self._comm, slices, self._params)
        self._served = False

    # -- roles ---------------------------------------------------------------------------------------
    @property
    def is_server(self) -> bool:
        """True on the server ranks (the group's last ``num_servers``)."""
        return self.server_index is not None

    @property
    def is_worker(self) -> bool:
        """True on the worker ranks (the group's first ``num_workers``)."""
        return self.server_index is None

    def server_rank(self, server: int) -> int:
        """The group rank of server ``server`` (``num_workers + server``); ConfigurationError if out of range."""
        if isinstance(server, bool) or not hasattr(server, "__index__") or not 0 <= int(server) < self.num_servers:
            raise ConfigurationError(f"{NAME}: server index {server!r} is out of range [0, {self.num_servers})")
        return self.num_workers + int(server)

    def __repr__(self) -> str:
        role = f"server {self.server_index}" if self.is_server else f"worker {self.worker_index}"
        bound = "" if self.mode == "sync" else f", max_staleness={self.max_staleness}"
        return (f"ParameterServer({role} of {self.num_servers} servers + {self.num_workers} workers, "
                f"mode={self.mode!r}{bound})")

    # -- worker side (worker.py) ---------------------------------------------------------------------------
    def _worker_for(self, what: str) -> Worker:
        """This rank's ``Worker``, or ParameterServerError naming ``what`` on a server."""
        if self.is_server:
            raise ParameterServerError(f"{NAME}.{what}() is for workers, but group rank {self.group.rank} is "
                                       f"server {self.server_index}; servers call serve()")
        return self._worker

    def pull(self) -> None:
        """Fetch the servers' current parameters into the model (in place), waiting as sync mode or the staleness bound needs.

        Raises ParameterServerError on a server or after ``finish()``; PeerFailedError if the servers stopped the run.
        """
        self._worker_for("pull").pull()

    def push(self) -> None:
        """Send the model's gradients (None counts as zero) to the servers that own them; they are not reset.

        Raises:
            ParameterServerError: on a server, after ``finish()``, with no ``pull()`` since the previous push, or
                with no gradient at all.
            ShapeError: a gradient's shape differs from its parameter's.
            PeerFailedError: the servers stopped the run.
        """
        self._worker_for("push").push()

    def step(self) -> None:
        """``push()`` the gradients, then ``pull()`` the updated parameters (raising as those do)."""
        self.push()
        self.pull()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the model's gradients, as an optimizer's ``zero_grad`` would (``set_to_none`` drops them)."""
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def finish(self, pull: bool = True) -> None:
        """Tell every server this worker is done; with ``pull``, wait for every worker and load the final parameters.

        Each server answers (at once without ``pull``). Idempotent. ParameterServerError on a server;
        PeerFailedError if the run stopped, or a server gave this worker up after its time limit.
        """
        self._worker_for("finish").finish(pull)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Stop the run because of a failure on this rank; every other rank stops with ``PeerFailedError``.

        A server that has not served answers ABORT until each worker has stopped (giving up on those silent for the
        group's timeout: CollectiveTimeoutError), then raises if anything else failed meanwhile (its own error
        while it served, or another server's: ``PeerFailedError``).
        """
        if self.is_server:
            if not self._served:
                self._served = True
                self._server.run(failure=f"{self._server.name} failed: {reason}")
            return
        self._worker.abort(reason)

    # -- server side ---------------------------------------------------------------------------------------
    def serve(self) -> Dict[str, Any]:
        """Answer the workers until every one has finished; returns ``stats()``.

        Raises:
            ParameterServerError: called on a worker, or twice.
            PeerFailedError: a worker or another server failed (after every worker has stopped).
            CollectiveTimeoutError: no request within the group's timeout; lists the workers as ``missing ranks``
                (each of them raises ``PeerFailedError`` saying so when it comes back).
            KeyboardInterrupt: (or another BaseException) raised while it serves: re-raised once every open worker
                and the other servers were told (they raise ``PeerFailedError`` naming it).
        """
        if not self.is_server:
            raise ParameterServerError(f"{NAME}.serve() is for servers, but group rank {self.group.rank} is "
                                       f"worker {self.worker_index}; workers call pull(), push() or step(), "
                                       "and finish()")
        if self._served:
            raise ParameterServerError(f"{NAME}.serve() was already called on server {self.server_index}")
        self._served = True
        self._server.run()
        return self.stats()

    def stats(self) -> Dict[str, Any]:
        """This rank's counters as plain data (role, mode, versions, pushes, pulls, staleness, waits)."""
        if self.is_server:
            return self._server.stats()
        return self._worker.stats()

    # -- context manager ---------------------------------------------------------------------------------------
    def __enter__(self) -> "ParameterServer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            if self.is_server:
                if not self._served:
                    self.serve()
            else:
                self.finish()
            return False
        reason = f"{exc_type.__name__}: {exc}"
        if self.is_server:
            if not self._served:
                try:
                    self.abort(reason)
                except Exception:  # noqa: BLE001 - the original exception is the one to see; what followed, its note
                    if exc is not None:
                        noted(exc, f"{self._server.name} stopped the run: {self._server.failure}")
        elif not self._worker.closed:
            try:
                self.abort(reason)
            except Exception as later:  # noqa: BLE001 - the original exception is the one to see; this, its note
                if exc is not None:
                    noted(exc, f"telling the servers failed: {type(later).__name__}: {later}")
        return False

__all__ = ["ParameterServer", "ParameterServerError", "PeerFailedError", "MODES"]
