"""ParameterServer: server ranks own shards of the parameters and run the optimizer; workers push and pull.

[Note: roles and shards]
Of a group of N ranks the last ``num_servers`` (S) are servers and the first
W = N - S are workers, so group rank w < W is worker w (rank 0, the one that
usually prints, is always a worker) and group rank W + s is server s. The
parameters are grouped by dtype in the order each dtype first appears; a
dtype's parameters, concatenated, form one flat vector padded to a multiple
of S (``FlatLayout``), and server s owns ``shard_bounds(numel, s, S)`` of it,
the same length on every server, as ZeRO does. Each server keeps one
``Parameter`` per dtype holding its slice and builds the optimizer over those
slices only, so optimizer state lives on the servers and nowhere else; as in
ZeRO-1 this equals training the whole model for elementwise optimizers (SGD,
Adam, AdamW). The constructor copies group rank 0's parameters and buffers
to every rank (one broadcast per dtype), so every server starts from the
same model.

[Note: messages]
All traffic runs over a private communicator split off the group when the
ParameterServer is built (an ``MPI_Comm_split`` with one color), so it never
matches the caller's own point-to-point messages, whatever their tags. A
worker's request is a 4-integer header (tag ``_TAG_REQUEST``: kind, the
version its gradient was computed on, length of a reason text, whether it
wants the final parameters) followed, for a push, by one gradient slice per
dtype (``_TAG_GRAD``) and, for a failure, by the reason (``_TAG_REASON``). A
server answers pulls with a header (``_TAG_REPLY``: OK or ABORT, its version,
reason length) and, if OK, its slice of each dtype (``_TAG_PARAMS``). The
library's ``recv``/``irecv`` take a concrete source (no ANY_SOURCE), so a
server keeps one ``irecv`` of a header posted per open worker and polls them with
``is_completed()`` (sleeping 10 us .. 1 ms between idle sweeps), handling
every completed one in worker order; a push's payload is received right
after its header. Replies go out with ``isend`` from copies, so a server
never waits for a worker and the optimizer may update the slice meanwhile.

[Note: sync and async]
``mode="sync"``: a server collects one gradient from every open worker,
sums them in worker order, divides by their number, applies one optimizer
step, and only then answers pulls of workers that pushed in that round. The
sum order is the order DDP's in-process all-reduce uses, so sync training
equals DDP on the same shards. ``mode="async"``: a server applies each
gradient, divided by W, as soon as the staleness bound allows
(``StalenessBound``, see staleness.py for the definition and the rule);
pulls that would break the bound wait. An async worker pulls from the
servers one at a time in server order (sync workers ask all at once): a
worker holding a fresh slice of server s while it waits for server s + 1
could otherwise block a gradient on s + 1 that another worker, holding
s + 1 and waiting on s, must send first. With the fixed order, the
gradients a server waits for belong to workers that are computing (they
hold every server's reply) or waiting on a later server, and what the last
server waits for belongs only to computing workers, so no cycle can form
(the lock-ordering argument).

[Note: shutdown and failure]
Every worker ends its conversation with each server with exactly one DONE
or FAILED request; a server's ``serve()`` returns once every worker has
sent one. DONE may ask for the final parameters, sent when all workers are
done (then the servers also swap slices, so every rank's model ends with the
final values). A worker that raises inside ``with ps:`` (or calls
``abort``) sends FAILED with the exception's text. A server that gets
FAILED stops applying updates and answers every pull with ABORT; a worker
that gets ABORT sends FAILED to every server (which spreads the news to any
server that had not heard) and raises ``PeerFailedError``; once every worker
has sent DONE or FAILED, the server raises ``PeerFailedError`` too. A
server's own exception is handled the same way (it aborts the run, drains,
then re-raises). No rank is left waiting; a rank that dies without a word
(a killed process) is caught only by ``ax.settings.timeout``, as for any
collective.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._dtypes import check_array
from ..bucketing import FlatLayout
from ..flatbuf import FlatOps, flat_ops_for
from ..collectives import irecv, isend, recv, send
# ParameterServerError and PeerFailedError live in errors (ax.errors.<Name>) and stay importable from here.
from ..errors import CollectiveTimeoutError, ConfigurationError, ParameterServerError, PeerFailedError, ShapeError
from ..groups import resolve_group
from ..nn.parameter import Parameter
from ..optim.optimizer import Optimizer
from .replicate import broadcast_arrays
from .staleness import StalenessBound

_NAME = "ParameterServer"
MODES = ("sync", "async")

_TAG_REQUEST, _TAG_GRAD, _TAG_REASON, _TAG_REPLY, _TAG_PARAMS, _TAG_FINAL = 1, 2, 3, 4, 5, 6
_PUSH, _PULL, _DONE, _FAILED = 1, 2, 3, 4
_OK, _ABORT = 0, 1
_HEADER = 4
_REASON_BYTES = 2000  # a failure's text is cut to this many bytes
_POLL_MIN, _POLL_MAX = 1e-5, 1e-3  # seconds a server sleeps between idle sweeps


def _parse_mode(mode: Any) -> str:
    if isinstance(mode, str) and mode.lower() in MODES:
        return mode.lower()
    raise ConfigurationError(f"{_NAME}: mode must be 'sync' or 'async', got {mode!r}")


def _check_staleness(mode: str, max_staleness: Any) -> Optional[int]:
    if mode == "sync":
        if max_staleness is None or isinstance(max_staleness, bool) or max_staleness != 0:
            raise ConfigurationError(
                f"{_NAME}: max_staleness={max_staleness!r} applies to mode='async' only; in sync mode every "
                "gradient is applied to the parameters it was computed on (staleness 0), so leave it at 0")
        return 0
    if max_staleness is None:
        return None
    if isinstance(max_staleness, bool) or not hasattr(max_staleness, "__index__") or int(max_staleness) < 0:
        raise ConfigurationError(f"{_NAME}: max_staleness must be an integer >= 0 (or None for no bound), "
                                 f"got {max_staleness!r}")
    return int(max_staleness)


def _check_optimizer_class(optimizer_class: Any) -> type:
    if optimizer_class is None:
        raise ConfigurationError(f"{_NAME} needs the optimizer its servers run: pass optimizer_class and its "
                                 f"hyperparameters, e.g. {_NAME}(model, optimizer_class=optim.SGD, lr=0.1)")
    if isinstance(optimizer_class, Optimizer):
        raise ConfigurationError(f"{_NAME}: optimizer_class must be an Optimizer class, got an instance of "
                                 f"{type(optimizer_class).__name__}; the servers build it over their shards, so "
                                 f"pass the class and its hyperparameters, e.g. "
                                 f"optimizer_class=optim.{type(optimizer_class).__name__}, lr=...")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise ConfigurationError(f"{_NAME}: optimizer_class must be a subclass of axonhpc.optim.Optimizer "
                                 f"(e.g. optim.SGD), got {optimizer_class!r}")
    return optimizer_class


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8", "replace")[:_REASON_BYTES], dtype=np.uint8).copy()


class _DtypeSlices:
    """One dtype's parameters as a flat vector padded to a multiple of S, and each server's slice of it."""

    def __init__(self, params: List[Any], num_servers: int, ops: FlatOps) -> None:
        self.params = params
        self.ops = ops
        self.layout = FlatLayout([p.data.shape for p in params], params[0].data.dtype, num_servers)
        self.bounds = [self.layout.shard_bounds(s)[:2] for s in range(num_servers)]
        self.length = self.bounds[0][1] - self.bounds[0][0]
        self.xp = ops.xp

    def empty_flat(self) -> Any:
        """A zeroed padded flat vector of this dtype."""
        return self.ops.zeros(self.layout.padded_numel, self.layout.dtype)

    def gather_values(self, out: Any) -> None:
        """The parameters' values into ``out`` (padded flat)."""
        self.ops.pack_padded([p.data for p in self.params], out, self.layout.numel)

    def gather_grads(self, out: Any) -> None:
        """The parameters' gradients (None as zeros) into ``out`` (padded flat)."""
        for p, offset, size in zip(self.params, self.layout.offsets, self.layout.sizes):
            if p.grad is None:
                out[offset:offset + size] = 0
            else:
                out[offset:offset + size] = p.grad.reshape(-1)
        out[self.layout.numel:] = 0

    def scatter_values(self, flat: Any) -> None:
        """``flat``'s first ``numel`` elements into the parameters' ``data``, in place."""
        self.ops.unpack(flat[:self.layout.numel], [p.data for p in self.params])


