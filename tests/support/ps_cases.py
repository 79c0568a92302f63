"""ParameterServer cases, written once, run on threads (plain pytest) and on MPI ranks.

Each case names the world sizes it fits (``@fits``); the runners only call
it there, and the case itself skips anywhere else. Sync parity cases train
with the parameter server on each worker's shard of a global batch and
compare every rank's parameters (servers included: they end with the final
values too) with single-process training on the whole batch.
"""
import functools
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.parallel.parameter_server import ParameterServer, ParameterServerError, PeerFailedError
from support.ddp_cases import STEPS, TOL, make_data, make_model, shard, train_reference

ALL_SIZES = (2, 3, 4, 5)
OPTIMIZERS = {  # the hyperparameters of ddp_cases.make_optimizer, as class and arguments
    "sgd": (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": (optim.Adam, dict(lr=1e-2)),
    "default": (None, {}),  # no optimizer_class: the servers run optim.SGD with its defaults
}


def fits(*sizes):
    """Mark a case with the world sizes it runs at; elsewhere it skips."""
    def mark(fn):
        @functools.wraps(fn)
        def case(world):
            if world.world_size not in sizes:
                pytest.skip(f"{fn.__name__} runs at world sizes {sizes}, not {world.world_size}")
            return fn(world)

        case.sizes = sizes
        return case

    return mark


def server_counts(world):
    """The server counts tried at this world size: 1 and 2, leaving at least one worker."""
    return [s for s in (1, 2) if s < world.world_size]


def all_equal_everywhere(model):
    """Every rank of the world holds the same parameters (collective)."""
    mine = np.concatenate([p.data.reshape(-1).astype(np.float64) for p in model.parameters()])
    everyone = ax.all_gather(mine)
    return all(np.array_equal(everyone[0], row) for row in everyone)


def train_sync(world, kind, num_servers, dtype=np.float64, steps=STEPS, build=make_model, data=make_data,
               steps_of=None):
    """Sync PS training; worker w runs ``steps_of(w)`` steps (default ``steps``). Returns (model, ps)."""
    model = build(dtype, seed=0 if world.rank == 0 else 1000 + world.rank)  # rank 0's values must reach all
    cls, kwargs = OPTIMIZERS[kind]
    if cls is not None:
        kwargs = dict(kwargs, optimizer_class=cls)
    ps = ParameterServer(model, num_servers=num_servers, **kwargs)
    loss_fn = nn.CrossEntropyLoss()
    with ps:  # servers serve when the block ends
        if ps.is_worker:
            w, n = ps.worker_index, ps.num_workers
            ps.pull()
            for step in range(steps if steps_of is None else steps_of(w)):
                ps.zero_grad()
                x, y = data(step, dtype)
                loss_fn(model(shard(x, w, n)), shard(y, w, n))
                model.backward(loss_fn.backward())
                ps.step()
    return model, ps


def assert_close(model, reference, tol=None):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.data.dtype == q.data.dtype, name
        tol = TOL[p.data.dtype.type] if tol is None else tol
        np.testing.assert_allclose(p.data, q.data, rtol=tol, atol=tol, err_msg=name)


def _sync_parity(world, kind):
    reference = train_reference(np.float64, kind)
    for num_servers in server_counts(world):
        model, ps = train_sync(world, kind, num_servers)
        assert_close(model, reference)
        stats = ps.stats()
        if ps.is_server:
            assert stats["version"] == STEPS and stats["gradients"] == STEPS * ps.num_workers, stats
            assert stats["staleness_histogram"] == {0: STEPS * ps.num_workers}, stats
            assert stats["pushes"] == stats["applied"] == [STEPS] * ps.num_workers, stats
            assert stats["failure"] is None
        else:
            assert stats["pushes"] == STEPS and stats["pulls"] == STEPS + 1, stats
            assert stats["versions"] == [STEPS] * num_servers, stats


@fits(*ALL_SIZES)
def case_sync_parity_sgd(world):
    _sync_parity(world, "sgd")


@fits(*ALL_SIZES)
def case_sync_parity_adam(world):
    _sync_parity(world, "adam")


@fits(2, 3)
def case_sync_parity_default_optimizer(world):
    # ParameterServer(model) as API.md writes it: the servers run optim.SGD() (lr 1e-3).
    _sync_parity(world, "default")


def _two_dtype_model(dtype=None, seed=0):
    # float32 layers around a float64 one: one flat vector (and one slice per server) per dtype.
    return nn.Sequential(nn.Linear(6, 8, dtype=np.float32, seed=seed), nn.Tanh(),
                         nn.Linear(8, 5, dtype=np.float64, seed=seed + 1), nn.Tanh(),
                         nn.Linear(5, 3, dtype=np.float32, seed=seed + 2))


def _two_dtype_data(step, dtype=None):
    x, y = make_data(step, np.float32)
    return x, y


@fits(*ALL_SIZES)
def case_sync_parity_two_dtypes(world):
    cls, kwargs = OPTIMIZERS["adam"]
    reference = _two_dtype_model()
    opt, loss_fn = cls(reference.parameters(), **kwargs), nn.CrossEntropyLoss()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _two_dtype_data(step)
        loss_fn(reference(x), y)
        reference.backward(loss_fn.backward())
        opt.step()
    for num_servers in server_counts(world):
        model, ps = train_sync(world, "adam", num_servers, build=_two_dtype_model, data=_two_dtype_data)
        assert_close(model, reference, tol=1e-5)  # the float64 layer's inputs and gradients pass through float32


@fits(*ALL_SIZES)
def case_servers_owning_only_padding(world):
    # 2 elements over 2 servers: with weight only (1 element), server 1 holds nothing but padding.
    def tiny(dtype=np.float64, seed=0):
        return nn.Sequential(nn.Linear(1, 1, bias=False, dtype=dtype, seed=seed), nn.Linear(1, 2, dtype=dtype,
                                                                                              seed=seed + 1))

    def data(step, dtype=np.float64):
        rng = np.random.default_rng(300 + step)
        return rng.standard_normal((24, 1)).astype(dtype), rng.integers(0, 2, 24)

    cls, kwargs = OPTIMIZERS["sgd"]
    reference = tiny()
    opt, loss_fn = cls(reference.parameters(), **kwargs), nn.CrossEntropyLoss()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step)
        loss_fn(reference(x), y)
        reference.backward(loss_fn.backward())
        opt.step()
    for num_servers in server_counts(world):
        model, _ = train_sync(world, "sgd", num_servers, build=tiny, data=data)
        assert_close(model, reference)


