"""ParameterServer: the cases of ps_cases.py on threads (worlds 2-5) and MPI ranks, the staleness rule
without communication, and the digits task in async mode."""
import importlib.util
import inspect
import os
import random
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import optim
from axonhpc.parallel import parameter_server as ps_module
from axonhpc.parallel.parameter_server import ParameterServer, ParameterServerError, PeerFailedError
from axonhpc.parallel.parameter_server import StalenessBound
from support.ddp_cases import make_model
from support.paths import ROOT
from support.ps_cases import CASES
from support.runner import case_tests

test_ps_case_local, test_ps_case_mpi = case_tests(CASES, sizes=lambda case: CASES[case].sizes, min_size=2,
                                                  threads_marks=[pytest.mark.timeout(120)],
                                                  mpi_marks=[pytest.mark.timeout(300)])


# -- the staleness rule, without communication ------------------------------------------------------------
def test_bound_zero_lets_one_worker_compute_at_a_time():
    b = StalenessBound(0)
    assert b.can_pull(0) and b.pull(0) == 0
    assert not b.can_pull(1)  # one gradient outstanding already
    assert b.push(0) == 0 and b.ready() == 0
    assert b.apply(0) == (None, 0) and b.version == 1
    assert b.can_pull(1) and b.pull(1) == 1


def test_bound_buffers_a_gradient_that_would_overtake_an_old_one():
    b = StalenessBound(1)
    b.pull(0), b.pull(1)  # both on version 0
    b.push(1, "g1")
    assert b.ready() == 1
    assert b.apply(1) == ("g1", 0)  # worker 0's gradient is now 1 update stale: still fine
    b.pull(1)  # version 1; outstanding: 0 (base 0), 1 (base 1)
    b.push(1, "g1'")
    assert b.ready() is None  # applying it would make worker 0's gradient 2 stale
    assert not b.can_pull(1)  # and its next pull waits for it
    assert b.buffered() == [1]
    b.push(0, "g0")
    assert b.ready() == 0 and b.apply(0) == ("g0", 1)
    assert b.ready() == 1 and b.apply(1) == ("g1'", 1)
    assert b.max_observed == 1 and b.histogram == {0: 1, 1: 2}


def test_bound_close_forgets_a_gradient_in_flight_but_keeps_a_buffered_one():
    b = StalenessBound(0)
    b.pull(0)
    b.close(0)
    assert b.outstanding() == {} and b.can_pull(1)
    b.pull(1)
    b.push(1, "g")
    b.close(1)
    assert b.ready() == 1 and b.apply(1) == ("g", 0)


def test_bound_refuses_protocol_violations():
    b = StalenessBound(0)
    with pytest.raises(RuntimeError, match="without pulling"):
        b.push(0)
    b.pull(0)
    with pytest.raises(RuntimeError, match="against the staleness bound"):
        b.pull(1)
    with pytest.raises(RuntimeError, match="no buffered gradient"):
        b.apply(0)
    with pytest.raises(ValueError, match="got -1"):
        StalenessBound(-1)


def _simulate(num_workers, num_servers, bound, steps, rng):
    """The servers' rule with workers that pull from server 0, 1, ... in turn, in a random interleaving.

    Returns the staleness of every applied gradient; fails on a deadlock.
    """
    servers = [StalenessBound(bound) for _ in range(num_servers)]
    waiting = [[] for _ in range(num_servers)]  # pulls waiting, in arrival order
    answered = [set() for _ in range(num_servers)]
    staleness = []

    def settle(s):
        while True:
            w = servers[s].ready()
            if w is None:
                break
            staleness.append(servers[s].apply(w)[1])
        still = []
        for w in waiting[s]:
            if servers[s].can_pull(w):
                servers[s].pull(w)
                answered[s].add(w)
            else:
                still.append(w)
        waiting[s] = still

    def request(w, s):
        waiting[s].append(w)
        settle(s)

    state = {w: ("pull", 0) for w in range(num_workers)}
    pushed = [0] * num_workers
    for w in range(num_workers):
        request(w, 0)
    while True:
        movable = [w for w, st in state.items()
                   if st == "compute" or (st != "done" and st[0] == "pull" and w in answered[st[1]])]
        if not movable:
            assert all(st == "done" for st in state.values()), f"deadlock: {state}"
            break
        w = rng.choice(movable)
        if state[w] == "compute":
            for s in range(num_servers):
                servers[s].push(w)
                settle(s)
            pushed[w] += 1
            state[w] = ("pull", 0)
            request(w, 0)
            continue
        s = state[w][1]
        answered[s].discard(w)
        if s + 1 < num_servers:
            state[w] = ("pull", s + 1)
            request(w, s + 1)
        elif pushed[w] == steps[w]:
            for t in range(num_servers):
                servers[t].close(w)
                settle(t)
            state[w] = "done"
        else:
            state[w] = "compute"
    for server in servers:
        assert server.version == sum(steps) and not server.buffered() and not server.outstanding()
    return staleness


@pytest.mark.parametrize("bound", [0, 1, 2, 4, None])
@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_random_schedules_keep_the_bound_and_never_deadlock(bound, num_servers):
    rng = random.Random(1234 + num_servers)
    worst = 0
    for trial in range(150):
        workers = rng.randint(1, 5)
        steps = [rng.randint(0, 8) for _ in range(workers)]
        staleness = _simulate(workers, num_servers, bound, steps, rng)
        assert len(staleness) == sum(steps) * num_servers
        worst = max([worst] + staleness)
    if bound is not None:
        assert worst <= bound
        if bound > 0:
            assert worst == bound  # the bound is reached, so the check above is not vacuous