class ParameterServer:
    """Parameter server training: servers hold the parameter shards and the optimizer, workers compute.

    Built on every rank of ``group``. The last ``num_servers`` ranks are
    servers: each owns one contiguous slice of every dtype's flattened
    parameters and runs ``optimizer_class`` on it. The other ranks are
    workers: they ``pull()`` fresh parameters into their model, run forward
    and backward on their own data, and ``push()`` the gradients (each
    server receives the slice it owns); ``step()`` is ``push()`` then
    ``pull()``. Servers call ``serve()``, which answers the workers until
    every worker has finished (``finish()``, or leaving ``with ps:``).
    See docs/parameter-server.md and the notes in this module.

    A worker's loop::

        with ps:
            if ps.is_server:
                ps.serve()
            else:
                ps.pull()
                for x, y in batches:
                    ps.zero_grad()
                    loss_fn(model(x), y); model.backward(loss_fn.backward())
                    ps.step()
        # here every rank's model holds the final parameters

    ``mode="sync"``: every update averages one gradient from each worker
    (summed in worker order, divided by their number) and a pull after a
    push returns the parameters after that update, so training equals DDP
    over the workers. ``mode="async"``: each gradient is divided by the
    number of workers and applied as it arrives, subject to
    ``max_staleness``: a gradient is applied at most ``max_staleness``
    server updates after the pull it was computed on; pulls (and gradients
    that would overtake older ones) wait as needed to guarantee it.

    Args:
        model: the model (an ``axonhpc.nn.Module``), built on every rank;
            group rank 0's parameter values are copied to every rank.
        group: the process group (None: the current world's); at least 2 ranks.
        num_servers: how many of the group's last ranks are servers, in
            ``[1, group.size - 1]``.
        mode: "sync" or "async".
        max_staleness: async only: the largest number of server updates
            allowed between a worker's pull and the application of the
            gradient computed on it (an int >= 0, or None for no bound).
            Must be 0 in sync mode.
        optimizer_class: an ``axonhpc.optim.Optimizer`` subclass the servers
            run over their slices (``optim.SGD``, ``optim.Adam``); required.
        **optimizer_args: its hyperparameters (``lr=0.1``, ``momentum=0.9``).

    Attributes:
        model: the model.
        group: the process group.
        mode: "sync" or "async".
        max_staleness: the bound (0 in sync mode, None for unbounded async).
        num_servers, num_workers: the role counts.
        server_index: this rank's server number, or None on a worker.
        worker_index: this rank's worker number, or None on a server.
        optimizer: on a server, the optimizer over its slices; None on workers.

    Raises:
        ConfigurationError: a model without parameters, a group of one rank,
            ``num_servers`` outside ``[1, size - 1]``, an unknown mode, a bad
            ``max_staleness``, a missing or unusable optimizer class, or
            hyperparameters the optimizer rejects. Raised on every rank
            before anything is sent.
        UnsupportedDtypeError, NonContiguousBufferError, ReadOnlyBufferError:
            a parameter cannot be sent or received in place.
        TypeError: ``group`` is neither a ProcessGroup nor None.
        NotAMemberError: this rank is not in ``group``.
    """

    def __init__(self, model: Any, group: Any = None, num_servers: int = 1, mode: str = "sync",
                 max_staleness: Optional[int] = 0, *, optimizer_class: Any = None, **optimizer_args: Any) -> None:
        named = list(model.named_parameters()) if hasattr(model, "named_parameters") else None
        if named is None:
            raise ConfigurationError(f"{_NAME} needs an axonhpc.nn.Module, got a {type(model).__name__}")
        if not named:
            raise ConfigurationError(f"{_NAME} needs a model with parameters; {type(model).__name__} has none")
        mode = _parse_mode(mode)
        max_staleness = _check_staleness(mode, max_staleness)
        optimizer_class = _check_optimizer_class(optimizer_class)
        group = resolve_group(group).require_member(_NAME)
        size = group.size
        if size < 2:
            raise ConfigurationError(f"{_NAME} needs a group of at least 2 ranks (1 server and 1 worker), "
                                     f"group {group.name} has {size}")
        if isinstance(num_servers, bool) or not hasattr(num_servers, "__index__") \
                or not 1 <= int(num_servers) <= size - 1:
            raise ConfigurationError(f"{_NAME}: num_servers={num_servers!r} must be an integer between 1 and "
                                     f"the group size - 1 = {size - 1} (at least one rank must be a worker)")
        num_servers = int(num_servers)
        for name, p in named:
            check_array(p.data, f"{_NAME}: parameter {name!r}", writable=True)
        ops = flat_ops_for([p.data for _, p in named], [n for n, _ in named], _NAME)
        by_dtype: Dict[Any, List[Any]] = {}
        for _, p in named:
            by_dtype.setdefault(p.data.dtype, []).append(p)
        slices = [_DtypeSlices(params, num_servers, ops) for params in by_dtype.values()]
        num_workers = size - num_servers
        rank = group.rank
        server_index = rank - num_workers if rank >= num_workers else None
        # The servers' optimizer over their slices; workers build a throwaway one so
        # that bad hyperparameters fail on every rank alike, before anything is sent.
        length = [sl.length if server_index is not None else 1 for sl in slices]
        shards = [Parameter(sl.xp.zeros(n, dtype=sl.layout.dtype)) for sl, n in zip(slices, length)]
        optimizer = optimizer_class(shards, **optimizer_args)

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
        self._slices = slices

        # -- communication starts here --
        self._comm = group.split(0, key=rank)
        self._comm.timeout = group.timeout
        broadcast_arrays([p.data for p in self._params] + [b for _, b in model.named_buffers()], self._comm)
        self._flats = [sl.empty_flat() for sl in slices]
        if server_index is not None:
            for sl, flat, shard in zip(slices, self._flats, shards):
                sl.gather_values(flat)
                start, stop = sl.bounds[server_index]
                shard.data[...] = flat[start:stop]
                shard.grad = sl.xp.zeros_like(shard.data)
            self._server = _ServerLoop(self, shards)
        else:
            self._grad_flats = [sl.empty_flat() for sl in slices]
            self._versions = [0] * num_servers  # version of each server's slice last pulled
            self._pulled = False  # a pull since the last push
            self._closed = False  # DONE or FAILED sent to every server
            self._aborted: Optional[str] = None  # why the servers stopped this worker
            self._counts = {"pushes": 0, "pulls": 0, "pull_wait_s": 0.0}
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
        """The group rank of server ``server`` (``num_workers + server``).

        Raises:
            ConfigurationError: ``server`` is not in ``[0, num_servers)``.
        """
        if isinstance(server, bool) or not hasattr(server, "__index__") or not 0 <= int(server) < self.num_servers:
            raise ConfigurationError(f"{_NAME}: server index {server!r} is out of range [0, {self.num_servers})")
        return self.num_workers + int(server)

    def __repr__(self) -> str:
        role = f"server {self.server_index}" if self.is_server else f"worker {self.worker_index}"
        bound = "" if self.mode == "sync" else f", max_staleness={self.max_staleness}"
        return (f"ParameterServer({role} of {self.num_servers} servers + {self.num_workers} workers, "
                f"mode={self.mode!r}{bound})")

    # -- worker side -------------------------------------------------------------------------------------
    def _require_worker(self, what: str) -> None:
        if self.is_server:
            raise ParameterServerError(f"{_NAME}.{what}() is for workers, but group rank {self.group.rank} is "
                                       f"server {self.server_index}; servers call serve()")
        if self._aborted is not None:
            raise PeerFailedError(self._aborted)
        if self._closed:
            raise ParameterServerError(f"{_NAME}.{what}() on worker {self.worker_index} after finish() or abort()")

    def _send_request(self, server: int, kind: int, version: int = 0, reason: str = "",
                      want_final: bool = False) -> None:
        text = _encode(reason) if reason else None
        header = np.array([kind, version, 0 if text is None else text.size, int(want_final)], dtype=np.int64)
        dst = self.server_rank(server)
        send(header, dst, _TAG_REQUEST, self._comm)
        if text is not None and text.size:
            send(text, dst, _TAG_REASON, self._comm)

    def _receive_reply(self, server: int) -> Tuple[bool, int, str]:
        """One server's answer: (OK?, its version, its reason if it aborted); an OK fills ``_flats``."""
        src = self.server_rank(server)
        header = np.zeros(_HEADER, dtype=np.int64)
        # A reply may be long in coming (a pull waiting for the bound); waiting with a finite
        # (or infinite) limit polls with back-off instead of spinning in MPI_Recv, which on an
        # oversubscribed node would take the core from the very server being waited for.
        timeout = self._comm.effective_timeout()
        irecv(header, src, _TAG_REPLY, self._comm).wait(math.inf if timeout is None else timeout)
        status, version, length = int(header[0]), int(header[1]), int(header[2])
        if status == _OK:
            for sl, flat in zip(self._slices, self._flats):
                start, stop = sl.bounds[server]
                if stop > start:
                    recv(flat[start:stop], src, _TAG_PARAMS, self._comm)
            return True, version, ""
        text = np.zeros(length, dtype=np.uint8)
        if length:
            recv(text, src, _TAG_REASON, self._comm)
        return False, version, text.tobytes().decode("utf-8", "replace")

    def _server_name(self, server: int) -> str:
        return f"parameter server {server} (global rank {self.group.ranks[self.server_rank(server)]})"

    def _stopped_by(self, server: int, reason: str) -> str:
        """Close this worker on every server after ``server`` answered ABORT; the error's text."""
        message = f"{self._server_name(server)} stopped the run: {reason}"
        if not self._closed:
            self._closed = True
            for s in range(self.num_servers):
                self._send_request(s, _FAILED, reason=f"stopped after {message}")
        self._aborted = message
        return message

    def _collect(self, servers: List[int]) -> None:
        """Receive the replies of ``servers`` in order; on an ABORT close everywhere, then raise."""
        failure = None
        for s in servers:
            ok, version, reason = self._receive_reply(s)
            if ok:
                self._versions[s] = version
            elif failure is None:
                failure = self._stopped_by(s, reason)
        if failure is not None:
            raise PeerFailedError(failure)

    def _load_pulled(self) -> None:
        for sl, flat in zip(self._slices, self._flats):
            sl.scatter_values(flat)

    def pull(self) -> None:
        """Fetch the servers' current parameters into the model (in place).

        In sync mode, after a push this waits until the update that includes
        it is applied; in async mode it may wait for the staleness bound.

        Raises:
            ParameterServerError: called on a server, or after ``finish()``.
            PeerFailedError: the servers stopped the run (another rank failed).
        """
        self._require_worker("pull")
        started = time.perf_counter()
        if self.mode == "sync":
            for s in range(self.num_servers):
                self._send_request(s, _PULL)
            self._collect(list(range(self.num_servers)))
        else:  # one server at a time, in order (see the note on deadlock freedom)
            for s in range(self.num_servers):
                self._send_request(s, _PULL)
                self._collect([s])
        self._load_pulled()
        self._pulled = True
        self._counts["pulls"] += 1
        self._counts["pull_wait_s"] += time.perf_counter() - started

    def push(self) -> None:
        """Send the model's gradients: each server gets the slice it owns.

        A parameter whose ``grad`` is None counts as a zero gradient. The
        gradients are not reset; zero them (``ps.zero_grad()``) before the
        next backward.

        Raises:
            ParameterServerError: called on a server, after ``finish()``,
                without a ``pull()`` since the previous push (a gradient must be
                computed on pulled parameters), or with no gradient at all.
            ShapeError: a gradient's shape differs from its parameter's.
            PeerFailedError: the servers stopped the run.
        """
        self._require_worker("push")
        if not self._pulled:
            raise ParameterServerError(f"{_NAME}.push() on worker {self.worker_index} without a pull() since the "
                                       "last push: call ps.pull() before the first forward and use ps.step() "
                                       "(push, then pull) after each backward")
        if all(p.grad is None for p in self._params):
            raise ParameterServerError(f"{_NAME}.push() on worker {self.worker_index}: no parameter has a "
                                       "gradient; run backward first")
        for i, p in enumerate(self._params):
            if p.grad is not None and tuple(p.grad.shape) != tuple(p.data.shape):
                raise ShapeError(f"{_NAME}.push: parameter {i} has a gradient of shape {tuple(p.grad.shape)}, "
                                 f"the parameter has {tuple(p.data.shape)}")
        for sl, flat in zip(self._slices, self._grad_flats):
            sl.gather_grads(flat)
        for s in range(self.num_servers):
            self._send_request(s, _PUSH, version=self._versions[s])
            dst = self.server_rank(s)
            for sl, flat in zip(self._slices, self._grad_flats):
                start, stop = sl.bounds[s]
                if stop > start:
                    send(flat[start:stop], dst, _TAG_GRAD, self._comm)
        self._pulled = False
        self._counts["pushes"] += 1

    def step(self) -> None:
        """``push()`` the gradients, then ``pull()`` the updated parameters.

        Raises:
            ParameterServerError, ShapeError, PeerFailedError: as ``push`` and ``pull``.
        """
        self.push()
        self.pull()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the model's gradients, as an optimizer's ``zero_grad`` would.

        Args:
            set_to_none: drop the gradient arrays instead of zeroing them.
        """
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def finish(self, pull: bool = True) -> None:
        """Tell every server this worker is done; by default wait for the final parameters.

        Calling it again does nothing.

        Args:
            pull: wait until every worker has finished, then load the
                servers' final parameters into the model. False returns at once.

        Raises:
            ParameterServerError: called on a server.
            PeerFailedError: the run was stopped because another rank failed.
        """
        if self.is_server:
            raise ParameterServerError(f"{_NAME}.finish() is for workers, but group rank {self.group.rank} is "
                                       f"server {self.server_index}; servers call serve()")
        if self._aborted is not None:
            raise PeerFailedError(self._aborted)
        if self._closed:
            return
        for s in range(self.num_servers):
            self._send_request(s, _DONE, want_final=pull)
        self._closed = True
        if pull:
            self._collect(list(range(self.num_servers)))
            self._load_pulled()

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Stop the run because of a failure on this rank; every other rank stops with ``PeerFailedError``.

        On a worker this sends FAILED with ``reason`` to every server and
        returns (nothing, if it already finished). On a server that has not
        served, it answers every worker's next request with ABORT and
        returns once each has stopped (``with ps:`` does this when the block
        raises before ``serve()``).

        Args:
            reason: what went wrong, shown in the other ranks' errors.

        Raises:
            CollectiveTimeoutError: a server waited longer than the group's timeout.
        """
        if self.is_server:
            if not self._served:
                self._served = True
                self._server.run(failure=f"{self._server.name} failed: {reason}")
            return
        if self._closed:
            return
        self._closed = True
        for s in range(self.num_servers):
            self._send_request(s, _FAILED, reason=reason)

    # -- server side ---------------------------------------------------------------------------------------
    def serve(self) -> Dict[str, Any]:
        """Answer the workers until every one has finished; then every rank's model holds the final values.

        Returns:
            ``stats()`` at the end.

        Raises:
            ParameterServerError: called on a worker, or twice.
            PeerFailedError: a worker failed (after every worker has stopped).
            CollectiveTimeoutError: no request arrived within the group's
                timeout (``ax.settings.timeout``) while workers were open; the
                message lists them as ``missing ranks``.
        """
        if not self.is_server:
            raise ParameterServerError(f"{_NAME}.serve() is for servers, but group rank {self.group.rank} is "
                                       f"worker {self.worker_index}; workers call pull(), push() or step(), "
                                       "and finish()")
        if self._served:
            raise ParameterServerError(f"{_NAME}.serve() was already called on server {self.server_index}")
        self._served = True
        self._server.run()
        return self.stats()

    def stats(self) -> Dict[str, Any]:
        """This rank's counters, as plain data.

        Returns:
            On a server: ``role`` "server", ``server_index``, ``mode``,
            ``max_staleness``, ``version`` (updates applied), ``gradients``
            (gradients applied), ``max_staleness_observed``,
            ``staleness_histogram`` (staleness -> count), per-worker lists
            ``pushes``, ``pulls``, ``applied``, and ``deferred_pulls`` (pulls
            that had to wait), ``deferred_gradients`` (gradients that waited
            in the buffer), ``failure`` (None or why the run stopped).
            On a worker: ``role`` "worker", ``worker_index``, ``mode``,
            ``pushes``, ``pulls``, ``versions`` (of each server's slice last
            pulled), ``pull_wait_s`` (seconds spent in pulls).
        """
        if self.is_server:
            return self._server.stats()
        return {"role": "worker", "worker_index": self.worker_index, "mode": self.mode,
                "pushes": self._counts["pushes"], "pulls": self._counts["pulls"],
                "versions": list(self._versions), "pull_wait_s": self._counts["pull_wait_s"]}

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
                except Exception:  # noqa: BLE001 - the original exception is the one to see
                    pass
        elif not self._closed:
            try:
                self.abort(reason)
            except Exception:  # noqa: BLE001 - the original exception is the one to see
                pass
        return False


