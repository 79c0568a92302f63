"""Seeded random programs of collectives over several groups, valid by MPI's rules, with every result checked.

``generate(seed, world_size)`` makes the same ``Program`` on every rank: groups (the world, ``new_group``
subgroups, overlapping ones, splits of the world and of subgroups), then a sequence of calls (all-reduce of
every op, broadcast from varying roots, all-gather with and without ``out=``, reduce-scatter, gather,
scatter, barrier, messages), of random sizes (tiny, one element, odd, across the engine's slot and across
``shm_allgather_max_bytes``) and dtypes. Each rank makes each call blocking or nonblocking on its own (mixed
ways), waits for its nonblocking calls later in its own random order, and may enter two groups' calls in an
order other ranks do not, where MPI guarantees progress.

[Note: which programs are valid]
Every group's calls are issued in one order by all of its members (two calls of one group are never
reordered on a rank; a message counts as a call of its group). Each rank's sequence of events (issue a call,
nonblocking or blocking; wait for a call) is then checked by ``deadlock_free``, which plays the program as MPI
may run it at its most synchronising: a blocking call or a wait returns only once every member of the call
(both ends of a message) has issued it, and issuing a nonblocking call never waits. A rank's reordering of
two groups' calls that could deadlock under that rule (two blocking calls in opposite orders) is drawn again;
failing that, the rank keeps the common order, which is always deadlock free. A program that passes may be
run by any correct MPI and must complete.

Inputs are small integers (``_values``), so sums, products, maxima and minima are exact in every dtype
(float16 included); a mean is compared as the library documents it (the floor of the exact mean for
integers, the correctly rounded quotient, within a dtype's rounding, for floats).

``run_program(world, seed)`` runs it on one rank of ``world`` (threads or MPI). More seeds for exploration:
``AXONHPC_FUZZ_SEEDS`` (see ``tests/collectives/test_fuzz_programs.py``).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

import axonhpc as ax

DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16)
OPS = ("sum", "mean", "min", "max", "product")
SLOT_BYTES = 256 << 10  # settings.shm_slot_bytes: one slot of the engine's segment (its chunk)
SLOTS = 4  # settings.shm_slots
ALLGATHER_MAX = 256 << 10  # settings.shm_allgather_max_bytes: larger all-gather results go over MPI


# Exploration only (never set by the tests): ``AXONHPC_FUZZ_AVOID=same-group-pending`` makes each rank wait for its
# nonblocking calls of a group before its next call of that group, which steers clear of the hang of a call's
# issue waiting for the check of an earlier call of its group without advancing other groups' calls (so that
# other bugs can be looked for while that one stands). The programs are valid either way.
AVOID_SAME_GROUP_PENDING = "same-group-pending" in os.environ.get("AXONHPC_FUZZ_AVOID", "")
# Exploration only: ``AXONHPC_FUZZ_AVOID=blocking-scatter`` (and so on, comma-separated) makes every scatter
# blocking (a nonblocking scatter waits for the other ranks before it returns).
AVOID_BLOCKING_KINDS = {word[len("blocking-"):] for word in os.environ.get("AXONHPC_FUZZ_AVOID", "").split(",")
                        if word.startswith("blocking-")}
# ``all_gather_mpi``: an all-gather whose result is over ``shm_allgather_max_bytes``.
# ``scatter-alone``: each rank waits for all its nonblocking calls before a scatter.
AVOID_SCATTER_ALONE = "scatter-alone" in os.environ.get("AXONHPC_FUZZ_AVOID", "")


def _avoid_kind(program, call) -> str:
    if call.kind == "all_gather":
        nbytes = len(program.groups[call.gid].ranks) * call.size * max(call.cols, 1) * np.dtype(call.dtype).itemsize
        if nbytes > ALLGATHER_MAX:
            return "all_gather_mpi"
    return call.kind


@dataclass
class Group:
    """A group of the program: ``ranks`` are global ranks in group-rank order."""

    gid: int
    ranks: Tuple[int, ...]


@dataclass
class Make:
    """The making of groups: ``new_group(ranks)`` over the world, or ``parent.split(color, key)`` over the parent."""

    kind: str  # "new" or "split"
    parent: int  # the group the call is collective over (0, the world, for "new")
    made: Dict[int, int]  # global rank -> gid of the group it gets (absent: none, a non-member)
    ranks: Tuple[int, ...] = ()  # "new": the list passed
    colors: Dict[int, Optional[int]] = field(default_factory=dict)  # "split"
    keys: Dict[int, int] = field(default_factory=dict)


@dataclass
class Call:
    """One collective (or message) on group ``gid``."""

    cid: int
    gid: int
    kind: str
    size: int = 1
    dtype: type = np.float32
    op: str = "sum"
    root: int = 0  # group rank: broadcast/scatter source, gather destination, message sender
    peer: int = 0  # message receiver (group rank)
    out: bool = False  # all-gather / reduce-scatter with out=
    cols: int = 0  # a second dimension (0: 1-D)
    tag: int = 0
    none_group: bool = False  # the world's call made with group=None


@dataclass
class Program:
    seed: int
    world_size: int
    groups: Dict[int, Group]
    makes: List[Make]
    calls: List[Call]
    # per global rank: events ("make", index) / ("issue", cid, nonblocking) / ("wait", cid) / ("destroy", gid)
    events: Dict[int, List[tuple]]

    def describe(self) -> str:
        lines = [f"seed {self.seed}, world {self.world_size}"]
        for g in self.groups.values():
            lines.append(f"  group {g.gid}: {list(g.ranks)}")
        for c in self.calls:
            lines.append(f"  call {c.cid}: {c.kind} group {c.gid} size {c.size} {np.dtype(c.dtype).name} op {c.op} "
                         f"root {c.root} peer {c.peer} out {c.out} cols {c.cols}")
        for r, evs in self.events.items():
            lines.append(f"  rank {r}: {evs}")
        return "\n".join(lines)


def members(program: Program, event: tuple) -> Tuple[int, ...]:
    """The global ranks an event's call waits for."""
    if event[0] == "make":
        make = program.makes[event[1]]
        return program.groups[make.parent].ranks
    if event[0] == "destroy":
        return program.groups[event[1]].ranks
    call = program.calls[event[1]]
    ranks = program.groups[call.gid].ranks
    if call.kind == "p2p":
        return (ranks[call.root], ranks[call.peer])
    return ranks


