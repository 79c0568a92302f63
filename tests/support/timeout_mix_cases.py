"""Timeouts that differ between the ranks, refusals under a timeout, and the words of a timed-out wait.

A rank may wait under a timeout while its peers do not (their ``AXONHPC_TIMEOUT``, ``ax.init(timeout=...)``
or ``pg.timeout`` differ). Its calls must still meet theirs: the fused call of ``collectives.carried`` and
the debug fingerprint exchange are the same kind of MPI call on every rank whatever its timeout. Its
arrival notices go unanswered: that costs one wait of a few seconds, once, not one per call. A rank that
refuses a call under the timeout every rank has announces it like the others, so nobody waits for its
notice or warns of a timeout that differs. A wait that times out on a group without a timeout names the
call. Run on MPI ranks with shared memory off, where MPI carries every call
(``tests/collectives/test_timeout_mix.py``); the last case on threads too.
"""
import contextlib
import logging
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.collectives import watch
from axonhpc.errors import CollectiveRefusedError, CollectiveTimeoutError, ReadOnlyBufferError
from support.settings_override import override

STALL = 2.5  # seconds: a call that takes this long waited for a notice (the drain's patience is 5 s)


@contextlib.contextmanager
def _timed_on(world, timed, seconds=60.0, debug=None):
    """The world's group under a timeout of ``seconds`` on this rank if ``timed`` (none elsewhere, whatever
    ``AXONHPC_TIMEOUT`` says), and debug mode ``debug``, for a ``with`` block."""
    pg = world.default_group
    saved = (pg.timeout, pg.debug)
    try:
        with override(timeout=None):
            pg.timeout = seconds if timed else None
            pg.debug = debug
            yield pg
    finally:
        pg.timeout, pg.debug = saved


def _small_all_reduces(world, calls=8, async_rank=None):
    """``calls`` all-reduces of 16 float32 (carried in one fused call from the third on), each exact."""
    n = world.world_size
    for k in range(calls):
        x = np.full(16, world.rank + 1.0 + k, dtype=np.float32)
        if world.rank == async_rank:
            ax.all_reduce(x, async_op=True).wait()
        else:
            ax.all_reduce(x)
        assert (x == sum(r + 1.0 + k for r in range(n))).all(), (k, x[:2])


def case_small_all_reduces_meet_when_only_the_first_rank_times_out(world):
    # The fused call was MPI_Allreduce without a timeout and MPI_Iallreduce under one: they never met.
    with _timed_on(world, world.rank == 0, seconds=20.0):
        _small_all_reduces(world)
        _small_all_reduces(world, async_rank=world.world_size - 1)
    with _timed_on(world, world.rank != 0, seconds=20.0):  # and the other way round
        _small_all_reduces(world)
        assert (ax.all_gather(np.full(2, world.rank)) == np.arange(world.world_size)[:, None]).all()


def case_small_all_reduces_meet_when_messages_are_capped_and_only_the_first_rank_times_out(world):
    # With max_message_elements below the agreement check's nine words, the timed rank sent its check in
    # chunks and the untimed ranks in one message: the calls paired wrongly (a wrong sum, then a hang).
    n = world.world_size
    with _timed_on(world, world.rank == 0, seconds=20.0), override(max_message_elements=8):
        for k in range(8):
            x = np.full(24, world.rank + 1.0 + k, dtype=np.float32)
            ax.all_reduce(x)
            assert (x == sum(r + 1.0 + k for r in range(n))).all(), (k, x[:2])


def case_debug_exchange_meets_when_only_the_first_rank_times_out(world):
    # The debug fingerprint exchange was MPI_Allgather without a timeout and MPI_Iallgather under one.
    with _timed_on(world, world.rank == 0, seconds=20.0, debug=True):
        _small_all_reduces(world, calls=3)
        x = np.full(3, float(world.rank))
        ax.broadcast(x, src=world.world_size - 1)
        assert (x == world.world_size - 1).all()


def case_a_peer_without_a_timeout_is_waited_for_once_only(world):
    # Rank 0 waits for the notices of ranks that send none once (5 s at most), then never again. Every
    # notice used to be drained twice per call (agreement check, then call), the second drain taking a
    # cancelled receive for a notice: the next call waited the 5 s again.
    n = world.world_size
    with _timed_on(world, world.rank == 0):
        taken = []
        for k in range(5):  # alternating kinds: the group never expects the next call (no fused call)
            start = time.monotonic()
            if k % 2:
                x = np.full(3, float(world.rank))
                ax.broadcast(x, src=n - 1)
                assert (x == n - 1).all()
            else:
                x = np.ones(16, dtype=np.float32)
                ax.all_reduce(x)
                assert (x == n).all()
            taken.append(time.monotonic() - start)
        if world.rank == 0:  # the first call may wait once (if no earlier call did on this communicator)
            assert max(taken[1:]) < STALL, f"a call waited for notices again: {taken}"


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.texts = []

    def emit(self, record):
        self.texts.append(record.getMessage())


def _refuse_on_last_rank(world, async_op):
    """An all-reduce whose buffer is read-only on the last rank alone; returns the seconds it took here."""
    x = np.ones(10)
    refusing = world.rank == world.world_size - 1
    x.flags.writeable = not refusing
    start = time.monotonic()
    with pytest.raises(ReadOnlyBufferError if refusing else CollectiveRefusedError) as info:
        work = ax.all_reduce(x, async_op=async_op)
        if async_op:
            work.wait()
    if not refusing:
        assert f"rank {world.world_size - 1} refused" in str(info.value), str(info.value)
        assert (x == 1).all()
    return time.monotonic() - start


def case_a_refusal_under_the_same_timeout_everywhere_is_heard_at_once(world):
    # The refusing rank sent no arrival notice for the call: the others waited 5 s for it, warned that its
    # timeout was off, and named the exchange that explains the refusal a "debug fingerprint exchange".
    labels = []
    waited = watch.wait

    def wait(work, timeout, label, *rest):
        labels.append(str(label))
        return waited(work, timeout, label, *rest)

    handler = _Warnings()
    logger = logging.getLogger(watch.__name__)
    logger.addHandler(handler)
    watch._warned.clear()  # warned once per group: a warning of an earlier test must not hide this one
    watch.wait = wait
    try:
        with _timed_on(world, True):
            ax.barrier()
            taken = [_refuse_on_last_rank(world, async_op) for async_op in (False, True)]
            _small_all_reduces(world, calls=3)
    finally:
        watch.wait = waited
        logger.removeHandler(handler)
    assert not handler.texts, handler.texts
    assert max(taken) < STALL, f"a refusal was heard late: {taken}"
    assert not [text for text in labels if "debug" in text], labels


def case_a_timed_out_wait_names_the_call(world):
    # Work.wait(timeout) on a group without a timeout: the message named an "operation" (what the backend knows
    # of the missing ranks follows: over MPI, nothing without notices).
    n = world.world_size
    with _timed_on(world, False):
        x = np.full(1000, float(world.rank + 1))
        if world.rank == n - 1:
            time.sleep(1.5)
        work = ax.all_reduce(x, async_op=True)
        if world.rank == 0:
            with pytest.raises(CollectiveTimeoutError) as info:
                work.wait(timeout=0.3)
            text = str(info.value)
            for piece in ("all_reduce #", f"on group {world.default_group.name}", "float64", "(1000,)",
                          "timed out after 0.3 s", "missing ranks: "):
                assert piece in text, f"{piece!r} not in {text!r}"
            assert "operation" not in text, text
        work.wait()
        assert (x == n * (n + 1) / 2).all()


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}