@fits(3, 4, 5)
def case_sync_equals_ddp_over_the_workers(world):
    # The server sums the workers' gradients in worker order, as DDP's all-reduce does on threads.
    for num_servers in server_counts(world):
        workers = world.world_size - num_servers
        group = world.new_group(list(range(workers)))
        ddp_model = None
        if group.is_member:
            ddp_model = make_model(np.float64)
            ddp = ax.DDP(ddp_model, group=group)
            cls, kwargs = OPTIMIZERS["sgd"]
            opt, loss_fn = cls(ddp.parameters(), **kwargs), nn.CrossEntropyLoss()
            for step in range(STEPS):
                opt.zero_grad()
                x, y = make_data(step)
                loss_fn(ddp(shard(x, group.rank, workers)), shard(y, group.rank, workers))
                ddp.backward(loss_fn.backward())
                opt.step()
        model, ps = train_sync(world, "sgd", num_servers)
        if ps.is_worker:
            for p, q in zip(model.parameters(), ddp_model.parameters()):
                if world.backend.name == "local":
                    np.testing.assert_array_equal(p.data, q.data)
                else:  # MPI may sum in another order
                    np.testing.assert_allclose(p.data, q.data, rtol=1e-13, atol=1e-13)


@fits(*ALL_SIZES)
def case_sync_workers_with_fewer_steps(world):
    # Worker w stops after STEPS - w steps; each update averages the workers that pushed in it.
    steps_of = lambda w: max(STEPS - w, 2)  # noqa: E731
    for num_servers in server_counts(world):
        workers = world.world_size - num_servers
        reference = make_model(np.float64)
        cls, kwargs = OPTIMIZERS["sgd"]
        opt, loss_fn = cls(reference.parameters(), **kwargs), nn.CrossEntropyLoss()
        for step in range(steps_of(0)):
            opt.zero_grad()
            active = [w for w in range(workers) if steps_of(w) > step]
            x, y = make_data(step)
            for w in active:
                loss_fn(reference(shard(x, w, workers)), shard(y, w, workers))
                reference.backward(loss_fn.backward())
            for p in reference.parameters():
                p.grad /= len(active)
            opt.step()
        model, ps = train_sync(world, "sgd", num_servers, steps_of=steps_of)
        assert_close(model, reference)
        if ps.is_server:
            assert ps.stats()["version"] == steps_of(0)
        assert all_equal_everywhere(model)