def _key(event: tuple) -> tuple:
    return ("call", event[1]) if event[0] in ("issue", "wait") else (event[0], event[1])


def deadlock_free(program: Program, events: Dict[int, List[tuple]]) -> bool:
    """True if every rank gets through its events when a blocking call or wait returns only once every member of
    its call has issued it (see the module note)."""
    issued: Dict[tuple, set] = {}
    pos = {r: 0 for r in events}
    # A blocking issue is an issue followed by a wait; makes and destroys are blocking.
    steps: Dict[int, List[tuple]] = {}
    for r, evs in events.items():
        seq = []
        for e in evs:
            if e[0] == "wait":
                seq.append(("wait", _key(e), members(program, e)))
            else:
                seq.append(("issue", _key(e), None))
                if e[0] != "issue" or not e[2]:
                    seq.append(("wait", _key(e), members(program, e)))
        steps[r] = seq
    moved = True
    while moved:
        moved = False
        for r, seq in steps.items():
            while pos[r] < len(seq):
                what, key, need = seq[pos[r]]
                if what == "issue":
                    issued.setdefault(key, set()).add(r)
                elif not issued.get(key, set()) >= set(need):
                    break
                pos[r] += 1
                moved = True
    return all(pos[r] == len(steps[r]) for r in steps)