# -- arguments and helpers -------------------------------------------------------------------------------
def test_a_group_of_one_rank_is_refused():
    with pytest.raises(ax.errors.ConfigurationError, match="at least 2 ranks .* has 1"):
        ParameterServer(make_model(), group=ax.ProcessGroup.mock(), optimizer_class=optim.SGD, lr=0.1)
    with pytest.raises(ax.errors.ConfigurationError, match="needs an axonhpc.nn.Module, got a list"):
        ParameterServer([1, 2], group=ax.ProcessGroup.mock(), optimizer_class=optim.SGD, lr=0.1)


@pytest.mark.timeout(60)
def test_a_silent_worker_times_the_server_out_naming_it():
    def body(world):
        world.default_group.timeout = 0.3
        ps = ParameterServer(make_model(np.float64), optimizer_class=optim.SGD, lr=0.1)
        if ps.is_server:
            with pytest.raises(ax.errors.CollectiveTimeoutError, match=r"timed out after 0.3 s .* missing ranks: \[1\]"):
                ps.serve()
        elif ps.worker_index == 1:
            time.sleep(1.0)  # says nothing until the server has given up and left
            with pytest.raises(PeerFailedError, match=r"parameter server 0 \(global rank 2\) stopped the run: .* "
                                                      r"CollectiveTimeoutError: timed out after 0.3 s .* missing "
                                                      r"ranks: \[1\]"):
                ps.pull()  # the server's last word answers it, not its own time limit
        else:
            ps.pull()
            ps.finish(pull=False)

    ax.run_local(body, world_size=3)


@pytest.mark.timeout(60)
def test_a_server_that_times_out_answers_the_workers_waiting_for_it():
    # Worker 0's pull waits for the round that worker 1, silent, never completes. The server gives up on worker 1
    # after its time limit and tells worker 0 at once, which would otherwise wait for a time limit of its own.
    def body(world):
        world.default_group.timeout = 5.0 if world.rank == 0 else 0.3  # the server's is the shortest
        ps = ParameterServer(make_model(np.float64), optimizer_class=optim.SGD, lr=0.1)
        started = time.monotonic()
        if ps.is_server:
            with pytest.raises(ax.errors.CollectiveTimeoutError, match=r"timed out after 0.3 s .* missing ranks: \[1\]"):
                ps.serve()
        elif ps.worker_index == 0:
            ps.pull()
            model = ps.model
            model.parameters()[0].grad = np.zeros_like(model.parameters()[0].data)
            with pytest.raises(PeerFailedError, match=r"parameter server 0 \(global rank 2\) failed: "
                                                      r"CollectiveTimeoutError: timed out after 0.3 s .* missing "
                                                      r"ranks: \[1\]"):
                ps.step()  # its pull waits for worker 1's gradient
            assert time.monotonic() - started < 4.0  # told by the server, not by its own time limit
        else:
            ps.pull()
            time.sleep(1.0)  # says nothing until the server has given up and left
            with pytest.raises(PeerFailedError, match=r"CollectiveTimeoutError: timed out after 0.3 s .* missing "
                                                      r"ranks: \[1\]"):
                ps.pull()

    ax.run_local(body, world_size=3)


def test_public_methods_have_docstrings():
    for cls in (ParameterServer, StalenessBound, ParameterServerError, PeerFailedError):
        assert inspect.getdoc(cls), cls
        for name, member in vars(cls).items():
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                assert inspect.getdoc(member), f"{cls.__name__}.{name} has no docstring"
    assert set(ps_module.__all__) >= {"ParameterServer", "ParameterServerError", "PeerFailedError"}


def test_top_level_names_once_exported():
    if "ParameterServer" not in getattr(ax, "_LAZY", {}):
        pytest.skip("axonhpc/__init__.py does not list ParameterServer in _LAZY yet")
    assert ax.ParameterServer is ParameterServer
    assert ax.parallel.PeerFailedError is PeerFailedError


# -- the digits task ---------------------------------------------------------------------------------------
def _example():
    spec = importlib.util.spec_from_file_location("train_digits_ps", os.path.join(ROOT, "examples",
                                                                                  "train_digits_ps.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_digits_async_reaches_95_percent():
    pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn (extra 'examples')")
    example = _example()
    args = example.parse_args(["--quiet"])  # async, 1 server + 3 workers, max staleness 2, 20 epochs
    assert args.mode == "async" and args.max_staleness == 2
    started = time.perf_counter()
    results = ax.run_local(lambda world: example.train(world, args), world_size=4)
    elapsed = time.perf_counter() - started
    workers = [r for r in results if r["role"] == "worker"]
    (server,) = [r for r in results if r["role"] == "server"]
    assert len(workers) == 3
    assert all(r["accuracy"] == workers[0]["accuracy"] for r in workers)  # the same final parameters
    assert workers[0]["accuracy"] >= 0.95, workers[0]["accuracy"]
    stats = server["stats"]
    assert stats["max_staleness_observed"] <= 2 and stats["failure"] is None
    assert stats["gradients"] == sum(r["stats"]["pushes"] for r in workers)
    print(f"digits, async PS on 4 thread ranks: accuracy {workers[0]['accuracy']:.4f} in {elapsed:.1f} s, "
          f"staleness histogram {stats['staleness_histogram']}")


@pytest.mark.timeout(120)
def test_digits_example_sync_and_two_servers():
    pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn (extra 'examples')")
    example = _example()
    for argv, size in ((["--mode", "sync", "--epochs", "2"], 3), (["--num-servers", "2", "--epochs", "2"], 5)):
        results = ax.run_local(lambda world: example.train(world, example.parse_args(argv + ["--quiet"])),
                               world_size=size)
        accuracies = {r["accuracy"] for r in results if r["role"] == "worker"}
        assert len(accuracies) == 1 and accuracies.pop() > 0.5
