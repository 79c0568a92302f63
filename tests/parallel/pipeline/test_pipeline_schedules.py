"""Pipeline schedules, their simulator, their lowering and the closed-form memory/bubble model (no MPI)."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonhpc.errors import ConfigurationError
from axonhpc.parallel.pipeline.lowering import RECV_B, RECV_F, SEND_B, SEND_F, Op, lower_schedule
from axonhpc.parallel.pipeline.memory import PipelineMemoryStats
from axonhpc.parallel.pipeline.render import format_schedule_table
from axonhpc.parallel.pipeline.schedules import Action, PipelineSchedule, pipeline_schedule
from axonhpc.parallel.pipeline.simulate import simulate_pipeline

GPIPE, ONE_F_ONE_B, INTERLEAVED = PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B


def _microbatch_counts(p):
    """m = 1, m < p, m == p, m not divisible by p, m a multiple of p."""
    return sorted({1, max(1, p - 1), p, p + 1, 2 * p + 3, 3 * p})


FLAT_CASES = [(s, p, m) for s in (GPIPE, ONE_F_ONE_B) for p in range(1, 9) for m in _microbatch_counts(p)]
INTERLEAVED_CASES = [(p, v, m) for p in range(1, 9) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def assert_invariants(actions_by_rank, p, m, v):
    """Rank r owns stages r, r+P, ...; one F and one B per (stage, micro-batch); B after F."""
    assert len(actions_by_rank) == p
    for rank, actions in enumerate(actions_by_rank):
        assert all(isinstance(a, Action) for a in actions)
        own = {rank + k * p for k in range(v)}
        assert {a.stage for a in actions} == own
        expected = sorted((s, kind, i) for s in own for kind in "FB" for i in range(m))
        assert sorted((a.stage, a.kind, a.microbatch) for a in actions) == expected
        position = {a: k for k, a in enumerate(actions)}
        for s in own:
            for i in range(m):
                assert position[Action(s, "F", i)] < position[Action(s, "B", i)], (rank, s, i)


def assert_timing_consistent(actions_by_rank, result):
    """Each rank runs its list in order without overlap; every dependency ends before its user starts."""
    end = result.end_times
    start = result.start_times
    num_stages = 1 + max(a.stage for actions in actions_by_rank for a in actions)
    for actions, timeline in zip(actions_by_rank, result.timelines):
        assert [a for a, _, _ in timeline] == list(actions)
        for (_, _, e0), (_, s1, _) in zip(timeline, timeline[1:]):
            assert s1 >= e0
    for a, s in start.items():
        if a.kind == "F" and a.stage > 0:
            assert s >= end[Action(a.stage - 1, "F", a.microbatch)]
        if a.kind == "B":
            assert s >= end[Action(a.stage, "F", a.microbatch)]
            if a.stage + 1 < num_stages:
                assert s >= end[Action(a.stage + 1, "B", a.microbatch)]


# --- Action and PipelineSchedule ------------------------------------------------------------


def test_action_str_format_and_parse():
    assert str(Action(0, "F", 3)) == "0F3"
    assert str(Action(12, "B", 7)) == "12B7"
    assert Action.parse("12B7") == Action(12, "B", 7)
    assert Action.parse(str(Action(3, "F", 10))) == Action(3, "F", 10)
    with pytest.raises(ConfigurationError, match="'X1'"):
        Action.parse("X1")


@pytest.mark.parametrize(
    "args,needle",
    [((0, "X", 1), "'X'"), ((-1, "F", 0), "-1"), ((0, "F", -2), "-2"), ((1.0, "F", 0), "1.0"), ((True, "B", 0), "True")],
)
def test_action_rejects_bad_fields(args, needle):
    with pytest.raises(ConfigurationError, match=needle):
        Action(*args)


def test_action_is_frozen_and_hashable():
    a = Action(1, "F", 2)
    with pytest.raises(Exception):
        a.stage = 3
    assert {a, Action(1, "F", 2)} == {a}


@pytest.mark.parametrize(
    "alias,member",
    [("gpipe", GPIPE), ("GPIPE", GPIPE), ("1f1b", ONE_F_ONE_B), ("one_f_one_b", ONE_F_ONE_B),
     ("ONE_F_ONE_B", ONE_F_ONE_B), ("interleaved_1f1b", INTERLEAVED), ("interleaved-1f1b", INTERLEAVED),
     ("interleaved", INTERLEAVED), (INTERLEAVED, INTERLEAVED)],
)
def test_schedule_aliases(alias, member):
    assert PipelineSchedule.parse(alias) is member


def test_unknown_schedule_names_the_value():
    with pytest.raises(ConfigurationError, match="'zigzag'"):
        pipeline_schedule("zigzag", 4, 8)


# --- GPipe and 1F1B --------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,p,m", FLAT_CASES)
def test_flat_schedules_no_deadlock_invariants_and_exact_bubble(schedule, p, m):
    actions = pipeline_schedule(schedule, p, m)
    assert_invariants(actions, p, m, 1)
    for f, b in ((1.0, 2.0), (1.0, 1.0)):
        result = simulate_pipeline(actions, forward_cost=f, backward_cost=b)
        assert not result.deadlock, result.deadlock_description
        assert result.stuck == ()
        assert_timing_consistent(actions, result)
        assert result.makespan == (m + p - 1) * (f + b)
        assert result.busy_time == tuple([m * (f + b)] * p)
        assert result.bubble_fraction == (p - 1) / (m + p - 1)
        assert result.bubble_fraction == PipelineMemoryStats.bubble_fraction(p, m)


@pytest.mark.parametrize("p,m", [(p, m) for _, p, m in FLAT_CASES if _ is GPIPE])
def test_gpipe_holds_every_microbatch(p, m):
    actions = pipeline_schedule(GPIPE, p, m)
    assert all([a.kind for a in acts] == ["F"] * m + ["B"] * m for acts in actions)
    result = simulate_pipeline(actions)
    assert result.peak_activations == tuple([m] * p)
    assert result.peak_activations[0] == PipelineMemoryStats.gpipe_peak_activations(p, m) == m


@pytest.mark.parametrize("p,m", [(p, m) for _, p, m in FLAT_CASES if _ is ONE_F_ONE_B])
def test_one_f_one_b_warmup_and_peak(p, m):
    actions = pipeline_schedule(ONE_F_ONE_B, p, m)
    for rank, acts in enumerate(actions):
        # warm-up forwards, then F B pairs until the forwards run out, then the cool-down
        warm = min(p - rank - 1, m)
        kinds = "".join(a.kind for a in acts)
        assert kinds == "F" * warm + "FB" * (m - warm) + "B" * warm, (rank, [str(a) for a in acts])
        # so the first backward comes after the warm-up plus (if any is left) one steady-state forward
        assert kinds.index("B") == min(p - rank, m)
    result = simulate_pipeline(actions)
    assert result.peak_activations[0] == PipelineMemoryStats.one_f_one_b_peak_activations(p, m) == min(p, m)
    for rank, peak in enumerate(result.peak_activations):
        assert peak <= p - rank
        assert peak == min(p - rank, m)


def test_one_f_one_b_holds_less_than_gpipe():
    p, m = 4, 16
    assert max(simulate_pipeline(pipeline_schedule(ONE_F_ONE_B, p, m)).peak_activations) == 4
    assert max(simulate_pipeline(pipeline_schedule(GPIPE, p, m)).peak_activations) == 16


def test_one_f_one_b_known_order():
    got = [" ".join(map(str, acts)) for acts in pipeline_schedule("1f1b", 3, 4)]
    assert got == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


# --- Interleaved 1F1B ------------------------------------------------------------------------


@pytest.mark.parametrize("p,v,m", INTERLEAVED_CASES)
def test_interleaved_no_deadlock_invariants_and_smaller_bubble(p, v, m):
    actions = pipeline_schedule(INTERLEAVED, p * v, m, stages_per_rank=v)
    assert_invariants(actions, p, m, v)
    for f, b in ((1.0, 2.0), (1.0, 1.0)):
        result = simulate_pipeline(actions, forward_cost=f, backward_cost=b)
        assert not result.deadlock, result.deadlock_description
        assert_timing_consistent(actions, result)
        flat = simulate_pipeline(pipeline_schedule(ONE_F_ONE_B, p, m), forward_cost=f, backward_cost=b)
        if p == 1:
            assert result.bubble_fraction == flat.bubble_fraction == 0.0
        else:
            assert result.bubble_fraction < flat.bubble_fraction
        assert result.bubble_fraction == PipelineMemoryStats.interleaved_bubble_fraction(p, m, v)


def test_interleaved_with_one_chunk_is_1f1b():
    for p in range(1, 6):
        for m in (p, 2 * p, 3 * p):
            assert pipeline_schedule(INTERLEAVED, p, m, 1) == pipeline_schedule(ONE_F_ONE_B, p, m)


def test_interleaved_megatron_layout_and_chunk_order():
    actions = pipeline_schedule("interleaved", 8, 4, stages_per_rank=2)
    assert [sorted({a.stage for a in acts}) for acts in actions] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # rank 0 runs micro-batches 0..3 through chunk 0, then through chunk 1, before its first backward
    assert " ".join(map(str, actions[0][:8])) == "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3"
    # backwards start with the last chunk
    assert next(a for a in actions[0] if a.kind == "B") == Action(4, "B", 0)


def test_interleaved_on_one_rank_runs_stages_in_sequence():
    actions = pipeline_schedule(INTERLEAVED, 3, 2, stages_per_rank=3)
    result = simulate_pipeline(actions)
    assert not result.deadlock
    assert result.bubble_fraction == 0.0 and result.makespan == 3 * 2 * 3.0


# --- Errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,needles",
    [
        (dict(num_stages=0, num_microbatches=4), ["num_stages", "0"]),
        (dict(num_stages=-2, num_microbatches=4), ["num_stages", "-2"]),
        (dict(num_stages=4, num_microbatches=0), ["num_microbatches", "0"]),
        (dict(num_stages=4, num_microbatches=2.5), ["num_microbatches", "2.5"]),
        (dict(num_stages=4, num_microbatches=True), ["num_microbatches", "True"]),
        (dict(num_stages="4", num_microbatches=4), ["num_stages", "'4'"]),
        (dict(num_stages=4, num_microbatches=4, stages_per_rank=0), ["stages_per_rank", "0"]),
        (dict(num_stages=6, num_microbatches=4, stages_per_rank=4), ["num_stages=6", "stages_per_rank=4"]),
    ],
)
@pytest.mark.parametrize("schedule", list(PipelineSchedule))
def test_bad_arguments_name_their_values(schedule, kwargs, needles):
    with pytest.raises(ConfigurationError) as info:
        pipeline_schedule(schedule, **kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F_ONE_B])
def test_flat_schedules_reject_several_stages_per_rank(schedule):
    with pytest.raises(ConfigurationError, match=f"{schedule.name}.*stages_per_rank=2"):
        pipeline_schedule(schedule, 8, 8, stages_per_rank=2)


@pytest.mark.parametrize("p,m", [(4, 6), (4, 1), (3, 4), (2, 5)])
def test_interleaved_needs_m_multiple_of_ranks(p, m):
    with pytest.raises(ConfigurationError) as info:
        pipeline_schedule(INTERLEAVED, 2 * p, m, stages_per_rank=2)
    assert f"m={m}" in str(info.value) and f"P={p}" in str(info.value)


def test_memory_stats_reject_bad_arguments():
    with pytest.raises(ConfigurationError, match="p must be a positive int, got 0"):
        PipelineMemoryStats.gpipe_peak_activations(0, 4)
    with pytest.raises(ConfigurationError, match="m must be a positive int, got -1"):
        PipelineMemoryStats.one_f_one_b_peak_activations(4, -1)
    with pytest.raises(ConfigurationError, match="v must be a positive int, got 0"):
        PipelineMemoryStats.interleaved_bubble_fraction(4, 8, 0)


def test_memory_stats_values():
    assert PipelineMemoryStats.gpipe_peak_activations(4, 8) == 8
    assert PipelineMemoryStats.one_f_one_b_peak_activations(4, 8) == 4
    assert PipelineMemoryStats.one_f_one_b_peak_activations(8, 3) == 3
    assert PipelineMemoryStats.bubble_fraction(4, 8) == 3 / 11
    assert PipelineMemoryStats.bubble_fraction(1, 8) == 0.0
    assert PipelineMemoryStats.interleaved_bubble_fraction(4, 8, 2) == 3 / 19


# --- The simulator on broken and hand-written schedules --------------------------------------


def test_action_before_its_own_forward_deadlocks():
    actions = pipeline_schedule(ONE_F_ONE_B, 3, 4)
    actions[2][0], actions[2][1] = actions[2][1], actions[2][0]  # last rank: 2B0 before 2F0
    result = simulate_pipeline(actions)
    assert result.deadlock
    stuck = {s.rank: s for s in result.stuck}
    assert set(stuck) == {0, 1, 2}
    assert stuck[2].action == Action(2, "B", 0)
    assert stuck[2].waiting_for == (Action(2, "F", 0),)
    assert stuck[2].owners == ((2, 1),)
    assert stuck[1].action == Action(1, "B", 0) and stuck[1].waiting_for == (Action(2, "B", 0),)
    assert "rank 2 stuck at 2B0 waiting for 2F0 (rank 2, position 1)" in result.deadlock_description


def test_cross_rank_cycle_deadlocks():
    # rank 1 insists on micro-batch 1 first, but rank 0 sends micro-batch 1 only after
    # micro-batch 0's backward, which needs rank 1's backward of micro-batch 0.
    actions = [
        [Action.parse(s) for s in "0F0 0B0 0F1 0B1".split()],
        [Action.parse(s) for s in "1F1 1B1 1F0 1B0".split()],
    ]
    result = simulate_pipeline(actions)
    assert result.deadlock
    assert [(s.rank, str(s.action), [str(d) for d in s.waiting_for]) for s in result.stuck] == [
        (0, "0B0", ["1B0"]), (1, "1F1", ["0F1"]),
    ]
    assert [str(a) for a, _, _ in result.timelines[0]] == ["0F0"]
    assert result.timelines[1] == ()


def test_missing_action_deadlocks_and_says_so():
    actions = pipeline_schedule(GPIPE, 2, 2)
    actions[0].remove(Action(0, "F", 1))
    result = simulate_pipeline(actions)
    assert result.deadlock
    assert "1F1 waiting for 0F1 which no rank runs" in result.deadlock_description


def test_harmless_swap_is_not_a_deadlock_but_costs_time():
    actions = pipeline_schedule(ONE_F_ONE_B, 3, 4)
    baseline = simulate_pipeline(actions).makespan
    actions[1][1], actions[1][2] = actions[1][2], actions[1][1]  # 1B0 before 1F1: still runnable
    result = simulate_pipeline(actions)
    assert not result.deadlock and result.deadlock_description == ""
    assert result.makespan > baseline


def test_duplicate_action_is_rejected():
    actions = pipeline_schedule(GPIPE, 2, 2)
    actions[1].append(Action(0, "F", 0))
    with pytest.raises(ConfigurationError, match="0F0 appears twice: rank 0 position 0 and rank 1 position 4"):
        simulate_pipeline(actions)


def test_non_action_entry_is_rejected():
    with pytest.raises(ConfigurationError, match="rank 0 position 0: expected an Action, got '0F0'"):
        simulate_pipeline([["0F0"]])


def test_per_stage_costs_as_list_and_callable():
    actions = pipeline_schedule(GPIPE, 2, 2)
    # rank 0: F 0-1, 1-2; rank 1: F 1-4, 4-7, B 7-8, 8-9; rank 0: B 8-9, 9-10
    by_list = simulate_pipeline(actions, forward_cost=[1, 3], backward_cost=[1, 1])
    by_callable = simulate_pipeline(actions, forward_cost=lambda s: 1 + 2 * s, backward_cost=1)
    for result in (by_list, by_callable):
        assert result.makespan == 10.0
        assert result.busy_time == (4.0, 8.0)
        assert result.bubble_fraction == (20 - 12) / 20
        assert result.start_times[Action(1, "F", 1)] == 4.0
        assert result.end_times[Action(0, "B", 1)] == 10.0


@pytest.mark.parametrize(
    "kwargs,needle",
    [(dict(forward_cost=-1.0), "forward_cost for stage 0 must be a finite number >= 0, got -1.0"),
     (dict(backward_cost=[1.0]), "backward_cost lists 1 stage costs but stage 1 is used"),
     (dict(forward_cost="fast"), "forward_cost must be a number"),
     (dict(backward_cost=lambda s: float("nan")), "backward_cost for stage")],
)
def test_bad_costs_are_rejected(kwargs, needle):
    with pytest.raises(ConfigurationError, match=needle):
        simulate_pipeline(pipeline_schedule(GPIPE, 2, 2), **kwargs)


def test_empty_schedule():
    result = simulate_pipeline([[], []])
    assert result.makespan == 0.0 and result.bubble_fraction == 0.0 and not result.deadlock
    assert result.peak_activations == (0, 0)


# --- The table -------------------------------------------------------------------------------


def test_table_timed_shows_bubbles_on_the_time_axis():
    table = format_schedule_table(pipeline_schedule(ONE_F_ONE_B, 4, 8))
    lines = table.splitlines()
    assert len(lines) == 5
    assert lines[0].split()[:3] == ["step", "0", "1"]
    assert lines[0].split()[-1] == "21"  # unit costs: makespan (8 + 4 - 1) * 2 = 22 steps
    assert lines[4].split()[:6] == ["rank", "3", ".", ".", ".", "3F0"]
    assert lines[4].split()[6:8] == ["3B0", "3F1"]
    assert lines[1].split()[2:12] == ["0F0", "0F1", "0F2", "0F3", ".", ".", ".", "0B0", "0F4", "0B1"]


def test_table_longer_backwards_span_several_cells():
    lines = format_schedule_table(pipeline_schedule(GPIPE, 1, 2), backward_cost=2).splitlines()
    assert lines[1].split()[2:] == ["0F0", "0F1", "0B0", "-", "0B1", "-"]


def test_table_untimed_is_the_order():
    actions = pipeline_schedule(INTERLEAVED, 4, 2, stages_per_rank=2)
    lines = format_schedule_table(actions, timed=False).splitlines()
    assert lines[0].split()[0] == "slot"
    for rank, acts in enumerate(actions):
        assert lines[rank + 1].split()[2:] == [str(a) for a in acts]


def test_table_reports_deadlock():
    actions = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    lines = format_schedule_table(actions).splitlines()
    assert lines[1].split()[2:] == ["0F0"]
    assert lines[-1] == (
        "deadlock: rank 0 stuck at 0B0 waiting for 1B0 (rank 1, position 0); "
        "rank 1 stuck at 1B0 waiting for 1F0 (rank 1, position 1)"
    )


def test_table_rejects_fractional_costs():
    with pytest.raises(ConfigurationError, match="backward_cost must be a positive int, got 1.5"):
        format_schedule_table(pipeline_schedule(GPIPE, 2, 2), backward_cost=1.5)


# --- Lowering: explicit sends and receives -----------------------------------------------------


def _messages(steps_by_rank, p):
    """(kind, receiving stage, micro-batch, src, dst) of every send and of every receive."""
    sends, recvs = Counter(), Counter()
    for r, steps in enumerate(steps_by_rank):
        for step in steps:
            assert not [op for op in step.waits if op.kind not in (RECV_F, RECV_B)]
            assert [op.kind for op in step.work[1:]] in ([], [SEND_F], [SEND_B])
            for op in step.waits:
                assert op.peer != r
                sends_to = op.stage - 1 if op.kind == RECV_F else op.stage + 1
                assert op.peer == sends_to % p
                recvs[(op.kind[-1], op.stage, op.microbatch, op.peer, r)] += 1
            for op in step.work[1:]:
                assert op.peer != r
                receiving = op.stage + 1 if op.kind == SEND_F else op.stage - 1
                sends[(op.kind[-1], receiving, op.microbatch, r, op.peer)] += 1
    return sends, recvs


@pytest.mark.parametrize("schedule,p,v,m", [(GPIPE, 1, 1, 3), (ONE_F_ONE_B, 2, 1, 5), (ONE_F_ONE_B, 4, 1, 8),
                                            (INTERLEAVED, 1, 3, 2), (INTERLEAVED, 2, 2, 4), (INTERLEAVED, 3, 2, 6),
                                            (INTERLEAVED, 4, 4, 8)])
def test_lowering_pairs_every_send_with_one_receive(schedule, p, v, m):
    table = pipeline_schedule(schedule, p * v, m, stages_per_rank=v)
    steps = [lower_schedule(actions, r, p, p * v) for r, actions in enumerate(table)]
    for r, rank_steps in enumerate(steps):
        assert [step.action for step in rank_steps] == table[r]
        assert all(step.work[0] == Op(step.action.kind, step.action.stage, step.action.microbatch, r)
                   for step in rank_steps)
    sends, recvs = _messages(steps, p)
    assert sends == recvs and set(sends.values()) <= {1}
    # Consecutive stages live on different ranks unless one rank holds them all.
    expected = 0 if p == 1 else 2 * m * (p * v - 1)
    assert sum(sends.values()) == expected


def test_lowering_on_the_first_and_last_rank():
    steps = lower_schedule(pipeline_schedule(ONE_F_ONE_B, 2, 1)[0], 0, 2, 2)
    assert [(str(step.action), [str(op) for op in step.waits], [str(op) for op in step.work]) for step in steps] == [
        ("0F0", [], ["0F0", "0SEND_F0"]), ("0B0", ["0RECV_B0"], ["0B0"])]
    steps = lower_schedule(pipeline_schedule(ONE_F_ONE_B, 2, 1)[1], 1, 2, 2)
    assert [(str(step.action), [str(op) for op in step.waits], [str(op) for op in step.work]) for step in steps] == [
        ("1F0", ["1RECV_F0"], ["1F0"]), ("1B0", [], ["1B0", "1SEND_B0"])]


# --- Property test ---------------------------------------------------------------------------


@st.composite
def _configs(draw):
    schedule = draw(st.sampled_from(list(PipelineSchedule)))
    p = draw(st.integers(1, 8))
    if schedule is INTERLEAVED:
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 4))
    else:
        v = 1
        m = draw(st.integers(1, 20))
    f = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]))
    b = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]))
    return schedule, p, m, v, f, b


@settings(max_examples=150, deadline=None)
@given(_configs())
def test_property_every_generated_schedule_runs(config):
    schedule, p, m, v, f, b = config
    actions = pipeline_schedule(schedule, p * v, m, stages_per_rank=v)
    assert_invariants(actions, p, m, v)
    result = simulate_pipeline(actions, forward_cost=f, backward_cost=b)
    assert not result.deadlock, result.deadlock_description
    assert_timing_consistent(actions, result)
    assert result.busy_time == pytest.approx([m * v * (f + b)] * p)
    assert 0.0 <= result.bubble_fraction < 1.0
    assert result.makespan >= m * v * (f + b)
    if schedule is GPIPE:
        assert result.peak_activations == tuple([m] * p)
    elif schedule is ONE_F_ONE_B:
        assert result.peak_activations == tuple(min(p - r, m) for r in range(p))
    if schedule is not INTERLEAVED:
        assert result.makespan == pytest.approx((m + p - 1) * (f + b))