# -- sizes and values ---------------------------------------------------------------------------
def _size(rng: random.Random, itemsize: int, kind: str, gsize: int) -> int:
    """A random element count: tiny, odd, across the slot, across the all-gather limit, several slots."""
    slot = SLOT_BYTES // itemsize
    roll = rng.random()
    if roll < 0.25:
        return rng.choice((1, 1, 2, 3, 5))
    if roll < 0.55:
        return rng.randrange(7, 1000, 2)
    if roll < 0.7:
        return rng.randrange(1000, 20000)
    if kind == "all_gather" and roll < 0.85:
        limit = ALLGATHER_MAX // (gsize * itemsize)
        return max(1, limit + rng.choice((-1, 0, 1, 3)))
    if roll < 0.95:
        return slot + rng.choice((-1, 0, 1, 7, rng.randrange(1, slot)))
    return SLOTS * slot + rng.choice((-3, 1, 5))


def _values(cid: int, rank: int, n: int, dtype: type, op: str = "sum") -> np.ndarray:
    """Rank ``rank``'s input of call ``cid``: small integers (a product's are 1, -1 and 2)."""
    i = np.arange(n, dtype=np.int64)
    if op == "product":
        v = np.where((i + rank + cid) % 4 == 0, 2, np.where((i * 3 + rank) % 5 == 0, -1, 1))
    else:
        v = (i * 7 + rank * 13 + cid * 5) % 23 - 11
    return v.astype(dtype)


def _reduced(call: Call, ranks: Tuple[int, ...], n: int) -> np.ndarray:
    """The reduction of the members' inputs, in the call's dtype."""
    stack = np.stack([_values(call.cid, r, n, np.int64, call.op) for r in ranks])
    if call.op == "sum":
        got = stack.sum(0)
    elif call.op == "product":
        got = stack.prod(0)
    elif call.op == "min":
        got = stack.min(0)
    elif call.op == "max":
        got = stack.max(0)
    else:
        total = stack.sum(0)
        if np.issubdtype(call.dtype, np.integer):
            got = np.floor_divide(total, len(ranks))
        else:
            return (total / len(ranks)).astype(np.float64)
    return got.astype(call.dtype)


def _close(got: np.ndarray, want: np.ndarray, call: Call) -> bool:
    if call.op == "mean" and not np.issubdtype(call.dtype, np.integer):
        rtol = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-6}.get(np.dtype(call.dtype), 1e-13)
        return np.allclose(got.astype(np.float64), want, rtol=rtol, atol=rtol)
    return got.dtype == np.dtype(call.dtype) and np.array_equal(got, want)


