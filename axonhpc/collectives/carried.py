"""A small all-reduce that carries its own agreement check over MPI: one call instead of two.

[Note: a check that rides with the data]
Over MPI the agreement check is a 64-byte all-reduce in front of the call (ranks that would send
different lengths must meet in a fixed-length message first). For a 4 KiB all-reduce that second
latency was +60-70%.

But every rank has seen the same agreed calls in the same order, so a rule that predicts the next
call from them predicts the same call everywhere (``Predictor``). When it expects a small host
all-reduce (at most ``MAX_BYTES``, an op MPI reduces natively), every rank makes one all-reduce of
that length plus one element, its vote, whatever it was asked: "yes" and its data if its call is
the expected one and can be carried, else "no" and zeros. The vote is reduced with the data's own
op in values whose result shows exactly whether all said yes (SUM: 1/0; MIN, PRODUCT: 1/0; MAX:
0/1). All yes: the calls agree and the data is reduced. Otherwise every rank learns the same, drops
the buffer (the caller's array untouched) and makes the ordinary check and call. MPI always sees
one length on every rank, and one kind of call: the fused call is an ``MPI_Iallreduce`` on every rank,
waited for at once without a timeout and polled under one, since MPI never matches it with a blocking
``MPI_Allreduce`` and the ranks' timeouts may differ ([Note: blocking and nonblocking twins] in
``agreement``). Measured at 2 ranks under MPICH here: no slower than a blocking fused call up to 1 KiB,
about 1.1-1.4 us slower from 4 KiB to 64 KiB (docs/performance.md).

The rule: the call that followed the same three agreed calls before, with a small confidence so
one surprise (a loop's end) does not unlearn it. A wrong guess costs one extra small all-reduce; a
repeating loop is carried from its third pass. After a mismatch every rank forgets everything.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from .._ext import _shm
from ..backends import base as backend_base
from ..backends.base import ReduceOp
from . import watch

MAX_BYTES = 64 * 1024  # the largest call carried: above it the check is a few percent (docs/performance.md)
_LIMIT = 4096  # calls remembered; past it the rule starts afresh (on every rank at the same call)
_BUFFER_BYTES = 8 << 20  # fused buffers kept per group, at most
_MISSES = 64  # wrong guesses allowed before a call that is guessed wrong a quarter of the time is given up
_KIND = _shm.KINDS["all_reduce"]
_DTYPES = {_shm.dtype_code(np.dtype(t)): np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64)}
# op code in a descriptor -> (op, yes, no, all-yes as a function of the group size)
_VOTES = {
    _shm.DESC_OPS["SUM"]: (ReduceOp.SUM, 1, 0, lambda n: n),
    _shm.DESC_OPS["PRODUCT"]: (ReduceOp.PRODUCT, 1, 0, lambda n: 1),
    _shm.DESC_OPS["MIN"]: (ReduceOp.MIN, 1, 0, lambda n: 1),
    _shm.DESC_OPS["MAX"]: (ReduceOp.MAX, 0, 1, lambda n: 0),
}


class Plan:
    """One agreed call as the rule knows it: carriable or not, and the fused buffer when it is."""

    __slots__ = ("desc", "carriable", "declined", "dtype", "count", "op", "yes", "no", "all_yes", "buf", "reduce",
                 "shape")

    def __init__(self, desc: tuple, size: int):
        self.desc = desc
        self.declined = False  # expected, made by every rank, but some rank could not carry it
        w0, count = desc[0], desc[1]
        dtype = _DTYPES.get(w0 >> 8)
        votes = _VOTES.get((w0 >> 4) & 15)
        self.carriable = (w0 & 15 == _KIND and dtype is not None and votes is not None
                          and 0 < count and count * dtype.itemsize <= MAX_BYTES and size < 1 << 24)
        self.dtype, self.count = dtype, count
        self.op, self.yes, self.no, all_yes = votes if votes is not None else (None, 0, 0, lambda n: 0)
        self.all_yes = all_yes(size)
        self.buf = self.reduce = None
        self.shape: Optional[tuple] = None  # the caller's shape whose descriptor this is, once seen

    def matches(self, x: np.ndarray, op: ReduceOp) -> bool:
        """True if an in-place all-reduce of ``x`` with ``op`` is this call (without computing its descriptor)."""
        return x.shape == self.shape and x.dtype is self.dtype and op is self.op


class Predictor:
    """The rule of the note: the next call expected from the group's last three agreed calls."""

    __slots__ = ("size", "key", "after", "plans", "tries", "misses", "buffered")

    def __init__(self, size: int):
        self.size = size
        self.key: Tuple[Any, ...] = (None, None, None)  # the plans of the last three agreed calls
        self.after: Dict[tuple, list] = {}  # key -> [the call expected after it, confidence 0..3]
        self.plans: Dict[tuple, Plan] = {}  # descriptor -> plan
        self.tries = self.misses = 0  # fused calls made, and those that carried nothing
        self.buffered: list = []  # the plans that hold a fused buffer

    def buffer(self, plan: Plan, host: Any) -> np.ndarray:
        """``plan``'s fused buffer (vote, then data), made on first use with its reducer (an ``MPI_Iallreduce`` and
        its wait, which meets the polled one of a rank under a timeout: see the module note).

        At most ``_BUFFER_BYTES`` are kept; past that all are dropped and remade when next used (they are
        this rank's alone; the ranks need not agree about them).
        """
        if plan.buf is None:
            if (len(self.buffered) + 1) * (MAX_BYTES + 8) > _BUFFER_BYTES:
                for held in self.buffered:
                    held.buf = held.reduce = None
                self.buffered.clear()
            plan.buf = np.zeros(plan.count + 1, dtype=plan.dtype)
            plan.reduce = host.reducer(plan.buf, plan.op, nonblocking=True)
            self.buffered.append(plan)
        return plan.buf

    def expected(self) -> Optional[Plan]:
        """The call to carry next, or None when none is expected (or it is not worth a try)."""
        entry = self.after.get(self.key)
        if entry is None:
            return None
        plan = entry[0]
        if not plan.carriable or plan.declined:
            return None
        return plan

    def record(self, desc: tuple, tried: Optional[Plan]) -> None:
        """Every rank agreed on call ``desc``; ``tried``: the plan whose fused call did not carry it, if any."""
        if tried is not None:
            self.tries += 1
            self.misses += 1
            if tried.desc == desc:
                tried.declined = True  # all made the expected call, yet some voted no: they cannot carry it
            elif self.misses > _MISSES and self.misses * 4 > self.tries:
                tried.declined = True  # guesses that fail this often cost more than they save
        plan = self.plans.get(desc)
        if plan is None:
            if len(self.plans) >= _LIMIT:
                self.forget()
            plan = self.plans[desc] = Plan(desc, self.size)
        key = self.key
        entry = self.after.get(key)
        if entry is None:
            self.after[key] = [plan, 1]
        elif entry[0] is plan:
            if entry[1] < 3:
                entry[1] += 1
        elif entry[1] > 0:
            entry[1] -= 1  # a call seen often after this key survives a surprise (the end of a loop)
        else:
            entry[:] = [plan, 1]
        self.key = (key[1], key[2], plan)

    def carried(self, plan: Plan) -> None:
        """Every rank agreed on the expected call ``plan``: the fused call carried it."""
        self.tries += 1
        key = self.key
        entry = self.after[key]
        if entry[1] < 3:
            entry[1] += 1
        self.key = (key[1], key[2], plan)

    def forget(self) -> None:
        """The ranks disagreed: start afresh (every rank does, at the same call)."""
        self.key = (None, None, None)
        self.after.clear()
        self.plans.clear()
        self.buffered.clear()