def _train_async(world, num_servers, max_staleness, steps_of, pause=0.002):
    """Async SGD, worker w running ``steps_of(w)`` steps at its own pace. Returns (model, ps)."""
    model = make_model(np.float64)
    ps = ParameterServer(model, num_servers=num_servers, mode="async", max_staleness=max_staleness,
                         optimizer_class=optim.SGD, lr=0.05, momentum=0.5)
    loss_fn = nn.CrossEntropyLoss()
    with ps:
        if ps.is_worker:
            w, n = ps.worker_index, ps.num_workers
            ps.pull()
            for step in range(steps_of(w)):
                ps.zero_grad()
                x, y = make_data(step)
                loss_fn(model(shard(x, w, n)), shard(y, w, n))
                model.backward(loss_fn.backward())
                if (step + w) % 3 == 0:
                    time.sleep(pause * (w + 1))  # uneven speeds, so that gradients overtake each other
                ps.step()
    return model, ps


@fits(4, 5)
def case_async_staleness_never_exceeds_the_bound(world):
    steps_of = lambda w: 12 + 4 * w  # noqa: E731 - the fast workers also finish while others still push
    for num_servers in server_counts(world):
        workers = world.world_size - num_servers
        if workers != 3:
            continue
        total = sum(steps_of(w) for w in range(workers))
        for bound in (0, 1, 2, 4):
            model, ps = _train_async(world, num_servers, bound, steps_of)
            stats = ps.stats()
            if ps.is_server:
                assert stats["max_staleness_observed"] <= bound, stats
                assert max(stats["staleness_histogram"]) <= bound, stats
                assert sum(stats["staleness_histogram"].values()) == stats["gradients"] == total, stats
                assert stats["version"] == total, stats
                assert stats["applied"] == stats["pushes"] == [steps_of(w) for w in range(workers)], stats
                if bound == 0:  # one gradient outstanding at a time: it never waits in the buffer
                    assert stats["staleness_histogram"] == {0: total}, stats
                    assert stats["deferred_gradients"] == 0, stats
            else:
                assert stats["pushes"] == steps_of(ps.worker_index), stats
            assert all_equal_everywhere(model)  # every rank ends with the final parameters


@fits(*ALL_SIZES)
def case_async_any_world(world):
    for num_servers in server_counts(world):
        for bound in (0, 1, None):
            model, ps = _train_async(world, num_servers, bound, lambda w: 5 + w, pause=0.0005)
            if ps.is_server:
                stats = ps.stats()
                assert stats["gradients"] == stats["version"] == sum(5 + w for w in range(ps.num_workers))
                assert bound is None or stats["max_staleness_observed"] <= bound
            assert all_equal_everywhere(model)


class Boom(Exception):
    pass