# -- the program ----------------------------------------------------------------------------------
def generate(seed: int, world_size: int) -> Program:
    """The program of ``seed`` for ``world_size`` ranks (the same on every rank)."""
    rng = random.Random(f"{seed}:{world_size}")
    n = world_size
    groups = {0: Group(0, tuple(range(n)))}
    makes: List[Make] = []
    order: List[tuple] = []  # ("make", i) and ("call", cid), in the common order

    def new_gid() -> int:
        return max(groups) + 1

    def add_new_group():
        size = rng.randint(1 if n == 2 else 2, n)
        ranks = tuple(rng.sample(range(n), size))  # any order: group rank 0 need not be world rank 0
        gid = new_gid()
        groups[gid] = Group(gid, ranks)
        makes.append(Make("new", 0, {r: gid for r in ranks}, ranks=ranks))
        order.append(("make", len(makes) - 1))

    def add_split():
        parents = [g for g in groups.values() if len(g.ranks) >= 2]
        parent = rng.choice(parents)
        ncolors = rng.randint(1, max(1, len(parent.ranks) // 2 + 1))
        colors = {r: (None if rng.random() < 0.15 else rng.randrange(ncolors)) for r in parent.ranks}
        keys = {r: rng.randrange(3) for r in parent.ranks}
        made = {}
        for color in sorted({c for c in colors.values() if c is not None}):
            mine = [r for r in parent.ranks if colors[r] == color]
            mine.sort(key=lambda r: (keys[r], parent.ranks.index(r)))
            gid = new_gid()
            groups[gid] = Group(gid, tuple(mine))
            made.update({r: gid for r in mine})
        makes.append(Make("split", parent.gid, made, colors=colors, keys=keys))
        order.append(("make", len(makes) - 1))

    for _ in range(rng.randint(1, 3)):
        add_new_group()
    for _ in range(rng.randint(0, 2)):
        add_split()

    calls: List[Call] = []
    for _ in range(rng.randint(12, 30)):
        if rng.random() < 0.04:
            (add_new_group if rng.random() < 0.5 else add_split)()  # made while calls are in flight
            continue
        group = rng.choice(list(groups.values()) + [groups[0]])
        gsize = len(group.ranks)
        kinds = ["all_reduce"] * 5 + ["broadcast"] * 2 + ["all_gather"] * 2 + ["reduce_scatter"] * 2 + \
            ["gather", "scatter", "barrier"] + (["p2p"] * 2 if gsize >= 2 else [])
        kind = rng.choice(kinds)
        dtype = rng.choice(DTYPES)
        call = Call(len(calls), group.gid, kind, dtype=dtype, none_group=group.gid == 0 and rng.random() < 0.5)
        itemsize = np.dtype(dtype).itemsize
        call.size = _size(rng, itemsize, kind, gsize)
        call.root = rng.randrange(gsize)
        if kind in ("all_reduce", "reduce_scatter"):
            call.op = rng.choice(OPS)
        if kind == "reduce_scatter":
            call.size = max(1, call.size // gsize)  # each rank's part
        if kind in ("all_gather", "reduce_scatter"):
            call.out = rng.random() < 0.5
        if kind in ("gather", "scatter"):
            call.size = min(call.size, 5000)
        if kind in ("reduce_scatter", "scatter", "all_gather") and rng.random() < 0.2 and call.size < 5000:
            call.cols = rng.choice((2, 3))
        if kind == "p2p":
            call.peer = rng.choice([g for g in range(gsize) if g != call.root])
            call.tag = rng.randrange(4)
        calls.append(call)
        order.append(("call", call.cid))

    program = Program(seed, n, groups, makes, calls, {})
    base = {r: _common_events(program, order, r) for r in range(n)}
    events = None
    for attempt in range(30):
        trial = {r: _varied(rng, program, evs, swaps=attempt < 25) for r, evs in base.items()}
        if deadlock_free(program, trial):
            events = trial
            break
    if events is None:  # the common order with waits put anywhere later is always deadlock free
        raise AssertionError(f"no deadlock-free order found for seed {seed}")
    for r in range(n):  # every group made is destroyed at the end, in one order, by its members
        for gid in sorted(groups):
            if gid != 0 and r in groups[gid].ranks:
                events[r].append(("destroy", gid))
    program.events = events
    assert deadlock_free(program, events), program.describe()
    return program


def _common_events(program: Program, order: List[tuple], r: int) -> List[tuple]:
    """Rank ``r``'s makes and calls in the common order."""
    out = []
    for what, index in order:
        if what == "make":
            if r in program.groups[program.makes[index].parent].ranks:
                out.append(("make", index))
        else:
            call = program.calls[index]
            if r in members(program, ("issue", index, False)):
                out.append(("issue", index, call))
    return out


def _varied(rng: random.Random, program: Program, common: List[tuple], swaps: bool) -> List[tuple]:
    """A rank's events: some adjacent calls of different groups swapped, each call made nonblocking or blocking,
    the waits for the nonblocking ones put later, in a random order."""
    seq = list(common)
    if swaps:
        for _ in range(rng.randrange(len(seq) + 1)):
            if len(seq) < 2:
                break
            i = rng.randrange(len(seq) - 1)
            a, b = seq[i], seq[i + 1]
            if a[0] == "issue" and b[0] == "issue" and a[2].gid != b[2].gid:
                seq[i], seq[i + 1] = b, a
    events: List[tuple] = []
    pending: List[int] = []
    for e in seq:
        if AVOID_SAME_GROUP_PENDING:  # exploration only, see AVOID_SAME_GROUP_PENDING
            gid = e[2].gid if e[0] == "issue" else program.makes[e[1]].parent
            mine = [cid for cid in pending if program.calls[cid].gid == gid]
            rng.shuffle(mine)
            for cid in mine:
                pending.remove(cid)
                events.append(("wait", cid))
        if AVOID_SCATTER_ALONE and e[0] == "issue" and e[2].kind == "scatter":  # exploration only, see there
            rng.shuffle(pending)
            events.extend(("wait", cid) for cid in pending)
            pending.clear()
        if e[0] == "issue":
            nonblocking = rng.random() < 0.5
            if nonblocking and _avoid_kind(program, e[2]) in AVOID_BLOCKING_KINDS:  # exploration only, see there
                nonblocking = False
            events.append(("issue", e[1], nonblocking))
            if nonblocking:
                pending.append(e[1])
        else:
            events.append(e)
        # Some waits now, in a random order.
        rng.shuffle(pending)
        while pending and rng.random() < 0.35:
            events.append(("wait", pending.pop()))
    rng.shuffle(pending)
    events.extend(("wait", cid) for cid in pending)
    return events


# -- running it ------------------------------------------------------------------------------------
class _Failure(AssertionError):
    pass


def run_program(world, seed: int) -> None:
    """Run ``generate(seed, world.world_size)``'s events of this rank; raise on any wrong result."""
    program = generate(seed, world.world_size)
    me = world.rank
    handles = {0: world.default_group}
    pending: Dict[int, tuple] = {}  # cid -> (work, check)
    problems: List[str] = []

    def grp(call: Call):
        return None if call.none_group else handles[call.gid]

    trace = os.environ.get("AXONHPC_FUZZ_TRACE")
    for event in program.events[me]:
        what = event[0]
        if trace:
            print(f"[rank {me}] {event}", flush=True)
        if what == "make":
            make = program.makes[event[1]]
            if make.kind == "new":
                made = world.new_group(list(make.ranks))
            else:
                parent = handles[make.parent]
                color = make.colors[me]
                made = parent.split(color if color is not None else None, make.keys[me])
            if me in make.made:
                handles[make.made[me]] = made
                want = program.groups[make.made[me]].ranks
                if tuple(made.ranks) != want:
                    problems.append(f"make {event[1]}: group ranks {list(made.ranks)}, expected {list(want)}")
        elif what == "destroy":
            handles[event[1]].destroy()
        elif what == "issue":
            call = program.calls[event[1]]
            work, check = _issue(call, program, me, grp(call), event[2])
            if event[2]:
                pending[call.cid] = (work, check)
            else:
                _checked(check, work, call, problems)
        else:
            work, check = pending.pop(event[1])
            got = work.wait()
            _checked(check, got, program.calls[event[1]], problems, waited=True)
    if pending:
        problems.append(f"never waited for {sorted(pending)}")
    if problems:
        raise _Failure(f"rank {me}, seed {seed}, world {world.world_size}: " + "; ".join(problems[:8]))


def _checked(check, got, call: Call, problems: List[str], waited: bool = False) -> None:
    try:
        message = check(got)
    except Exception as exc:  # noqa: BLE001 - a check's own failure is a wrong result too
        message = f"{type(exc).__name__}: {exc}"
    if message:
        how = "waited" if waited else "blocking"
        problems.append(f"call {call.cid} ({call.kind} {np.dtype(call.dtype).name} x{call.size} op {call.op} "
                        f"group {call.gid}, {how}): {message}")


def _differ(got, want) -> str:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    first = bad[0] if len(bad) else 0
    return f"{len(bad)} of {want.size} differ, first at {first}: {got.reshape(-1)[first]!r} != {want.reshape(-1)[first]!r}"


def _issue(call: Call, program: Program, me: int, group, nonblocking: bool):
    """Make ``call`` on this rank: its Work (or blocking result) and a check of the result."""
    ranks = program.groups[call.gid].ranks
    gsize, grank = len(ranks), ranks.index(me)
    kw = {"group": group}
    if nonblocking:
        kw["async_op"] = True
    dtype, n, cid = call.dtype, call.size, call.cid
    shape = (n, call.cols) if call.cols else (n,)
    count = int(np.prod(shape))

    if call.kind == "all_reduce":
        x = _values(cid, me, n, dtype, call.op)
        want = _reduced(call, ranks, n)
        result = ax.all_reduce(x, op=call.op, **kw)
        return result, lambda got: None if _close(x, want, call) else _differ(x, want)

    if call.kind == "reduce_scatter":
        total = gsize * count
        x = _values(cid, me, total, dtype, call.op).reshape((gsize * n,) + shape[1:])
        whole = _reduced(call, ranks, total).reshape((gsize * n,) + shape[1:])
        want = whole[grank * n:(grank + 1) * n]
        out = np.full(shape, 77, dtype=dtype) if call.out else None
        result = ax.reduce_scatter(x, op=call.op, out=out, **kw)

        def check(got):
            if out is not None and got is not out:
                return "the result is not out="
            return None if _close(np.asarray(got), want, call) else _differ(got, want)
        return result, check

    if call.kind == "broadcast":
        root = ranks[call.root]
        want = _values(cid, root, n, dtype)
        x = want.copy() if me == root else np.full(n, 99, dtype=dtype)
        result = ax.broadcast(x, src=call.root, **kw)
        return result, lambda got: None if np.array_equal(x, want) else _differ(x, want)

    if call.kind == "all_gather":
        x = _values(cid, me, count, dtype).reshape(shape)
        want = np.stack([_values(cid, r, count, dtype).reshape(shape) for r in ranks])
        out = np.full((gsize,) + shape, 77, dtype=dtype) if call.out else None
        result = ax.all_gather(x, out=out, **kw)

        def check(got):
            if out is not None and got is not out:
                return "the result is not out="
            return None if np.array_equal(got, want) and got.dtype == want.dtype else _differ(got, want)
        return result, check

    if call.kind == "gather":
        x = _values(cid, me, n, dtype)
        want = np.stack([_values(cid, r, n, dtype) for r in ranks]) if grank == call.root else None
        result = ax.gather(x, dst=call.root, **kw)

        def check(got):
            if want is None:
                return None if got is None else f"got {type(got)} off the destination"
            return None if np.array_equal(got, want) else _differ(got, want)
        return result, check

    if call.kind == "scatter":
        root = ranks[call.root]
        whole = _values(cid, root, gsize * count, dtype).reshape((gsize,) + shape)
        x = whole if grank == call.root else None
        want = whole[grank]
        result = ax.scatter(x, src=call.root, **kw)
        return result, lambda got: None if np.array_equal(got, want) and got.dtype == want.dtype else _differ(got, want)

    if call.kind == "barrier":
        return ax.barrier(**kw), lambda got: None

    # a message from group rank ``root`` to ``peer``
    sender = ranks[call.root]
    want = _values(cid, sender, n, dtype)
    if grank == call.root:
        x = want.copy()
        if nonblocking:
            return ax.isend(x, dst=call.peer, tag=call.tag, group=group), lambda got: None
        ax.send(x, dst=call.peer, tag=call.tag, group=group)
        return None, lambda got: None
    x = np.zeros(n, dtype=dtype)
    if nonblocking:
        result = ax.irecv(x, src=call.root, tag=call.tag, group=group)
    else:
        result = ax.recv(x, src=call.root, tag=call.tag, group=group)
    return result, lambda got: None if np.array_equal(x, want) else _differ(x, want)


def seeds_from(text: str) -> List[int]:
    """``"40"``: seeds 0-39; ``"100-160"``: those; ``"3,7,9"``: those."""
    text = text.strip()
    if not text:
        return []
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi)))
    return list(range(int(text)))


__all__ = ["generate", "run_program", "deadlock_free", "seeds_from", "Program"]
