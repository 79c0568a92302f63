"""ParameterServer: a server that stops listening before every worker has stopped still tells every rank why.

Two ways a server leaves early, on threads (worlds 2-5) and on MPI ranks:

- it gives a worker up after its time limit (the worker said nothing for that long) and ends its run; the worker
  comes back later (a pull, a push, a finish) and must raise ``PeerFailedError`` naming the server's verdict
  (``CollectiveTimeoutError``, the time limit, the missing rank) at once. Before, its requests went to a server
  that had left: a pull waited for the worker's own time limit (or for good), a finish returned as if all were well.
- a ``KeyboardInterrupt`` raised inside its loop (here by the optimizer, the hook a server runs; a real SIGINT in
  ``test_ps_interrupt_job.py``): the server re-raises it, every worker and the other servers raise
  ``PeerFailedError`` naming it. Before, the workers waited for their time limit.

Each run's checks are made collective, so every rank stops at the same run and no collective is left waiting.
"""
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.parallel.parameter_server import ParameterServer, PeerFailedError
from support.ddp_cases import STEPS, make_data, make_model, shard
from support.ps_cases import ALL_SIZES, fits, server_counts
from support.runner import case_tests

GUARD = 30.0  # seconds: the workers' time limit, so that a worker left waiting fails a case instead of hanging it
LIMIT = 0.5  # seconds: the servers' time limit where they give a worker up


def _build(world, mode, num_servers, server_limit=GUARD, optimizer_class=optim.SGD):
    """A ParameterServer whose communicator takes ``server_limit`` on the server ranks, ``GUARD`` on the workers."""
    group = world.default_group
    before = group.timeout
    group.timeout = server_limit if world.rank >= world.world_size - num_servers else GUARD
    try:
        return ParameterServer(make_model(np.float64), num_servers=num_servers, mode=mode,
                               max_staleness=0 if mode == "sync" else None, optimizer_class=optimizer_class, lr=0.05)
    finally:
        group.timeout = before


def _compute(ps, step):
    model, loss_fn = ps.model, nn.CrossEntropyLoss()
    w, n = ps.worker_index, ps.num_workers
    ps.zero_grad()
    x, y = make_data(step)
    loss_fn(model(shard(x, w, n)), shard(y, w, n))
    model.backward(loss_fn.backward())


def _outcome(run):
    """(what ``run()`` ended with: "ok", "interrupt" or the error's type name; the error or None)."""
    try:
        run()
    except KeyboardInterrupt as exc:
        return "interrupt", exc
    except Exception as exc:  # noqa: BLE001 - the checks say which was expected
        return type(exc).__name__, exc
    return "ok", None


def _everywhere(world, checks, where):
    """Run this rank's ``checks``; raise on every rank if any rank's failed, so every rank stops at the same run."""
    failed = 1.0
    try:
        checks()
        failed = 0.0
    finally:
        everywhere = np.array([failed])
        ax.all_reduce(everywhere)
    if everywhere[0]:
        raise AssertionError(f"{int(everywhere[0])} other rank(s) failed the checks of {where}")
    ax.barrier()  # every rank got out: nobody is left waiting


def _late_worker(ps, back_with):
    """The last worker pulls, then says nothing until the servers have given it up and left, then comes back with
    a step (a push, then a pull) or a finish; the other workers pull and finish at once."""
    ps.pull()
    if ps.worker_index != ps.num_workers - 1:
        ps.finish(pull=False)
        return
    time.sleep(4 * LIMIT)
    if back_with == "step":
        _compute(ps, 0)
        ps.step()
    else:
        ps.finish(pull=False)


