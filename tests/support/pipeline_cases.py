"""Pipeline parity cases, written once, run on threads (plain pytest) and on MPI ranks.

Every case builds the full list of P * v stage modules on every rank from the
same seeds, runs the pipeline over the world's group (P = world size), and
compares each rank's own stages with the same stages trained in one process
on the whole batch (a Sequential of all stages, mean loss over the batch).
Cases return early where a configuration does not apply to the world size.
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import BackwardBeforeForwardError, ConfigurationError, ShapeError
from axonhpc.collectives.p2p import largest_tag
from axonhpc.parallel.pipeline.memory import PipelineMemoryStats
from axonhpc.parallel.pipeline.render import format_schedule_table
from axonhpc.parallel.pipeline.schedules import pipeline_schedule
from axonhpc.parallel.pipeline.simulate import simulate_pipeline
from axonhpc.parallel.pipeline.transport import NUM_KINDS
from axonhpc.parallel.pipeline.trace import chrome_trace, gather_timelines, timeline_bubble

BATCH = 24  # a multiple of every micro-batch count used below
IN, HIDDEN, CLASSES = 6, 8, 3
STEPS = 3
TOL = 1e-12
GPIPE, ONE_F_ONE_B, INTERLEAVED = (ax.PipelineSchedule.GPIPE, ax.PipelineSchedule.ONE_F_ONE_B,
                                   ax.PipelineSchedule.INTERLEAVED_1F1B)


def make_stages(num_stages):
    stages = []
    for k in range(num_stages):
        fan_in = IN if k == 0 else HIDDEN
        layers = [nn.Linear(fan_in, HIDDEN, dtype=np.float64, seed=10 + k), nn.Tanh()]
        if k == num_stages - 1:
            layers.append(nn.Linear(HIDDEN, CLASSES, dtype=np.float64, seed=99))
        stages.append(nn.Sequential(*layers))
    return stages


def make_data(step):
    rng = np.random.default_rng(500 + step)
    return rng.standard_normal((BATCH, IN)), rng.integers(0, CLASSES, BATCH)


def make_optimizer(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    return optim.Adam(params, lr=1e-2)


def train_reference(num_stages, kind, steps=STEPS):
    stages = make_stages(num_stages)
    model = nn.Sequential(*stages)
    opt = make_optimizer(kind, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        x, y = make_data(step)
        opt.zero_grad()
        losses.append(loss_fn(model(x), y))
        model.backward(loss_fn.backward())
        opt.step()
    return stages, losses


def close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, rtol=TOL, atol=TOL, err_msg=what)


def parity(world, schedule, m, kind, v=1):
    p, r = world.world_size, world.rank
    stages = make_stages(p * v)
    pipe = ax.Pipeline.from_modules(stages, num_microbatches=m, schedule=schedule,
                                    loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
    assert pipe.stages == list(range(r, p * v, p))
    opt = make_optimizer(kind, pipe.parameters())
    reference, ref_losses = train_reference(p * v, kind)
    last = (p * v - 1) % p
    grads = None
    for step in range(STEPS):
        x, y = make_data(step)
        if step % 2:  # only the ranks that read them get real arrays
            x, y = (x if r == 0 else None), (y if r == last else None)
        opt.zero_grad()
        loss = pipe.train_step(x, y)
        if grads is None:
            grads = [q.grad for q in pipe.parameters()]
        else:  # accumulated in place into the same arrays, never replaced
            assert all(q.grad is g for q, g in zip(pipe.parameters(), grads))
        if r == last:
            close(loss, ref_losses[step], f"loss at step {step}")
        else:
            assert loss is None
        opt.step()
    untouched = make_stages(p * v)
    for s in range(p * v):
        for (name, q), (_, q_ref), (_, q0) in zip(stages[s].named_parameters(),
                                                  reference[s].named_parameters(),
                                                  untouched[s].named_parameters()):
            if s in pipe.stages:
                close(q.data, q_ref.data, f"stage {s} {name} ({schedule.name}, m={m}, {kind})")
            else:
                np.testing.assert_array_equal(q.data, q0.data, err_msg=f"stage {s} is not this rank's")
                assert q.grad is None
    return pipe


# Over world sizes 1..4 these cover m < p (1; 3 with p = 4), m not a multiple of p
# (3 with p = 2 or 4; 4 and 8 with p = 3) and m a multiple of p.
MICROBATCH_COUNTS = (1, 3, 4, 8)


def case_parity_gpipe(world):
    for m in MICROBATCH_COUNTS:
        for kind in ("sgd", "adam"):
            parity(world, GPIPE, m, kind)


def case_parity_one_f_one_b(world):
    for m in MICROBATCH_COUNTS:
        for kind in ("sgd", "adam"):
            parity(world, ONE_F_ONE_B, m, kind)


def case_parity_interleaved(world):
    p = world.world_size
    for m in (p, 2 * p):
        for kind in ("sgd", "adam"):
            parity(world, INTERLEAVED, m, kind, v=2)
    parity(world, INTERLEAVED, p, "sgd", v=3)


def case_measured_peak_activations(world):
    p, r = world.world_size, world.rank
    x, y = make_data(0)
    for schedule, v, counts in ((GPIPE, 1, (1, 3, 8)), (ONE_F_ONE_B, 1, (1, 3, 8)),
                                (INTERLEAVED, 2, (p, 2 * p))):
        for m in counts:
            pipe = ax.Pipeline.from_modules(make_stages(p * v), num_microbatches=m, schedule=schedule,
                                            loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
            pipe.train_step(x, y)
            stats = pipe.last_step_stats
            expected = simulate_pipeline(pipe.schedule_table()).peak_activations[r]
            assert stats["peak_activations"] == expected, (schedule, m, stats["peak_activations"], expected)
            if schedule is GPIPE:
                assert stats["peak_activations"] == PipelineMemoryStats.gpipe_peak_activations(p, m) == m
            elif schedule is ONE_F_ONE_B:
                assert stats["peak_activations"] == min(p - r, m)
                if r == 0:
                    assert stats["peak_activations"] == PipelineMemoryStats.one_f_one_b_peak_activations(p, m)
            # the timeline is this rank's action list, run in order, with ordered times
            timeline = stats["timeline"]
            assert [a for a, _, _ in timeline] == pipe.schedule_table()[r]
            assert all(0 <= t0 <= t1 for _, t0, t1 in timeline)
            assert all(a[2] <= b[1] for a, b in zip(timeline, timeline[1:]))


def case_forward_matches_reference(world):
    p, r = world.world_size, world.rank
    x, _ = make_data(7)
    for schedule, v, m in ((ONE_F_ONE_B, 1, 3), (GPIPE, 1, 8), (INTERLEAVED, 2, 2 * p)):
        stages = make_stages(p * v)
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=m, schedule=schedule, stages_per_rank=v)
        out = pipe.forward(x)
        expected = nn.Sequential(*make_stages(p * v))(x)
        if r == (p * v - 1) % p:
            assert out.shape == (BATCH, CLASSES)
            close(out, expected, f"forward output ({schedule.name}, m={m})")
        else:
            assert out is None
        for s in pipe.stages:  # nothing kept for a backward
            with pytest.raises(BackwardBeforeForwardError):
                stages[s].backward(np.ones((BATCH // m, HIDDEN)))
            assert all(q.grad is None for q in stages[s].parameters())


def case_deadlock_free_many_microbatches(world):
    # Long schedules with every ordering: any mismatch or wait cycle would hang or raise here.
    p, r = world.world_size, world.rank
    x, y = make_data(3)
    for schedule, v, m in ((GPIPE, 1, 24), (ONE_F_ONE_B, 1, 24), (ONE_F_ONE_B, 1, 2),
                           (INTERLEAVED, 2, 4 * p if 24 % (4 * p) == 0 else 2 * p), (INTERLEAVED, 4, p)):
        pipe = ax.Pipeline.from_modules(make_stages(p * v), num_microbatches=m, schedule=schedule,
                                        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
        for _ in range(2):
            loss = pipe.train_step(x, y)
            assert (loss is None) == (r != (p * v - 1) % p)
            assert len(pipe.last_step_stats["timeline"]) == 2 * m * v
            assert pipe.last_step_stats["peak_activations"] >= 1


def case_schedule_table(world):
    p = world.world_size
    pipe = ax.Pipeline.from_modules(make_stages(2 * p), num_microbatches=2 * p, schedule="interleaved",
                                    stages_per_rank=2)
    assert pipe.schedule_table() == pipeline_schedule(INTERLEAVED, 2 * p, 2 * p, 2)
    assert pipe.schedule_text() == format_schedule_table(pipeline_schedule(INTERLEAVED, 2 * p, 2 * p, 2))
    assert pipe.schedule_text(timed=False).startswith("slot")
    assert pipe.schedule_text(backward_cost=2) == format_schedule_table(pipe.schedule_table(), backward_cost=2)
    table = pipe.schedule_table()
    table[0].clear()  # a copy: the pipeline's own lists stay intact
    assert len(pipe.schedule_table()[0]) == 2 * (2 * p) * 2


def case_configuration_errors(world):
    p = world.world_size
    with pytest.raises(ConfigurationError, match=rf"got {p + 1} stage modules.*{p} ranks.*needs exactly {p}"):
        ax.Pipeline.from_modules(make_stages(p + 1), num_microbatches=2)
    with pytest.raises(ConfigurationError, match=rf"needs exactly {2 * p}"):
        ax.Pipeline.from_modules(make_stages(p), schedule=INTERLEAVED, stages_per_rank=2)
    with pytest.raises(ConfigurationError, match="one stage per rank"):
        ax.Pipeline.from_modules(make_stages(2 * p), schedule=ONE_F_ONE_B, stages_per_rank=2)
    if p > 1:
        with pytest.raises(ConfigurationError, match="multiple of the number of ranks"):
            ax.Pipeline.from_modules(make_stages(2 * p), num_microbatches=p + 1, schedule=INTERLEAVED,
                                     stages_per_rank=2)
    bound = largest_tag()  # MPICH wheel 67,108,863: refused before the schedule's table is built
    with pytest.raises(ConfigurationError, match=rf"needs message tags up to \d+, above the {bound} that "):
        ax.Pipeline.from_modules(make_stages(p), num_microbatches=bound // (NUM_KINDS * p) + 1)
    pipe = ax.Pipeline.from_modules(make_stages(p), num_microbatches=5)
    with pytest.raises(ConfigurationError, match="loss_fn"):
        pipe.train_step(*make_data(0))
    pipe = ax.Pipeline.from_modules(make_stages(p), num_microbatches=5, loss_fn=nn.CrossEntropyLoss())
    x, y = make_data(0)  # 24 rows: not a multiple of 5; every rank is given the arrays, all raise
    with pytest.raises(ShapeError, match=r"batch size of [xy] \(24\) is not a multiple of num_microbatches=5"):
        pipe.train_step(x, y)
    _raises_on_every_rank(world, 0, lambda: pipe.forward(x), "not a multiple", "Pipeline.forward")
    # forward is collective: rank 0's refusal reaches the other stages, which name it
    _raises_on_every_rank(world, 0, lambda: pipe.forward(None), "needs x", "Pipeline.forward")


def case_an_mpi_with_the_smallest_tag_bound(world):
    """An MPI whose MPI_TAG_UB is the standard's minimum, 32767, leaves user tags up to 4095 (dtype codes take
    3 bits). No such MPI is installed here, so the bound the MPI backend read is set to it for this case: the
    Pipeline refuses counts whose tags pass it (it allowed up to 32767 before), and the largest one works."""
    from axonhpc.backends import mpi_p2p

    if type(world.default_group.backend).__name__ != "MPIBackend":
        return
    p = world.world_size
    largest_tag()  # read MPI_TAG_UB first
    saved = (mpi_p2p._largest_tag, mpi_p2p._tag_ub)
    mpi_p2p._largest_tag, mpi_p2p._tag_ub = 4095, 32767
    try:
        assert largest_tag() == 4095
        m = 4095 // (NUM_KINDS * p) + 1
        with pytest.raises(ConfigurationError, match=r"needs message tags up to \d+, above the 4095 that "):
            ax.Pipeline.from_modules(make_stages(p), num_microbatches=m)
        m -= 1  # the most that fit: one row per micro-batch, its last messages tagged near 4095
        pipe = ax.Pipeline.from_modules(make_stages(p), num_microbatches=m, loss_fn=nn.CrossEntropyLoss())
        rng = np.random.default_rng(0)
        loss = pipe.train_step(rng.standard_normal((m, IN)), rng.integers(0, CLASSES, m))
        assert (loss is not None) == (world.rank == p - 1) and (loss is None or np.isfinite(loss))
    finally:
        mpi_p2p._largest_tag, mpi_p2p._tag_ub = saved


def dp_parity(world, schedule, m, kind, v=1):
    """2 pipeline stages (x v chunks) x 2 data-parallel replicas vs one process on the whole batch."""
    mesh = world.mesh(dp=2, pp=2)
    dp, pp = mesh.coords.dp, mesh.coords.pp
    stages = make_stages(2 * v)
    if dp == 1:  # replica 1 starts elsewhere: the Pipeline must copy dp rank 0's parameters
        for q in stages[pp].parameters():
            q.data[...] += 1.0
    pipe = ax.Pipeline.from_modules(stages, group=mesh.pp, num_microbatches=m, schedule=schedule,
                                    loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v, dp_group=mesh.dp)
    assert pipe.stages == list(range(pp, 2 * v, 2))
    opt = make_optimizer(kind, pipe.parameters())
    reference, ref_losses = train_reference(2 * v, kind)
    shard = BATCH // 2
    for step in range(STEPS):
        x, y = make_data(step)
        x, y = x[dp * shard:(dp + 1) * shard], y[dp * shard:(dp + 1) * shard]
        opt.zero_grad()
        loss = pipe.train_step(x, y)
        if pipe.is_last:  # the loss of the whole global batch, on both replicas
            close(loss, ref_losses[step], f"dp loss at step {step}")
        else:
            assert loss is None
        opt.step()
    for s in pipe.stages:
        for (name, q), (_, q_ref) in zip(stages[s].named_parameters(), reference[s].named_parameters()):
            close(q.data, q_ref.data, f"stage {s} {name} dp={dp} ({schedule.name}, m={m}, {kind})")
    assert pipe.last_step_stats["dp_sync_time"] > 0


def case_pipeline_with_data_parallel(world):
    if world.world_size != 4:
        return
    for schedule, m, v in ((GPIPE, 3, 1), (ONE_F_ONE_B, 4, 1), (ONE_F_ONE_B, 1, 1), (INTERLEAVED, 2, 2)):
        for kind in ("sgd", "adam"):
            dp_parity(world, schedule, m, kind, v)


def case_a_bad_target_is_refused_on_every_stage_and_replica(world):
    """A target out of range on the last stage: every rank raises after the step's messages, the last stage the
    loss's error and the others one naming it; the pipeline trains on afterwards. At 4 ranks, 2 stages x 2
    replicas: only replica 1's targets are bad, and replica 0 raises too."""
    p, r = world.world_size, world.rank
    for schedule, m in ((GPIPE, 3), (ONE_F_ONE_B, 4)):
        pipe = ax.Pipeline.from_modules(make_stages(p), num_microbatches=m, schedule=schedule,
                                        loss_fn=nn.CrossEntropyLoss())
        x, y = make_data(0)
        bad = y.copy()
        bad[BATCH // 2] = CLASSES + 4  # in the second micro-batch
        expected = ShapeError if r == p - 1 else ax.errors.CollectiveRefusedError
        match = (r"targets must be in \[0, 3\), got values in \[\d, 7\]" if r == p - 1 else
                 rf"Pipeline.train_step refused the batch of rank {p - 1} \(world numbering\): ShapeError")
        with pytest.raises(expected, match=match):
            pipe.train_step(x, bad)
        for q in pipe.parameters():
            q.grad = None
        assert np.isfinite(pipe.train_step(x, y)) if r == p - 1 else pipe.train_step(x, y) is None
    if p != 4:
        return
    mesh = world.mesh(dp=2, pp=2)
    pipe = ax.Pipeline.from_modules(make_stages(2), group=mesh.pp, num_microbatches=2, schedule=ONE_F_ONE_B,
                                    loss_fn=nn.CrossEntropyLoss(), dp_group=mesh.dp)
    x, y = make_data(0)
    bad = y.copy()
    if mesh.coords.dp == 1:
        bad[:] = -1
    if mesh.coords.dp == 1 and pipe.is_last:
        expected, match = ShapeError, r"targets must be in \[0, 3\)"
    elif mesh.coords.dp == 1:
        expected, match = ax.errors.CollectiveRefusedError, r"refused the batch of rank \d \(world numbering\)"
    else:
        expected, match = ax.errors.CollectiveRefusedError, "another data-parallel replica refused its batch"
    with pytest.raises(expected, match=match):
        pipe.train_step(x, bad)


def _raises_on_every_rank(world, refusing, call, match, what="Pipeline.train_step"):
    """``call()`` raises ShapeError (``match``) on world rank ``refusing`` and CollectiveRefusedError naming it on
    every other rank: none is left waiting for a message."""
    if world.rank == refusing:
        with pytest.raises(ShapeError, match=match):
            call()
    else:
        with pytest.raises(ax.errors.CollectiveRefusedError,
                           match=rf"{what} refused the batch of rank {refusing} \(world numbering\): ShapeError") as info:
            call()
        assert info.value.rank == refusing, (info.value.rank, str(info.value))


def case_a_batch_refused_on_one_rank_raises_on_every_stage(world):
    """A batch size num_microbatches does not divide on one rank only: rank 0's x (its refusal travels down the
    stages in place of the shape headers), the last stage's y (a zero gradient goes back), or an x a middle rank
    does not read (voted on). Every rank raises; the next step runs on every rank (no message was left over)."""
    p, r = world.world_size, world.rank
    x, y = make_data(0)
    for schedule, v, m in ((GPIPE, 1, 4), (ONE_F_ONE_B, 1, 4), (INTERLEAVED, 2, 2 * p)):
        pipe = ax.Pipeline.from_modules(make_stages(p * v), num_microbatches=m, schedule=schedule,
                                        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
        cases = [(0, x[:-1] if r == 0 else x, y, "x"), (p - 1, x, y[:-1] if r == p - 1 else y, "y")]
        if p > 2:
            cases.append((1, x[:-1] if r == 1 else x, y, "x"))
        for refusing, xr, yr, name in cases:
            for q in pipe.parameters():
                q.grad = None
            _raises_on_every_rank(world, refusing, lambda: pipe.train_step(xr, yr),
                                  rf"batch size of {name} \({BATCH - 1}\) is not a multiple of num_microbatches={m}")
            loss = pipe.train_step(x, y)
            assert np.isfinite(loss) if pipe.is_last else loss is None
        _raises_on_every_rank(world, 0, lambda: pipe.forward(x[:-1] if r == 0 else x), "is not a multiple",
                              "Pipeline.forward")
        out = pipe.forward(x[:-1] if r > 0 else x)  # x is read on rank 0 only
        assert out.shape == (BATCH, CLASSES) if pipe.is_last else out is None


class Fault(nn.Module):
    """The identity, or one stage's failure on one rank, on its ``at``-th forward (backward) call since ``arm``:
    "value" raises a user's ValueError in the forward, "backward" in the backward, "complex" returns an output
    the transport does not carry, "tuple" one that is not a single array."""

    def __init__(self):
        super().__init__()
        self.arm(None)

    def arm(self, mode, at=0):
        self.mode, self.at, self.forwards, self.backwards = mode, at, 0, 0

    def forward(self, x):
        self.forwards += 1
        if self.forwards - 1 == self.at and self.mode == "value":
            raise ValueError("a user's layer failed")
        if self.forwards - 1 == self.at and self.mode == "complex":
            return x.astype(np.complex128)
        if self.forwards - 1 == self.at and self.mode == "tuple":
            return (x, x)
        return x

    def backward(self, g):
        self.backwards += 1
        if self.backwards - 1 == self.at and self.mode == "backward":
            raise ValueError("a user's backward failed")
        return g


def make_fault_stages(num_stages):
    return [nn.Sequential(*stage, Fault()) for stage in make_stages(num_stages)]


def fault_cases(p, v, m, training):
    """(stage, mode, micro-batch, error on the failing rank, its match) for a pipeline of p ranks and v chunks:
    the first stage, a sender (the last rank's first chunk with v > 1: its refusal wraps around to rank 0), the
    last stage, and a failure after micro-batch 0's messages went out."""
    n = p * v
    sender = p - 1 if v > 1 else max(p - 2, 0)
    cases = [(0, "x", 0, ShapeError, r"Linear\(6, 8\) got input of shape \(\d+, 5\)"),
             (sender, "tuple", 0, ShapeError, f"a stage's output must be one array .* stage {sender} returned a tuple"),
             (n - 1, "value", min(1, m - 1), ValueError, "a user's layer failed"),
             (n - 1, "tuple", 0, ShapeError, "a stage's output must be one array")]
    if p > 1:  # an output a message cannot carry: at once, or after micro-batch 0's header and activation
        cases += [(sender, "complex", 0, ShapeError, rf"stage {sender} produced a complex128 array of 2 dimensions"),
                  (sender, "complex", m - 1, ShapeError, rf"stage {sender} produced a complex128 array .* for "
                                                         rf"micro-batch {m - 1}, but float64")]
    if n > 1:
        cases.append((n // 2, "value", m - 1, ValueError, "a user's layer failed"))
    if training:
        cases += [(min(1, n - 1), "backward", 0, ValueError, "a user's backward failed"),
                  (n - 1, "backward", m - 1, ValueError, "a user's backward failed")]
    return cases


def _fails_on_every_rank(world, failing, call, error, match, what):
    """``call()`` raises ``error`` on world rank ``failing`` and CollectiveRefusedError naming it on every other
    rank, none left waiting for a message."""
    if world.rank == failing:
        with pytest.raises(error, match=match):
            call()
    else:
        with pytest.raises(ax.errors.CollectiveRefusedError,
                           match=rf"{what} refused the batch of rank {failing} \(world numbering\): "
                                 rf"{error.__name__}") as info:
            call()
        assert info.value.rank == failing, (info.value.rank, str(info.value))


def case_a_stage_that_fails_on_one_rank_raises_on_every_rank(world):
    """A stage's forward, backward or send raises on one rank only (a wrong feature count, a user's error, an
    output the transport does not carry, at once or mid-step): every rank raises before train_step returns, the
    failing one its own error, none waits for its messages; then the next step trains as the single process
    does (no message of the failed step is left to pair with its own)."""
    p, r = world.world_size, world.rank
    x, y = make_data(0)
    for schedule, v, m in ((GPIPE, 1, 4), (ONE_F_ONE_B, 1, 4), (INTERLEAVED, 2, 2 * p)):
        stages = make_fault_stages(p * v)
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=m, schedule=schedule,
                                        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
        reference = nn.Sequential(*make_fault_stages(p * v))
        loss_fn = nn.CrossEntropyLoss()
        expected_loss = loss_fn(reference(x), y)
        reference.backward(loss_fn.backward())
        for stage, mode, at, error, match in fault_cases(p, v, m, training=True):
            stages[stage][-1].arm(None if mode == "x" else mode, at)
            xr = x[:, :IN - 1] if mode == "x" and r == 0 else x
            _fails_on_every_rank(world, stage % p, lambda: pipe.train_step(xr, y), error, match,
                                 "Pipeline.train_step")
            for s in range(p * v):
                stages[s][-1].arm(None)
            for q in pipe.parameters():
                q.grad = None
            loss = pipe.train_step(x, y)
            what = f"{schedule.name}: the step after stage {stage} failed ({mode} at micro-batch {at})"
            if pipe.is_last:
                close(loss, expected_loss, f"loss, {what}")
            for s in pipe.stages:
                for (name, q), (_, q_ref) in zip(stages[s].named_parameters(), reference[s].named_parameters()):
                    close(q.grad, q_ref.grad, f"stage {s} {name}.grad, {what}")


def case_a_stage_that_fails_in_one_replica_raises_on_every_replica(world):
    """2 stages x 2 data-parallel replicas: a user's error in replica 1's last stage, mid-step. Its pipeline raises
    as above, replica 0 that another replica refused its batch; then both train on, averaged as before."""
    if world.world_size != 4:
        return
    mesh = world.mesh(dp=2, pp=2)
    stages = make_fault_stages(2)
    pipe = ax.Pipeline.from_modules(stages, group=mesh.pp, num_microbatches=2, schedule=ONE_F_ONE_B,
                                    loss_fn=nn.CrossEntropyLoss(), dp_group=mesh.dp)
    x, y = make_data(0)
    if mesh.coords.dp == 1:
        stages[1][-1].arm("value", 1)
    failing = mesh.pp.ranks[1]
    if mesh.coords.dp == 0:
        with pytest.raises(ax.errors.CollectiveRefusedError, match="another data-parallel replica refused its batch"):
            pipe.train_step(x, y)
    else:
        _fails_on_every_rank(world, failing, lambda: pipe.train_step(x, y), ValueError, "a user's layer failed",
                             "Pipeline.train_step")
    stages[1][-1].arm(None)
    for q in pipe.parameters():
        q.grad = None
    reference = nn.Sequential(*make_fault_stages(2))
    loss_fn = nn.CrossEntropyLoss()
    expected_loss = loss_fn(reference(x), y)
    reference.backward(loss_fn.backward())
    loss = pipe.train_step(x, y)  # the same batch on both replicas: their average is the reference's
    if pipe.is_last:
        close(loss, expected_loss, "loss after a replica's stage failed")
    for s in pipe.stages:
        for (name, q), (_, q_ref) in zip(stages[s].named_parameters(), reference[s].named_parameters()):
            close(q.grad, q_ref.grad, f"stage {s} {name}.grad after a replica's stage failed")


def case_a_stage_that_fails_in_forward_raises_on_every_rank(world):
    """The same failures in ``forward`` (inference): every rank raises, and the next forward is the reference's."""
    p, r = world.world_size, world.rank
    x, _ = make_data(1)
    for schedule, v, m in ((ONE_F_ONE_B, 1, 4), (INTERLEAVED, 2, 2 * p)):
        stages = make_fault_stages(p * v)
        pipe = ax.Pipeline.from_modules(stages, num_microbatches=m, schedule=schedule, stages_per_rank=v)
        expected = nn.Sequential(*make_fault_stages(p * v))(x)
        for stage, mode, at, error, match in fault_cases(p, v, m, training=False):
            stages[stage][-1].arm(None if mode == "x" else mode, at)
            xr = x[:, :IN - 1] if mode == "x" and r == 0 else x
            _fails_on_every_rank(world, stage % p, lambda: pipe.forward(xr), error, match, "Pipeline.forward")
            for s in range(p * v):
                stages[s][-1].arm(None)
            out = pipe.forward(x)
            if pipe.is_last:
                close(out, expected, f"{schedule.name}: forward after stage {stage} failed ({mode} at {at})")
            else:
                assert out is None


def case_gather_timelines(world):
    p, r = world.world_size, world.rank
    x, y = make_data(0)
    for schedule, v, m in ((GPIPE, 1, 3), (ONE_F_ONE_B, 1, 4), (INTERLEAVED, 2, 2 * p)):
        pipe = ax.Pipeline.from_modules(make_stages(p * v), num_microbatches=m, schedule=schedule,
                                        loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
        with pytest.raises(RuntimeError, match="run train_step"):  # raised before any message
            gather_timelines(pipe)
        pipe.train_step(x, y)
        gathered = gather_timelines(pipe, dst=p - 1)
        if r != p - 1:
            assert gathered is None
            continue
        assert len(gathered) == p
        table = pipe.schedule_table()
        for rank, timeline in enumerate(gathered):
            assert [a for a, _, _ in timeline] == table[rank]
            assert all(0 <= t0 <= t1 for _, t0, t1 in timeline)
        assert gathered[r] == pipe.last_step_stats["timeline"]  # float64 carries the times exactly
        doc = chrome_trace(gathered)
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert len(spans) == sum(len(t) for t in table)
        assert {e["pid"] for e in spans} == set(range(p))
        assert 0.0 <= timeline_bubble(gathered) < 1.0


def case_from_stages_holds_only_local_stages(world):
    """Each rank builds only its own stages; training equals the single-process reference."""
    p, r = world.world_size, world.rank
    for v, schedule in ((1, ax.PipelineSchedule.ONE_F_ONE_B), (2, ax.PipelineSchedule.INTERLEAVED_1F1B)):
        total = p * v
        mine = [ax.PipelineStage(make_stages(total)[s], s, total) for s in range(r, total, p)]
        pipe = ax.Pipeline.from_stages(mine[::-1], num_microbatches=2 * p, schedule=schedule,
                                       loss_fn=nn.CrossEntropyLoss())
        assert pipe.stages == list(range(r, total, p)) and pipe.stages_per_rank == v
        opt = make_optimizer("adam", pipe.parameters())
        reference, ref_losses = train_reference(total, "adam")
        last = (total - 1) % p
        for step in range(STEPS):
            x, y = make_data(step)
            opt.zero_grad()
            loss = pipe.train_step(x, y)
            if r == last:
                close(loss, ref_losses[step], f"loss at step {step}")
            opt.step()
        for st in mine:
            for (name, q), (_, q_ref) in zip(st.module.named_parameters(), reference[st.index].named_parameters()):
                close(q.data, q_ref.data, f"stage {st.index} {name} (from_stages, v={v})")


def case_from_stages_errors(world):
    p, r = world.world_size, world.rank
    with pytest.raises(ConfigurationError, match=f"group rank {r} gave none"):
        ax.Pipeline.from_stages([])
    wrong = (r + 1) % p if p > 1 else 1
    with pytest.raises(ConfigurationError, match=rf"must hold stages \[{r}\] of {p}, got \[{wrong}\]"):
        ax.Pipeline.from_stages([ax.PipelineStage(make_stages(p)[0], wrong, p)])
    with pytest.raises(ConfigurationError, match="disagree on num_stages"):
        ax.Pipeline.from_stages([ax.PipelineStage(None, r, p), ax.PipelineStage(None, r + p, 2 * p)])
    if p > 1:
        with pytest.raises(ConfigurationError, match=f"num_stages={p + 1} must be a positive multiple"):
            ax.Pipeline.from_stages([ax.PipelineStage(None, r, p + 1)])


VOCAB, WIDTH, SEQ = 7, 5, 3


class MatMul(nn.Module):
    """``h @ w`` with a Parameter given from outside, so that several stages can share it."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        self._save_cache(h)
        return h @ self.w.data

    def backward(self, g):
        h = self._pop_cache()
        self.w.accumulate_grad(h.reshape(-1, h.shape[-1]).T @ g.reshape(-1, g.shape[-1]))
        return g @ self.w.data.T


class TiedHead(MatMul):
    """Logits ``h @ w.T`` over an embedding's weight ``w`` (the tied output projection)."""

    def forward(self, h):
        self._save_cache(h)
        return h @ self.w.data.T

    def backward(self, g):
        h = self._pop_cache()
        self.w.accumulate_grad(g.reshape(-1, g.shape[-1]).T @ h.reshape(-1, h.shape[-1]))
        return g @ self.w.data


def make_tied_stages(num_stages):
    """Stage 0 embeds with E and the last stage's logits are ``h @ E.T`` (a tied embedding); every even stage
    multiplies by one shared W. So at P ranks (stage s on rank s % P) the ties cross ranks or stay on one."""
    emb = nn.Embedding(VOCAB, WIDTH, dtype=np.float64, seed=0)
    w = nn.Linear(WIDTH, WIDTH, dtype=np.float64, seed=1).weight
    stages = []
    for k in range(num_stages):
        layers = [emb] if k == 0 else []
        layers += [MatMul(w) if k % 2 == 0 else nn.Linear(WIDTH, WIDTH, dtype=np.float64, seed=10 + k), nn.Tanh()]
        if k == num_stages - 1:
            layers.append(TiedHead(emb.weight))
        stages.append(nn.Sequential(*layers))
    return stages, [emb.weight, w]


def make_token_data(step):
    rng = np.random.default_rng(700 + step)
    return rng.integers(0, VOCAB, (BATCH, SEQ)), rng.integers(0, VOCAB, (BATCH, SEQ))


def tied_parity(world, schedule, m, kind, v=1, mesh=None, clip=None, accumulate=1):
    """The tied stages pipelined (over ``mesh.pp``, replicated over ``mesh.dp``, when given) against one
    process, ``accumulate`` train steps (backwards in one process) per optimizer step with no zeroing between;
    every copy of a tied Parameter also equals rank 0's bit for bit."""
    group = None if mesh is None else mesh.pp
    dp = 1 if mesh is None else mesh.dp.size
    p = world.world_size // dp
    stages, tied = make_tied_stages(p * v)
    pipe = ax.Pipeline.from_modules(stages, group=group, num_microbatches=m, schedule=schedule,
                                    loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v,
                                    dp_group=None if mesh is None else mesh.dp)
    params = pipe.parameters()
    assert len({id(q) for q in params}) == len(params), "a shared Parameter listed twice"
    opt = make_optimizer(kind, params)  # refused a Parameter listed twice
    ref_stages, _ = make_tied_stages(p * v)
    model = nn.Sequential(*ref_stages)
    ref_opt = make_optimizer(kind, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    shard = BATCH // dp
    lo = 0 if mesh is None else mesh.dp.rank * shard
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad()
        for part in range(accumulate):
            x, y = make_token_data(step * accumulate + part)
            expected = loss_fn(model(x), y)
            model.backward(loss_fn.backward())
            loss = pipe.train_step(x[lo:lo + shard], y[lo:lo + shard])
            if pipe.is_last:
                close(loss, expected, f"tied loss at step {step}")
        if clip is not None:  # the norm of the whole model's gradients, the tied ones once
            ref_norm = optim.clip_grad_norm(model.parameters(), clip[0], clip[1])
        ref_opt.step()
        if clip is not None:
            assert ref_norm > clip[0]  # so the step clips
            close(pipe.clip_grad_norm(clip[0], clip[1]), ref_norm, f"norm at step {step}")
        opt.step()
    what = f"({schedule.name}, m={m}, {kind}, v={v}, dp={dp}, accumulate={accumulate})"
    for s in pipe.stages:
        for (name, q), (_, q_ref) in zip(stages[s].named_parameters(), ref_stages[s].named_parameters()):
            close(q.data, q_ref.data, f"stage {s} {name} {what}")
    for q in tied:  # the copies of the lowest holder (rank 0: stage 0 holds both) and this rank agree exactly
        first = q.data.copy()
        ax.broadcast(first, 0, group)
        if any(q is h for h in params):
            np.testing.assert_array_equal(q.data, first, err_msg=f"a tied copy drifted {what}")


def case_tied_parameters_across_stages(world):
    """A Parameter that stages on different ranks share (a tied embedding and output projection) gets the
    gradient of every stage that uses it, on every rank that holds it; one shared by stages of one rank
    (interleaved) is listed once for the optimizer and adds both stages' gradients."""
    p = world.world_size
    for schedule, m in ((GPIPE, 3), (ONE_F_ONE_B, 4), (ONE_F_ONE_B, 1)):
        for kind in ("sgd", "adam"):
            tied_parity(world, schedule, m, kind)
    for kind in ("sgd", "adam"):
        tied_parity(world, INTERLEAVED, 2 * p, kind, v=2)
    if p == 4:
        tied_parity(world, ONE_F_ONE_B, 4, "adam", mesh=world.mesh(dp=2, pp=2))
        tied_parity(world, INTERLEAVED, 2, "sgd", v=2, mesh=world.mesh(dp=2, pp=2))


def case_tied_gradients_accumulate_over_train_steps(world):
    """Train steps without zeroing between add up, tied Parameters too: each step's sum over the ranks that hold
    one is added once. Before, the whole gradient was summed each step, so what an earlier step left counted once
    per holder (off by as much as the gradient itself)."""
    p = world.world_size
    tied_parity(world, ONE_F_ONE_B, 4, "sgd", accumulate=3)
    tied_parity(world, INTERLEAVED, 2 * p, "adam", v=2, accumulate=2, clip=(0.05, 2.0))
    if p == 4:
        tied_parity(world, ONE_F_ONE_B, 2, "sgd", mesh=world.mesh(dp=2, pp=2), accumulate=2)


def case_clip_grad_norm_over_every_stage(world):
    """``pipe.clip_grad_norm`` clips by the whole model's norm (2, 1 and inf), tied Parameters counted once,
    replicas alike: the parameters end where one process clipping with ``optim.clip_grad_norm`` ends."""
    p = world.world_size
    for clip in ((0.05, 2.0), (0.5, 1.0), (0.01, float("inf"))):
        tied_parity(world, ONE_F_ONE_B, 4, "sgd", clip=clip)
    tied_parity(world, GPIPE, 3, "adam", clip=(0.05, 2.0))
    tied_parity(world, INTERLEAVED, 2 * p, "sgd", v=2, clip=(0.05, 2.0))
    if p == 4:
        tied_parity(world, ONE_F_ONE_B, 4, "adam", mesh=world.mesh(dp=2, pp=2), clip=(0.05, 2.0))


def case_ranks_that_disagree_on_ties_are_refused(world):
    """Every rank must pass the same list: one whose last stage has its own head (no tie) is named on every
    rank, before any group for the ties is made."""
    from axonhpc.errors import ModelMismatchError

    p = world.world_size
    if p == 1:
        return
    stages, _ = make_tied_stages(p)
    if world.rank == p - 1:
        stages[-1] = nn.Sequential(*list(stages[-1])[:-1], TiedHead(nn.Embedding(VOCAB, WIDTH, seed=0).weight))
    with pytest.raises(ModelMismatchError, match="tied parameters"):
        ax.Pipeline.from_modules(stages, num_microbatches=2, loss_fn=nn.CrossEntropyLoss())


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