def _failing_run(world, mode, num_servers, failing):
    """Train until ``failing`` raises: "worker" (the last worker, at step 2) or "server" (server 0, at once)."""
    model = make_model(np.float64)
    ps = ParameterServer(model, num_servers=num_servers, mode=mode, max_staleness=0 if mode == "sync" else 1,
                         optimizer_class=optim.SGD, lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    try:
        with ps:
            if failing == "server" and ps.server_index == 0:
                raise Boom("server 0 gives up")
            if ps.is_worker:
                w, n = ps.worker_index, ps.num_workers
                ps.pull()
                for step in range(STEPS):
                    if failing == "worker" and w == n - 1 and step == 2:
                        raise Boom(f"worker {w} gives up")
                    ps.zero_grad()
                    x, y = make_data(step)
                    loss_fn(model(shard(x, w, n)), shard(y, w, n))
                    model.backward(loss_fn.backward())
                    ps.step()
    except Boom as exc:
        return ps, "boom", str(exc)
    except PeerFailedError as exc:
        return ps, "peer", str(exc)
    return ps, "ok", None


@fits(*ALL_SIZES)
def case_worker_failure_stops_every_rank(world):
    for mode in ("sync", "async"):
        for num_servers in server_counts(world):
            ps, outcome, message = _failing_run(world, mode, num_servers, "worker")
            last = ps.num_workers - 1
            cause = f"worker {last} (global rank {last}) failed: Boom: worker {last} gives up"
            if ps.worker_index == last:
                assert outcome == "boom", (outcome, message)
            else:
                assert outcome == "peer" and cause in message, (outcome, message)
            if ps.is_server:
                assert message.startswith(f"parameter server {ps.server_index} (global rank {world.rank}) stopped")
                assert cause in ps.stats()["failure"]
            with pytest.raises(PeerFailedError if ps.is_worker and ps.worker_index != last else ParameterServerError):
                if ps.is_worker:
                    ps.pull()
                else:
                    ps.serve()
            ax.barrier()  # every rank got out: nobody is left waiting, no message is left unmatched


@fits(*ALL_SIZES)
def case_server_failure_stops_every_rank(world):
    for mode in ("sync", "async"):
        for num_servers in server_counts(world):
            ps, outcome, message = _failing_run(world, mode, num_servers, "server")
            server0 = ps.num_workers
            cause = f"parameter server 0 (global rank {server0}) failed: Boom: server 0 gives up"
            if ps.server_index == 0:
                assert outcome == "boom", (outcome, message)
            else:
                assert outcome == "peer" and cause in message, (outcome, message)
            ax.barrier()


@fits(*ALL_SIZES)
def case_worker_abort_without_context_manager(world):
    ps = ParameterServer(make_model(np.float64), mode="async", max_staleness=None, optimizer_class=optim.SGD,
                         lr=0.1)
    if ps.is_server:
        with pytest.raises(PeerFailedError, match=r"worker 0 \(global rank 0\) failed: out of data"):
            ps.serve()
    elif ps.worker_index == 0:
        ps.pull()
        ps.abort("out of data")
        ps.abort("again")  # already closed: nothing more is sent
        with pytest.raises(ParameterServerError, match="after finish"):
            ps.pull()
    else:
        with pytest.raises(PeerFailedError, match="out of data"):
            ps.pull()
            ps.pull()  # an answered pull (before the news) is followed by one that is refused
            ps.finish()
    ax.barrier()


@fits(*ALL_SIZES)
def case_usage_errors_are_local(world):
    model = make_model(np.float64)
    ps = ParameterServer(model, optimizer_class=optim.SGD, lr=0.1)
    if ps.is_server:
        for call in (ps.pull, ps.push, ps.step, ps.finish):
            with pytest.raises(ParameterServerError, match=r"is for workers, but group rank \d+ is server 0"):
                call()
        ps.serve()
        with pytest.raises(ParameterServerError, match="already called"):
            ps.serve()
    else:
        with pytest.raises(ParameterServerError, match="is for servers"):
            ps.serve()
        with pytest.raises(ParameterServerError, match="without a pull"):
            ps.push()
        ps.pull()
        with pytest.raises(ParameterServerError, match="no parameter has a gradient"):
            ps.push()
        model.parameters()[0].grad = np.zeros((2, 2))
        with pytest.raises(ax.errors.ShapeError, match=r"shape \(2, 2\), the parameter has \(16, 6\)"):
            ps.push()
        ps.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        ps.finish()
        ps.finish()  # a second finish does nothing
        with pytest.raises(ParameterServerError, match="after finish"):
            ps.pull()
    ax.barrier()


@fits(*ALL_SIZES)
def case_bad_arguments_raise_before_sending(world):
    size = world.world_size
    model = make_model(np.float64)
    sgd = dict(optimizer_class=optim.SGD, lr=0.1)
    bad = ax.errors.ConfigurationError
    with pytest.raises(bad, match="needs a model with parameters; Sequential has none"):
        ParameterServer(nn.Sequential(nn.ReLU()), **sgd)
    for servers in (0, size, True, "1"):
        with pytest.raises(bad, match=rf"num_servers={servers!r} must be an integer between 1 and the group "
                                      rf"size - 1 = {size - 1}"):
            ParameterServer(model, num_servers=servers, **sgd)
    with pytest.raises(bad, match=r"unknown ParameterServer mode 'hogwild'; use one of \['sync', 'async'\]"):
        ParameterServer(model, mode="hogwild", **sgd)
    with pytest.raises(bad, match=r"max_staleness=2 applies to mode='async' only"):
        ParameterServer(model, max_staleness=2, **sgd)
    with pytest.raises(bad, match=r"max_staleness must be an integer >= 0 \(or None for no bound\), got -1"):
        ParameterServer(model, mode="async", max_staleness=-1, **sgd)
    with pytest.raises(bad, match="got an instance of SGD"):
        ParameterServer(model, optimizer_class=optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(bad, match="subclass of axonhpc.optim.Optimizer"):
        ParameterServer(model, optimizer_class=object)
    with pytest.raises(bad, match="lr=-1 must be >= 0"):
        ParameterServer(model, optimizer_class=optim.SGD, lr=-1)
    with pytest.raises(bad, match=r"SGD takes no hyperparameter 'momentun' \(got momentun=0.9\); it takes "
                                  r"\[.*\]; did you mean 'momentum'\?"):
        ParameterServer(model, optimizer_class=optim.SGD, lr=0.1, momentun=0.9)

    class Picky(optim.SGD):
        def __init__(self, params, lr=0.1, **rest):
            if lr > 1:
                raise ValueError(f"lr={lr} is too large")
            super().__init__(params, lr=lr, **rest)

    with pytest.raises(bad, match=r"Picky\(lr=2\) rejected its hyperparameters: ValueError: lr=2 is too large"):
        ParameterServer(model, optimizer_class=Picky, lr=2)
    ax.barrier()  # every rank got here: nothing was sent by the failed constructors


def _exploding_optimizer(world, failing_rank):
    """SGD whose step raises on group rank ``failing_rank`` (a server: workers never step theirs)."""
    class Exploding(optim.SGD):
        def step(self):
            if world.rank == failing_rank:
                raise Boom(f"optimizer exploded on rank {world.rank}")
            return super().step()

    return Exploding


@fits(3, 4, 5)
def case_server_failure_on_the_last_update_stops_every_rank(world):
    # The last server's optimizer raises on the only update, which the workers' DONE closes or follows: the
    # workers are closed already, so only the servers can tell one another; none may wait for its slices.
    last = world.world_size - 1
    for mode, plan in (("sync", "push"), ("sync", "round_closed_by_done"), ("async", "push")):
        if plan == "round_closed_by_done" and world.world_size - 2 < 2:
            continue  # one worker: without its push there is no update
        model = make_model(np.float64)
        ps = ParameterServer(model, num_servers=2, mode=mode, max_staleness=0 if mode == "sync" else 1,
                             optimizer_class=_exploding_optimizer(world, last), lr=0.05)
        started = time.monotonic()
        outcome, message = "ok", None
        try:
            with ps:
                if ps.is_worker:
                    w, n = ps.worker_index, ps.num_workers
                    ps.pull()
                    if plan == "push" or w != n - 1:  # else the last worker's DONE closes the round
                        loss_fn = nn.CrossEntropyLoss()
                        x, y = make_data(0)
                        loss_fn(model(shard(x, w, n)), shard(y, w, n))
                        model.backward(loss_fn.backward())
                        ps.push()
                    time.sleep(0.05 * w)  # the DONEs arrive after the pushes, one by one
        except Boom as exc:
            outcome, message = "boom", str(exc)
        except PeerFailedError as exc:
            outcome, message = "peer", str(exc)
        cause = f"parameter server 1 (global rank {last}) failed: Boom: optimizer exploded on rank {last}"
        if world.rank == last:
            assert outcome == "boom", (mode, plan, outcome, message)
        else:
            assert outcome == "peer" and cause in message, (mode, plan, outcome, message)
        if ps.server_index == 0:
            assert message.startswith(f"parameter server 0 (global rank {last - 1}) stopped: "), message
            assert cause in ps.stats()["failure"]
        assert time.monotonic() - started < 60, (mode, plan)
        ax.barrier()  # every rank got out: nobody is left waiting, no message is left unmatched


GUARD = 30.0  # seconds: the parameter server's time limit in the cases below, so that a rank left waiting fails them


def _bad_request(ps, server, kind):
    """Send ``server`` a request of a kind the protocol does not have, the way a worker sends its requests.

    No method of the API sends one (and the parameter server's communicator is private): it stands for a corrupt
    request, the one failure a server can meet in its loop after it has stopped updating.
    """
    ps._worker._send_request(server, kind)


def _second_failure_run(world, mode, num_servers, plan):
    """The last server fails, then fails again in its loop: ``plan`` says how (see the case). Returns
    (ps, outcome, the error, seconds from the start until this rank got out)."""
    last = world.world_size - 1
    group = world.default_group
    before = group.timeout
    group.timeout = GUARD  # the parameter server's communicator takes the group's time limit when it is built
    try:
        ps = ParameterServer(make_model(np.float64), num_servers=num_servers, mode=mode,
                             max_staleness=0 if mode == "sync" else None, lr=0.05,
                             optimizer_class=_exploding_optimizer(world, last) if plan == "optimizer" else optim.SGD)
    finally:
        group.timeout = before
    model, loss_fn = ps.model, nn.CrossEntropyLoss()
    started = time.monotonic()
    outcome, error = "ok", None
    try:
        with ps:
            if plan == "aborted" and world.rank == last:
                raise Boom(f"server {ps.server_index} gives up")
            if ps.is_worker:
                w, n = ps.worker_index, ps.num_workers
                bad = ps.num_servers - 1  # the last server
                if w == 0 and plan != "optimizer":
                    for kind in ((98, 99) if plan == "twice" else (99,)):
                        _bad_request(ps, bad, kind)
                if w > 0 and plan == "optimizer":
                    ax.recv(np.zeros(1), src=0)  # worker 0's gradient comes first: the update it makes fails
                ps.pull()
                for step in range(STEPS):
                    ps.zero_grad()
                    x, y = make_data(step)
                    loss_fn(model(shard(x, w, n)), shard(y, w, n))
                    model.backward(loss_fn.backward())
                    ps.push()
                    if w == 0 and step == 0 and plan == "optimizer":
                        _bad_request(ps, bad, 99)  # after the gradient that failed the server's optimizer
                        for other in range(1, n):
                            ax.send(np.ones(1), dst=other)
                    ps.pull()
    except Boom as exc:
        outcome, error = "boom", exc
    except PeerFailedError as exc:
        outcome, error = "peer", exc
    except (ParameterServerError, ax.errors.CollectiveTimeoutError) as exc:
        outcome, error = type(exc).__name__, exc
    return ps, outcome, error, time.monotonic() - started


def _check_second_failure(world, ps, outcome, error, seconds, plan, first):
    """The checks of one run of the case below on this rank (AssertionError)."""
    last = world.world_size - 1
    s = ps.num_servers - 1
    cause = f"parameter server {s} (global rank {last}) failed: {first.format(s=s)}"
    kind99 = "unknown request kind 99 from worker 0 (global rank 0)"
    where = (plan, ps.mode, ps.num_servers, outcome, str(error))
    assert seconds < GUARD, where  # nobody waited for the time limit
    if world.rank == last:  # its first failure, with what followed as a note
        assert outcome == ("ParameterServerError" if plan == "twice" else "boom"), where
        told = "\n".join(getattr(error, "__notes__", []))
        if hasattr(error, "add_note"):
            assert cause in told and kind99 in told, (where, told)
        assert cause in ps.stats()["failure"] and kind99 in ps.stats()["failure"], ps.stats()
    else:
        assert outcome == "peer" and cause in str(error), where
        if ps.is_server:  # the verdict carried both failures
            assert str(error).startswith(f"parameter server {ps.server_index} (global rank {world.rank}) stopped: "), \
                where
            assert kind99 in str(error), where
        elif ps.num_servers == 1 and ps.worker_index == 0:  # its pull came after its request
            assert kind99 in str(error), where


@fits(*ALL_SIZES)
def case_a_second_failure_of_a_server_reaches_every_rank(world):
    # The last server fails (its own code raises before it serves, or its optimizer on the first update, or a
    # corrupt request), and then, while it answers ABORT until every worker has stopped, a corrupt request
    # fails it again. It must go on serving and tell every rank, naming itself and both failures: before, it
    # left at once, and the workers and servers still talking to it waited for their time limit (GUARD).
    last = world.world_size - 1
    for plan, modes in (("aborted", ("sync", "async")), ("optimizer", ("async",)), ("twice", ("sync", "async"))):
        first = {"aborted": "Boom: server {s} gives up", "optimizer": f"Boom: optimizer exploded on rank {last}",
                 "twice": "ParameterServerError: unknown request kind 98 from worker 0 (global rank 0)"}[plan]
        for mode in modes:
            for num_servers in server_counts(world):
                run = _second_failure_run(world, mode, num_servers, plan)
                failed = 1.0
                try:
                    _check_second_failure(world, *run, plan, first)
                    failed = 0.0
                finally:  # every rank stops at the same run, so that no collective is left waiting
                    everywhere = np.array([failed])
                    ax.all_reduce(everywhere)
                if everywhere[0]:
                    raise AssertionError(f"{int(everywhere[0])} other rank(s) failed the checks of {plan}, {mode}, "
                                         f"{num_servers} server(s)")
                ax.barrier()  # every rank got out: nobody is left waiting, no message is left unmatched


def _built(world, model, **kwargs):
    """("ok", ps) or (the error's type, its message) of building a ParameterServer here."""
    try:
        return "ok", ParameterServer(model, **kwargs)
    except (ax.errors.ConfigurationError, ax.errors.UnsupportedDtypeError, ax.errors.ModelMismatchError) as exc:
        return type(exc).__name__, str(exc)


@fits(*ALL_SIZES)
def case_a_refusal_on_one_rank_raises_on_every_rank(world):
    # One rank's local check fails: it raises its own error, every other rank a ModelMismatchError naming it;
    # nobody waits for it in the communicator split.
    odd = world.world_size - 1 if world.world_size > 2 else 1
    here = world.rank == odd
    sgd = dict(optimizer_class=optim.SGD, lr=0.1)
    with_complex = make_model(np.float64)
    if here:
        with_complex.parameters()[0].data = with_complex.parameters()[0].data.astype(np.complex128)
    cases = [  # (model, arguments, the odd rank's error, what its message says)
        (make_model(np.float64), dict(sgd, lr=-1.0 if here else 0.1), "ConfigurationError", "lr=-1.0 must be >= 0"),
        (make_model(np.float64), dict(sgd, momentun=0.9) if here else dict(sgd, momentum=0.9),
         "ConfigurationError", "SGD takes no hyperparameter 'momentun'"),
        (nn.Sequential(nn.ReLU()) if here else make_model(np.float64), sgd, "ConfigurationError",
         "needs a model with parameters"),
        (with_complex, sgd, "UnsupportedDtypeError", "complex128"),
        (make_model(np.float64), dict(sgd, mode="bogus" if here else "sync"), "UnknownChoiceError",
         "unknown ParameterServer mode 'bogus'"),
    ]
    for model, kwargs, error, says in cases:
        kind, message = _built(world, model, **kwargs)
        if here:
            assert kind == error and says in message, (kind, message)
        else:
            assert kind == "ModelMismatchError", (kind, message)
            assert f"rank {odd} could not build it (rank {odd}: {error}: " in message and says in message, message
            assert "nothing else was sent" in message
    ax.barrier()


@fits(*ALL_SIZES)
def case_different_models_or_settings_raise_on_every_rank(world):
    # The same element counts and dtypes would move without a word and train the wrong numbers: every rank
    # raises, naming the first parameter or setting that differs and every rank's value.
    size = world.world_size
    odd = size - 1 if size > 2 else 1
    here = world.rank == odd
    others = [r for r in range(size) if r != odd]
    who = f"{'ranks ' + str(others) if len(others) > 1 else 'rank ' + str(others[0])}"

    def linear(fan_in, fan_out, dtype=np.float32):
        return nn.Sequential(nn.Linear(fan_in, fan_out, bias=False, dtype=dtype, seed=0))

    sgd = dict(optimizer_class=optim.SGD, lr=0.1)
    cases = [  # (model, arguments, the difference as the message shows it)
        (linear(6, 4) if here else linear(4, 6), sgd,
         f"parameter '0.weight' (position 0, shown as name:dtype:shape): {who} "
         f"{'have' if len(others) > 1 else 'has'} 0.weight:float32:(6, 4); rank {odd} has 0.weight:float32:(4, 6)"),
        (linear(4, 6, np.float64 if here else np.float32), sgd,
         f"rank {odd} has 0.weight:float64:(6, 4)"),
        (linear(4, 6), dict(sgd, mode="async", max_staleness=1) if here else sgd,
         f"'mode': {who} {'have' if len(others) > 1 else 'has'} mode: 'sync'; rank {odd} has mode: 'async'"),
        (linear(4, 6), dict(sgd, mode="async", max_staleness=2 if here else 1),
         f"'max_staleness': {who} {'have' if len(others) > 1 else 'has'} max_staleness: 1; "
         f"rank {odd} has max_staleness: 2"),
        (linear(4, 6), dict(sgd, lr=0.2 if here else 0.1),
         f"'optimizer lr': {who} {'have' if len(others) > 1 else 'has'} optimizer lr: 0.1; rank {odd} has optimizer "
         f"lr: 0.2"),
        (linear(4, 6), dict(optimizer_class=optim.Adam if here else optim.SGD, lr=0.1),
         f"rank {odd} has optimizer: axonhpc.optim.adam.Adam"),
    ]
    if size > 2:
        cases.append((linear(4, 6), dict(sgd, num_servers=2 if here else 1),
                      f"'num_servers': {who} have num_servers: 1; rank {odd} has num_servers: 2"))
    for model, kwargs, says in cases:
        kind, message = _built(world, model, **kwargs)
        assert kind == "ModelMismatchError", (kind, message)
        assert f"the {size} ranks hold different models; the first difference is " in message, message
        assert says in message, (says, message)
        assert "nothing else was sent" in message, message
    ax.barrier()


@fits(*ALL_SIZES)
def case_private_communicator(world):
    # The caller's own message on the same group, with the tag the PS uses for requests, is not taken by it.
    model = make_model(np.float64)
    ps = ParameterServer(model, optimizer_class=optim.SGD, lr=0.1)
    last = world.world_size - 1
    if world.rank == 0:
        ax.send(np.arange(5, dtype=np.int64), dst=last, tag=1)
    with ps:
        if ps.is_worker:
            ps.pull()
            loss_fn = nn.CrossEntropyLoss()
            x, y = make_data(0)
            loss_fn(model(x), y)
            model.backward(loss_fn.backward())
            ps.step()
    if world.rank == last:
        got = np.zeros(5, dtype=np.int64)
        ax.recv(got, src=0, tag=1)
        assert np.array_equal(got, np.arange(5))
    assert all_equal_everywhere(model)


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