@fits(*ALL_SIZES)
def case_a_worker_back_after_the_servers_gave_it_up_hears_their_verdict(world):
    counts = server_counts(world)
    for i, (mode, back_with) in enumerate((("sync", "step"), ("async", "finish"), ("async", "step"))):
        # Each way back with one server count per world size (each wait costs 4 x LIMIT); the world sizes
        # (2-5 here, 2-4 on MPI ranks) between them try every way back with one server and with two.
        for num_servers in (counts[(i + world.world_size) % len(counts)],):
            ps = _build(world, mode, num_servers, server_limit=LIMIT)
            late = ps.num_workers - 1  # group rank = global rank here
            started = time.monotonic()
            outcome, error = _outcome(ps.serve if ps.is_server else lambda: _late_worker(ps, back_with))
            seconds = time.monotonic() - started
            gave_up = (f"timed out after {LIMIT:g} s waiting for requests of open workers (those not waiting for a "
                       f"reply themselves); missing ranks: [{late}]")

            def checks():
                where = (mode, back_with, num_servers, outcome, str(error))
                assert seconds < GUARD, where  # nobody waited for its own time limit
                if ps.is_server:
                    assert outcome == "CollectiveTimeoutError", where
                    name = f"parameter server {ps.server_index} (global rank {world.rank})"
                    assert str(error) == f"{name} {gave_up}", where
                elif ps.worker_index == late:  # server 0's answer comes first, the verdict it left
                    server0 = f"parameter server 0 (global rank {ps.num_workers})"
                    assert outcome == "PeerFailedError", where
                    assert str(error) == (f"{server0} stopped the run: {server0} failed: CollectiveTimeoutError: "
                                          f"{gave_up}"), where
                else:
                    assert outcome == "ok", where

            _everywhere(world, checks, f"{mode}, back with {back_with}, {num_servers} server(s)")


def _interrupting(world, rank):
    """SGD whose step raises KeyboardInterrupt on group rank ``rank`` (a server: workers never step theirs)."""
    class Interrupting(optim.SGD):
        def step(self):
            if world.rank == rank:
                raise KeyboardInterrupt
            return super().step()

    return Interrupting


def _train(ps):
    with ps:  # servers serve when the block ends
        if ps.is_worker:
            ps.pull()
            for step in range(STEPS):
                _compute(ps, step)
                ps.step()


@fits(*ALL_SIZES)
def case_an_interrupted_server_tells_every_rank_and_raises_the_interrupt(world):
    # The last server's optimizer raises KeyboardInterrupt on its first update: the loop ends there. The server
    # must re-raise it and every other rank raise PeerFailedError naming it, well within their time limit.
    last = world.world_size - 1
    for mode in ("sync", "async"):
        for num_servers in server_counts(world):
            ps = _build(world, mode, num_servers, optimizer_class=_interrupting(world, last))
            started = time.monotonic()
            outcome, error = _outcome(lambda: _train(ps))
            seconds = time.monotonic() - started
            s = num_servers - 1
            cause = f"parameter server {s} (global rank {last}) left: KeyboardInterrupt"

            def checks():
                where = (mode, num_servers, outcome, str(error))
                assert seconds < GUARD, where  # nobody waited for its own time limit
                if world.rank == last:
                    assert outcome == "interrupt" and type(error) is KeyboardInterrupt, where
                    assert cause in (ps.stats()["failure"] or ""), ps.stats()
                else:
                    assert outcome == "PeerFailedError" and cause in str(error), where
                    if ps.is_server:  # the other servers: after every worker stopped, with the verdict
                        assert str(error).startswith(f"parameter server 0 (global rank {world.rank}) stopped: "), where

            _everywhere(world, checks, f"{mode}, {num_servers} server(s)")


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items())
         if name.startswith("case_") and hasattr(fn, "sizes")}

test_ps_leaving_case_local, test_ps_leaving_case_mpi = case_tests(
    CASES, sizes=lambda case: CASES[case].sizes, min_size=2, threads_marks=[pytest.mark.timeout(200)],
    mpi_marks=[pytest.mark.timeout(300)])


@pytest.mark.timeout(60)
def test_a_finish_without_pull_on_a_failed_run_raises():
    # Each server answers a DONE now, so a worker that finishes without the final parameters still hears that the
    # run failed (before: finish(pull=False) returned as if all was well, and only the servers raised).
    def body(world):
        ps = _build(world, "async", 1)
        if ps.is_server:
            with pytest.raises(PeerFailedError, match=r"worker 0 \(global rank 0\) failed: out of data"):
                ps.serve()
        elif ps.worker_index == 0:
            ps.pull()
            ax.recv(np.zeros(1), src=1)  # worker 1's pull was answered
            ps.abort("out of data")
            ax.send(np.ones(1), dst=1)  # after its FAILED went out
        else:
            ps.pull()
            ax.send(np.ones(1), dst=0)
            ax.recv(np.zeros(1), src=0)
            with pytest.raises(PeerFailedError, match=r"parameter server 0 \(global rank 2\) stopped the run: "
                                                      r"worker 0 \(global rank 0\) failed: out of data"):
                ps.finish(pull=False)

    ax.run_local(body, world_size=3)