class _ServerLoop:
    """One server's state and its request loop (see the module notes)."""

    def __init__(self, ps: ParameterServer, shards: List[Parameter]) -> None:
        self.ps = ps
        self.comm = ps._comm
        self.index = ps.server_index
        self.workers = ps.num_workers
        self.shards = shards
        self.sync = ps.mode == "sync"
        self.bound = None if self.sync else StalenessBound(ps.max_staleness)
        self._version = 0  # sync: rounds applied
        self.base = [0] * self.workers  # sync: version each worker last pulled
        self.histogram: Dict[int, int] = {}
        self.max_observed = 0
        self.open = set(range(self.workers))
        self.headers = [np.zeros(_HEADER, dtype=np.int64) for _ in range(self.workers)]
        self.requests: List[Any] = [None] * self.workers
        self.grads = [[sh.data.copy() for sh in shards] for _ in range(self.workers)]  # receive buffers
        self.round: set = set()  # sync: workers whose gradient is in the current update
        self.deferred: List[int] = []  # pulls that wait, in arrival order
        self.finals: List[int] = []  # DONE requests waiting for the final parameters
        self.sends: List[Tuple[Any, Any]] = []  # (Work, buffer) of replies in flight
        self.failure: Optional[str] = None
        self.pushes = [0] * self.workers
        self.pulls = [0] * self.workers
        self.applied = [0] * self.workers
        self.deferred_pulls = 0
        self.deferred_gradients = 0

    @property
    def version(self) -> int:
        """Updates applied so far."""
        return self._version if self.bound is None else self.bound.version

    def _record(self, worker: int, staleness: int) -> None:
        self.applied[worker] += 1
        self.histogram[staleness] = self.histogram.get(staleness, 0) + 1
        self.max_observed = max(self.max_observed, staleness)

    def stats(self) -> Dict[str, Any]:
        return {"role": "server", "server_index": self.index, "mode": self.ps.mode,
                "max_staleness": self.ps.max_staleness, "version": self.version,
                "gradients": sum(self.applied), "max_staleness_observed": self.max_observed,
                "staleness_histogram": dict(sorted(self.histogram.items())),
                "pushes": list(self.pushes), "pulls": list(self.pulls), "applied": list(self.applied),
                "deferred_pulls": self.deferred_pulls, "deferred_gradients": self.deferred_gradients,
                "failure": self.failure}

    def _global(self, worker: int) -> int:
        return self.ps.group.ranks[worker]

    @property
    def name(self) -> str:
        """How messages name this server: "parameter server 0 (global rank 3)"."""
        return f"parameter server {self.index} (global rank {self.ps.group.ranks[self.ps.group.rank]})"

    # -- sending -------------------------------------------------------------------------------------
    def _isend(self, buf: Any, dst: int, tag: int) -> None:
        self.sends.append((isend(buf, dst, tag, self.comm), buf))

    def _reply_ok(self, worker: int) -> None:
        self._isend(np.array([_OK, self.version, 0, 0], dtype=np.int64), worker, _TAG_REPLY)
        for shard in self.shards:
            if shard.data.size:
                self._isend(shard.data.copy(), worker, _TAG_PARAMS)

    def _reply_abort(self, worker: int) -> None:
        text = _encode(self.failure or "")
        self._isend(np.array([_ABORT, self.version, text.size, 0], dtype=np.int64), worker, _TAG_REPLY)
        if text.size:
            self._isend(text, worker, _TAG_REASON)

    def _reap_sends(self) -> None:
        self.sends = [(work, buf) for work, buf in self.sends if not work.is_completed()]

    # -- updates ----------------------------------------------------------------------------------------
    def _apply(self, contributors: List[int], scale: int) -> None:
        """Sum the contributors' gradients in worker order, divide by ``scale``, take one optimizer step."""
        for d, shard in enumerate(self.shards):
            total = shard.grad
            total[...] = self.grads[contributors[0]][d]
            for w in contributors[1:]:
                total += self.grads[w][d]
            total /= scale
        self.ps.optimizer.step()

    def _complete_round(self) -> None:
        """Sync: once every open worker has pushed, apply their mean and answer the waiting pulls."""
        if not self.round or not self.open <= self.round:
            return
        members = sorted(self.round)
        self._apply(members, len(members))
        for w in members:
            self._record(w, self._version - self.base[w])
        self._version += 1
        self.round.clear()
        waiting, self.deferred = self.deferred, []
        for w in sorted(waiting):
            self._sync_reply(w)

    def _apply_ready(self) -> None:
        """Async: apply every buffered gradient the bound allows, oldest first."""
        while True:
            w = self.bound.ready()
            if w is None:
                return
            self._apply([w], self.workers)
            _, staleness = self.bound.apply(w)
            self._record(w, staleness)

    def _answer_deferred(self) -> None:
        """Async: answer the waiting pulls the bound now allows, in arrival order."""
        still = []
        for w in self.deferred:
            if self.bound.can_pull(w):
                self.bound.pull(w)
                self._reply_ok(w)
            else:
                still.append(w)
        self.deferred = still

    # -- requests ----------------------------------------------------------------------------------------
    def _post(self, worker: int) -> None:
        self.requests[worker] = irecv(self.headers[worker], worker, _TAG_REQUEST, self.comm)

    def _sync_reply(self, worker: int) -> None:
        self.base[worker] = self._version
        self._reply_ok(worker)

    def _on_push(self, worker: int, version: int) -> None:
        base = self.base[worker] if self.sync else self.bound.push(worker)
        if base != version:
            raise ParameterServerError(f"server {self.index}: worker {worker} pushed a gradient of version "
                                       f"{version}, its last pull here was version {base}")
        if self.sync:
            self.round.add(worker)
            self._complete_round()
            return
        self._apply_ready()
        if worker in self.bound.buffered():
            self.deferred_gradients += 1
        self._answer_deferred()

    def _on_pull(self, worker: int) -> None:
        if self.sync:
            if worker in self.round:
                self.deferred.append(worker)
                self.deferred_pulls += 1
            else:
                self._sync_reply(worker)
            return
        self.deferred.append(worker)
        self._answer_deferred()
        if worker in self.deferred:
            self.deferred_pulls += 1

    def _on_close(self, worker: int) -> None:
        self.open.discard(worker)
        if self.failure is not None:
            return
        if self.sync:
            self._complete_round()
        else:
            self.bound.close(worker)
            self._apply_ready()
            self._answer_deferred()

    def _start_abort(self, reason: str) -> None:
        """Stop updating; answer every waiting pull and final request with ABORT."""
        if self.failure is not None:
            return
        self.failure = reason
        for w in self.deferred + self.finals:
            self._reply_abort(w)
        self.deferred, self.finals = [], []
        self.round.clear()

    def _handle(self, worker: int) -> None:
        kind, version, length, want_final = (int(v) for v in self.headers[worker])
        if kind == _PUSH:
            for buf in self.grads[worker]:
                if buf.size:
                    recv(buf, worker, _TAG_GRAD, self.comm)
            self._post(worker)
            self.pushes[worker] += 1
            if self.failure is None:
                self._on_push(worker, version)
        elif kind == _PULL:
            self._post(worker)
            self.pulls[worker] += 1
            if self.failure is not None:
                self._reply_abort(worker)
            else:
                self._on_pull(worker)
        elif kind == _DONE:
            if want_final:
                if self.failure is not None:
                    self._reply_abort(worker)
                else:
                    self.finals.append(worker)
            self._on_close(worker)
        elif kind == _FAILED:
            text = np.zeros(length, dtype=np.uint8)
            if length:
                recv(text, worker, _TAG_REASON, self.comm)
            self._start_abort(f"worker {worker} (global rank {self._global(worker)}) failed: "
                              f"{text.tobytes().decode('utf-8', 'replace')}")
            self._on_close(worker)
        else:
            raise ParameterServerError(f"server {self.index}: unknown request kind {kind} from worker {worker}")

    def _loop(self) -> None:
        timeout = self.comm.effective_timeout()
        delay, last = _POLL_MIN, time.monotonic()
        while self.open:
            progressed = False
            for w in range(self.workers):
                work = self.requests[w]
                if work is not None and work.is_completed():
                    self.requests[w] = None
                    self._handle(w)
                    progressed = True
            self._reap_sends()
            now = time.monotonic()
            if progressed:
                delay, last = _POLL_MIN, now
                continue
            if timeout is not None and now - last > timeout:
                missing = sorted(self._global(w) for w in self.open if w not in self.deferred)
                raise CollectiveTimeoutError(
                    f"{self.name} timed out after {timeout:g} s waiting for requests of open workers (those not "
                    f"waiting for a reply themselves); missing ranks: {missing}")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)

    def run(self, failure: Optional[str] = None) -> None:
        """Serve until every worker has sent DONE or FAILED; raise if the run failed."""
        for w in range(self.workers):
            self._post(w)
        if failure is not None:
            self._start_abort(failure)
        own: Optional[BaseException] = None
        while True:
            try:
                self._loop()
                break
            except CollectiveTimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - the workers are told, then it is re-raised
                if own is not None or self.failure is not None:
                    raise
                own = exc
                self._start_abort(f"{self.name} failed: {type(exc).__name__}: {exc}")
        timeout = self.comm.effective_timeout()
        if self.failure is None:
            self._finish()
        for work, _ in self.sends:
            work.wait(timeout)
        self.sends = []
        if own is not None:
            raise own
        if self.failure is not None and failure is None:
            raise PeerFailedError(f"{self.name} stopped: {self.failure}")

    def _finish(self) -> None:
        """Normal end: answer the final pulls, swap slices with the other servers, load the model."""
        for w in self.finals:
            self._reply_ok(w)
        self.finals = []
        ps = self.ps
        for s in range(ps.num_servers):
            if s != self.index:
                for shard in self.shards:
                    if shard.data.size:
                        self._isend(shard.data.copy(), ps.server_rank(s), _TAG_FINAL)
        for sl, flat, shard in zip(ps._slices, ps._flats, self.shards):
            start, stop = sl.bounds[self.index]
            flat[start:stop] = shard.data
        for s in range(ps.num_servers):
            if s != self.index:
                for sl, flat in zip(ps._slices, ps._flats):
                    start, stop = sl.bounds[s]
                    if stop > start:
                        recv(flat[start:stop], ps.server_rank(s), _TAG_FINAL, self.comm)
        for sl, flat in zip(ps._slices, ps._flats):
            sl.scatter_values(flat)


__all__ = ["ParameterServer", "ParameterServerError", "PeerFailedError", "MODES"]
