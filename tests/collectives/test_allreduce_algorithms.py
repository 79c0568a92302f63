"""Ring and rhd all-reduce: the cases on threads (1-4 ranks) and MPI ranks, and their schedules as pure data."""
import collections
import re

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.collectives.ring import chunk_offsets, rhd_schedule, ring_schedule
from support.algorithm_cases import CASES
from support.runner import case_tests


test_algorithm_case_local, test_algorithm_case_mpi = case_tests(CASES)


@pytest.mark.parametrize("world_size", [5, 6, 7])
def test_larger_odd_and_even_thread_worlds(world_size):
    """Sizes whose rhd fold leaves 1, 2 and 3 pairs, on real data."""
    for name in ("case_every_dtype_op_and_algorithm_equals_native",
                 "case_sizes_around_the_group_size_and_uneven_chunks"):
        ax.run_local(CASES[name], world_size=world_size)


# -- schedules, without communication ---------------------------------------------------------
def _simulate(size, make, n=None):
    """Run every rank's schedule on symbolic data; return each rank's per-chunk expression and elements sent.

    A reduction of expressions a and b is written ``(a+b)`` with the operands
    sorted, since one addition is commutative bit for bit: equal expressions
    mean equal bits. Sends are buffered, and a step's send is issued before
    it waits for its receive, as the executor does.
    """
    schedules = [make(size, r) for r in range(size)]
    chunks = schedules[0].chunks
    assert all(s.chunks == chunks for s in schedules)
    off = chunk_offsets(chunks if n is None else n, chunks)
    state = [[str(r)] * chunks for r in range(size)]
    sent_elements = [0] * size
    mail = collections.defaultdict(collections.deque)
    pos, posted = [0] * size, [False] * size
    progress = True
    while progress:
        progress = False
        for r in range(size):
            steps = schedules[r].steps
            while pos[r] < len(steps):
                step = steps[pos[r]]
                if step.send_to is not None and step.recv_from is not None:
                    lo, hi = step.send
                    assert hi <= step.recv[0] or step.recv[1] <= lo, f"rank {r} step {pos[r]} overlaps"
                if not posted[r]:
                    posted[r] = True
                    if step.send_to is not None:
                        assert step.send_to != r and 0 <= step.send_to < size
                        lo, hi = step.send
                        mail[(r, step.send_to)].append((step.send, state[r][lo:hi]))
                        sent_elements[r] += off[hi] - off[lo]
                        progress = True
                if step.recv_from is not None:
                    box = mail[(step.recv_from, r)]
                    if not box:
                        break
                    got_range, payload = box.popleft()
                    assert got_range == step.recv, f"rank {r} step {pos[r]} expected {step.recv}, got {got_range}"
                    for i, c in enumerate(range(*step.recv)):
                        state[r][c] = "(" + "+".join(sorted([state[r][c], payload[i]])) + ")" if step.reduce \
                            else payload[i]
                pos[r] += 1
                posted[r] = False
                progress = True
    stuck = [r for r in range(size) if pos[r] < len(schedules[r].steps)]
    assert not stuck, f"size {size}: ranks {stuck} deadlock"
    assert not any(mail.values()), "messages left unreceived"
    return state, sent_elements, schedules


@pytest.mark.parametrize("make", [ring_schedule, rhd_schedule], ids=["ring", "rhd"])
@pytest.mark.parametrize("size", range(1, 10))
def test_schedule_reduces_every_rank_once_and_agrees_everywhere(make, size):
    state, _, _ = _simulate(size, make)
    for c in range(len(state[0])):
        exprs = {state[r][c] for r in range(size)}
        assert len(exprs) == 1, f"chunk {c}: ranks hold different reductions {exprs}"
        leaves = collections.Counter(re.findall(r"\d+", exprs.pop()))
        assert leaves == collections.Counter(str(r) for r in range(size))


@pytest.mark.parametrize("size", range(1, 10))
def test_ring_steps_and_bytes(size):
    n = size * 12
    _, sent, schedules = _simulate(size, ring_schedule, n)
    assert all(len(s.steps) == 2 * (size - 1) for s in schedules)
    assert sent == [2 * (size - 1) * n // size] * size


@pytest.mark.parametrize("size", range(1, 10))
def test_rhd_pairing_steps_and_bytes(size):
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    log2 = pof2.bit_length() - 1
    n = pof2 * 12
    _, sent, schedules = _simulate(size, rhd_schedule, n)
    core = 2 * (pof2 - 1) * n // pof2
    for r, s in enumerate(schedules):
        if r < 2 * extra and r % 2 == 0:  # folds into r + 1, sits out, gets the result back
            assert [(st.send_to, st.recv_from) for st in s.steps] == [(r + 1, None), (None, r + 1)]
            assert sent[r] == n
        elif r < 2 * extra:
            assert s.steps[0].recv_from == r - 1 and s.steps[0].reduce and s.steps[-1].send_to == r - 1
            assert len(s.steps) == 2 * log2 + 2 and sent[r] == core + n
        else:
            assert len(s.steps) == 2 * log2 and sent[r] == core
    # the first halving step pairs neighbours in the power-of-two group
    if size == 8:
        assert [s.steps[0].send_to for s in schedules] == [1, 0, 3, 2, 5, 4, 7, 6]
    if size == 6:  # pairs (0,1), (2,3) fold; the group is 1, 3, 4, 5
        first_halving = [schedules[r].steps[1 if r < 4 else 0] for r in (1, 3, 4, 5)]
        assert [st.send_to for st in first_halving] == [3, 1, 5, 4]


@pytest.mark.parametrize("n,parts", [(0, 3), (2, 4), (4, 4), (10, 3), (4099, 4)])
def test_chunk_offsets(n, parts):
    off = chunk_offsets(n, parts)
    sizes = np.diff(off)
    assert off[0] == 0 and off[-1] == n and len(sizes) == parts
    assert sizes.max() - sizes.min() <= 1 and list(sizes) == sorted(sizes, reverse=True)


def test_setting_accepts_the_new_names():
    for name in ("ring", "rhd", "RING"):
        ax.settings.load_environment({"AXONHPC_ALLREDUCE_ALGORITHM": name})
        assert ax.settings.allreduce_algorithm == name.lower()
    with pytest.raises(ValueError, match="must be one of:? native, hierarchical, ring, rhd"):
        ax.settings.load_environment({"AXONHPC_ALLREDUCE_ALGORITHM": "tree"})


def test_bench_algorithm_option_and_table():
    from axonhpc.bench.allreduce import format_algorithm_table, parse_algorithms

    assert parse_algorithms(None) == []
    assert parse_algorithms("native, Ring,rhd,hierarchical") == ["native", "ring", "rhd", "hierarchical"]
    with pytest.raises(ValueError, match=r"unknown all-reduce algorithm\(s\) \['tree'\]"):
        parse_algorithms("ring,tree")
    with pytest.raises(ValueError, match="repeats"):
        parse_algorithms("ring,ring")
    rows = [dict(bytes=4096, raw_us=10.0, algorithms={"ring": 20.0, "rhd": 5.0})]
    table = format_algorithm_table(rows, 4).splitlines()
    assert "4 ranks" in table[0] and "ring us" in table[1] and "rhd us" in table[1]
    assert table[2].split() == ["4", "KiB", "10.0", "20.0", "0.50", "5.0", "2.00"]