def attempt(pg: Any, predictor: Predictor, desc: tuple, carry: Optional[Tuple[np.ndarray, ReduceOp]],
            timeout: Optional[float], what: Any, arrivals: Any) -> Tuple[bool, Optional[Plan]]:
    """Make the fused call when one is expected: ``(carried, plan tried)``.

    ``carry``: this rank's in-place all-reduce ``(x, op)`` when it can go in the fused call (else it
    votes no). Without an expected call nothing is sent: ``(False, None)``.
    """
    plan = predictor.expected()
    if plan is None:
        return False, None
    host = pg.backend.host_side()
    buf = predictor.buffer(plan, host)
    x = None
    if carry is not None and desc == plan.desc:
        x, op = carry
        if isinstance(x, np.ndarray) and x.dtype == plan.dtype and op is plan.op and x.flags.c_contiguous:
            plan.shape = x.shape
        else:
            x = None  # a device array, say: it votes no
    vote = plan.no if x is None else plan.yes
    if timeout is None and backend_base.PROGRESS[0] is None:
        done = _shm.carry(buf, x, plan.reduce, vote, plan.all_yes)
    else:
        _shm.carry_in(buf, x, vote)
        work = host.all_reduce(buf, plan.op, True)
        if timeout is None:  # polled (agreement's [Note: calls waiting for their check, across groups])
            work.wait()
        else:
            watch.wait(work, timeout, what, arrivals, pg)
        done = _shm.carry_out(buf, x, plan.all_yes)
    if done:
        predictor.carried(plan)
    return done, plan


def vote_no(pg: Any, predictor: Predictor) -> Tuple[Optional[Any], Optional[Plan]]:
    """The fused call of a rank whose call cannot be carried, started and not waited for (an asynchronous call's
    check: ``(Work, plan tried)``; ``(None, None)`` when none is expected). Its vote is no, so it carries nothing
    and its result tells this rank nothing new; its buffer is its own, as it may still be in flight when the plan's
    next fused call is made."""
    plan = predictor.expected()
    if plan is None:
        return None, None
    own = np.zeros(plan.count + 1, dtype=plan.dtype)
    _shm.carry_in(own, None, plan.no)
    return pg.backend.host_side().all_reduce(own, plan.op, True), plan


def quick(pg: Any, predictor: Predictor, x: np.ndarray, op: ReduceOp) -> Tuple[bool, Optional[Plan]]:
    """``attempt`` for the fast path's blocking all-reduce, when the expected call is ``x``'s as seen before.

    Returns ``(False, None)`` having sent nothing when it is not known to be this one (then
    ``attempt`` decides, from the descriptor).
    """
    entry = predictor.after.get(predictor.key)  # expected(), inline
    if entry is None:
        return False, None
    plan = entry[0]
    if plan.declined or plan.buf is None or not plan.matches(x, op):
        return False, None
    done = _shm.carry(plan.buf, x, plan.reduce, plan.yes, plan.all_yes)
    if done:
        predictor.carried(plan)
    return done, plan


__all__ = ["MAX_BYTES", "Plan", "Predictor", "attempt", "quick"]
