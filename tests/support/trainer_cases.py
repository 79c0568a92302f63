"""DistributedTrainer cases, run on threads (1-4 ranks) and on MPI ranks.

The reference trains one model in one process on exactly the global batches
the ranks see together (each rank's k-th batch of the epoch, concatenated).
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.data import DistributedSampler
from support.scratch import shared_dir

N_SAMPLES, BATCH, EPOCHS = 96, 4, 2


def make_model(seed=0):
    return nn.Sequential(nn.Linear(6, 16, dtype=np.float64, seed=seed), nn.Tanh(),
                         nn.Linear(16, 8, dtype=np.float64, seed=seed + 1), nn.ReLU(),
                         nn.Linear(8, 3, dtype=np.float64, seed=seed + 2))


def make_data(n=N_SAMPLES, seed=5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 6)), rng.integers(0, 3, n)


def make_optimizer(params, kind="sgd"):
    if kind == "sgd":
        return optim.SGD(params, lr=0.05, momentum=0.9)
    return optim.Adam(params, lr=1e-2)


def global_batches(n, replicas, batch, epoch, seed=0):
    """The rows of each global batch of ``epoch``: every data-parallel rank's k-th batch, concatenated."""
    parts = []
    for r in range(replicas):
        sampler = DistributedSampler(n, replicas, r, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        parts.append(sampler.indices())
    return [np.concatenate([p[k:k + batch] for p in parts]) for k in range(0, len(parts[0]), batch)]


def reference(replicas, epochs=EPOCHS, accumulate=1, kind="sgd", seed=0):
    """Single-process training on the batches ``replicas`` data-parallel ranks see together."""
    x, y = make_data()
    model = make_model()
    opt = make_optimizer(model.parameters(), kind)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        batches = global_batches(len(x), replicas, BATCH, epoch, seed)
        for s in range(len(batches) // accumulate):
            opt.zero_grad()
            for rows in batches[s * accumulate:(s + 1) * accumulate]:
                loss_fn(model(x[rows]), y[rows])
                model.backward(loss_fn.backward() / accumulate)
            opt.step()
    return model


def train(world, strategy="ddp", epochs=EPOCHS, kind="sgd", checkpoint_dir=None, on_step=None, **options):
    model = make_model(seed=0 if world.rank == 0 else 50 + world.rank)  # wrapping copies rank 0's values
    fit_args = {k: options.pop(k) for k in ("grad_accumulation", "checkpoint_every") if k in options}
    trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters(), kind), nn.CrossEntropyLoss(),
                                    strategy=strategy, progress=False, exit_on_preemption=False, on_step=on_step,
                                    **options)
    trainer.fit(make_data(), epochs, batch_size=BATCH, checkpoint_dir=checkpoint_dir, **fit_args)
    return trainer


def full_parameters(trainer):
    if trainer.strategy == "fsdp":
        return trainer.setup.wrapper.full_state_dict(rank0_only=False)
    if trainer.strategy == "pipeline":
        pipe = trainer.setup.pipeline
        values = {}
        for i in range(len(pipe.stage_modules)):
            owner = i % pipe.group.size
            for name, array in pipe.stage_modules[i].state_dict().items():
                ax.broadcast(array, owner, pipe.group)  # state_dict() gave a copy: the owner's values land in it
                values[f"{i}.{name}"] = array
        return values
    return trainer.model.state_dict()


def assert_parity(trainer, ref, tol=1e-12):
    got = full_parameters(trainer)
    if trainer.strategy == "pipeline":
        from axonhpc.trainer.strategies import split_stages

        stages = split_stages(ref, trainer.setup.group.size)
        want = {f"{i}.{k}": v for i, s in enumerate(stages) for k, v in s.state_dict().items()}
    else:
        want = ref.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=name)


def _strategy_cases():
    cases = {}
    for strategy in ("ddp", "zero1", "fsdp"):
        cases[f"case_parity_{strategy}"] = lambda world, s=strategy: assert_parity(
            train(world, s), reference(world.world_size))
        cases[f"case_parity_{strategy}_adam"] = lambda world, s=strategy: assert_parity(
            train(world, s, kind="adam"), reference(world.world_size, kind="adam"))
    return cases


def case_grad_accumulation(world):
    assert_parity(train(world, "ddp", grad_accumulation=2), reference(world.world_size, accumulate=2))
    assert_parity(train(world, "fsdp", grad_accumulation=3), reference(world.world_size, accumulate=3))


def reference_by_samples(replicas, n, batch, accumulate=1, epochs=EPOCHS, kind="sgd", seed=0):
    """One process on each step's rows at once (the mean loss over the step's samples), where a step's last
    batch may be partial; returns ``(model, the mean loss of each epoch)``."""
    x, y = make_data(n)
    model = make_model()
    opt = make_optimizer(model.parameters(), kind)
    loss_fn = nn.CrossEntropyLoss()
    epoch_losses = []
    for epoch in range(epochs):
        batches = global_batches(len(x), replicas, batch, epoch, seed)
        total = count = 0.0
        for s in range(len(batches) // accumulate):
            rows = np.concatenate(batches[s * accumulate:(s + 1) * accumulate])
            opt.zero_grad()
            total += loss_fn(model(x[rows]), y[rows]) * len(rows)
            count += len(rows)
            model.backward(loss_fn.backward())
            opt.step()
        epoch_losses.append(total / count)
    return model, epoch_losses


def case_grad_accumulation_weighs_a_partial_batch_by_its_samples(world):
    """36 samples per rank in batches of 5 and steps of 4 batches: the second step's batches are 5, 5, 5 and 1.
    Its gradient is that of the mean loss over its 16 samples (the loss the trainer reports), not the mean
    of the 4 batch means."""
    n = 36 * world.world_size
    ref, losses = reference_by_samples(world.world_size, n, 5, accumulate=4)
    for strategy in ("ddp", "zero1", "fsdp"):
        model = make_model(seed=0 if world.rank == 0 else 50 + world.rank)
        trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                        strategy=strategy, progress=False, exit_on_preemption=False, verbose=False)
        trainer.fit(make_data(n), EPOCHS, batch_size=5, grad_accumulation=4)
        assert trainer.global_step == 2 * EPOCHS
        assert_parity(trainer, ref)
        np.testing.assert_allclose([r["loss"] for r in trainer.history], losses, rtol=1e-12, err_msg=strategy)


def case_pipeline_trains_and_evaluates_a_partial_batch(world):
    """70 samples in batches of 8 leave a last batch of 6, which 4 micro-batches do not split: it runs as 3
    (the largest count that divides it), and the epoch trains like one process on each batch. evaluate takes
    63 rows (at most 4 micro-batches: 3 of 21 rows; in batches of 10: 2 of 5 each, then 3 of 1)."""
    n = 70
    ref, losses = reference_by_samples(1, n, 8)
    model = make_model(seed=0 if world.rank == 0 else 50 + world.rank)
    trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                    strategy="pipeline", progress=False, exit_on_preemption=False, verbose=False,
                                    num_microbatches=4)
    trainer.fit(make_data(n), EPOCHS, batch_size=8)
    assert trainer.global_step == 9 * EPOCHS
    assert_parity(trainer, ref)
    np.testing.assert_allclose([r["loss"] for r in trainer.history], losses, rtol=1e-12)
    x, y = make_data(63, seed=9)
    out = ref(x)
    loss_fn = nn.CrossEntropyLoss()
    for batch_size in (256, 10):
        metrics = trainer.evaluate((x, y), batch_size=batch_size)
        np.testing.assert_allclose(metrics["loss"], loss_fn(out, y), rtol=1e-12)
        assert metrics["accuracy"] == pytest.approx(float((out.argmax(axis=1) == y).mean()))


def case_pipeline_parity(world):
    trainer = train(world, "pipeline", num_microbatches=2)
    assert_parity(trainer, reference(1))


def case_tp_dp_with_a_one_wide_tp_mesh(world):
    mesh = world.mesh(dp=world.world_size, tp=1)
    assert_parity(train(world, "tp+dp", mesh=mesh), reference(world.world_size))


def case_resume_after_preemption_is_bit_for_bit(world):
    for strategy in ("ddp", "zero1", "fsdp"):
        with shared_dir(world, "axonhpc-trainer-") as directory:
            uninterrupted = train(world, strategy, kind="adam")

            def stop_at_5(trainer, step, loss):
                if step == 5 and trainer.rank == world.world_size - 1:  # one rank only, like a signal
                    trainer.request_stop()

            first = train(world, strategy, kind="adam", checkpoint_dir=directory, on_step=stop_at_5)
            assert first.preempted and first.global_step == 5
            resumed = train(world, strategy, kind="adam", checkpoint_dir=directory)
            assert not resumed.preempted and resumed.global_step == uninterrupted.global_step
            got, want = full_parameters(resumed), full_parameters(uninterrupted)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{strategy} {name}")


def _resumed_equals_uninterrupted(world, strategy, build, data, **fit_args):
    """Train straight; train, stop at step 3 and resume: the parameters and the loss scaler end equal, bit for bit."""
    def run(checkpoint_dir=None, stop_at=None):
        def on_step(trainer, step, loss):
            if step == stop_at:
                trainer.request_stop()

        model = build(world.rank)
        trainer = ax.DistributedTrainer(model, optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                                        strategy=strategy, progress=False, exit_on_preemption=False,
                                        on_step=on_step)
        trainer.fit(data, EPOCHS, batch_size=BATCH, checkpoint_dir=checkpoint_dir, **fit_args)
        return trainer

    with shared_dir(world, "axonhpc-trainer-") as directory:
        straight = run()
        assert run(directory, stop_at=3).preempted
        resumed = run(directory)
    got, want = full_parameters(resumed), full_parameters(straight)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{strategy} {name}")
    if straight.setup.scaler is not None:
        assert resumed.setup.scaler.state_dict() == straight.setup.scaler.state_dict()


def case_resume_keeps_each_ranks_dropout_generator(world):
    # Dropout seeded per rank, as its docstring suggests: every rank's generator comes back, not rank 0's.
    def build(rank):
        return nn.Sequential(nn.Linear(6, 16, dtype=np.float64, seed=0), nn.Dropout(0.3, seed=100 + rank),
                             nn.Linear(16, 3, dtype=np.float64, seed=1))

    for strategy in ("ddp", "fsdp"):
        _resumed_equals_uninterrupted(world, strategy, build, make_data())


def case_resume_keeps_the_loss_scaler(world):
    # float16 mixed precision on inputs large enough that the scaler skips steps before the checkpoint.
    x, y = make_data()
    for strategy in ("ddp", "fsdp"):
        _resumed_equals_uninterrupted(world, strategy, lambda rank: make_float32_model(),
                                      (x.astype(np.float32) * 100, y), mixed_precision=ax.MixedPrecision(np.float16))


def case_an_unusable_checkpoint_dir_or_log_file_is_refused_on_every_rank(world):
    import os

    with shared_dir(world, "axonhpc-trainer-") as directory:
        blocker = os.path.join(directory, "a-file")
        if world.rank == 0:
            open(blocker, "w").close()
        ax.barrier()
        for kwargs, error, mine, theirs in [
                (dict(checkpoint_dir=os.path.join(blocker, "ckpts")), ax.errors.CheckpointError,
                 "cannot be used .*NotADirectoryError", "preparing checkpoint directory .* failed on group ranks \\[0\\]"),
                (dict(log_file=os.path.join(blocker, "metrics.jsonl")), ax.errors.ConfigurationError,
                 "cannot be written: FileExistsError", "cannot be written on group rank 0")]:
            model = make_model()
            trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                            progress=False, log_file=kwargs.pop("log_file", None))
            with pytest.raises(error, match=mine if world.rank == 0 else theirs):
                trainer.fit(make_data(), 1, batch_size=BATCH, **kwargs)
        # Ranks naming different directories: all refused alike, before anything is written.
        mine = os.path.join(directory, f"run-{world.rank}")
        model = make_model()
        trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                        progress=False)
        if world.world_size > 1:
            with pytest.raises(ax.errors.ConfigurationError, match="different checkpoint directories: rank 0 passed"):
                trainer.fit(make_data(), 1, batch_size=BATCH, checkpoint_dir=mine)


def case_a_fresh_run_into_a_directory_of_checkpoints_is_refused(world):
    import os

    with shared_dir(world, "axonhpc-trainer-") as directory:
        first = train(world, epochs=2, checkpoint_dir=directory)
        before = sorted(os.listdir(directory))
        model = make_model()
        fresh = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                      progress=False)
        with pytest.raises(ax.errors.ConfigurationError,
                           match=f"holds an earlier run's checkpoints \\(newest ckpt-{first.global_step:08d}\\)"):
            fresh.fit(make_data(), 1, batch_size=BATCH, checkpoint_dir=directory, resume=False)
        ax.barrier()
        assert sorted(os.listdir(directory)) == before  # nothing written, nothing pruned


def case_a_checkpoint_without_the_trainers_fields_is_refused(world):
    # A checkpoint written by another program (or with an edited index) names what is wrong.
    import os

    from axonhpc.checkpoint import save_per_rank

    with shared_dir(world, "axonhpc-trainer-") as directory:
        trainer = train(world, epochs=1)
        state = {"modules": [trainer.model.state_dict()], "optimizer": trainer.optimizer.state_dict(), "rank": {}}
        for extra, match in [(None, "records no trainer state .* not a dict"),
                             ({"epoch": "1", "step_in_epoch": 0, "global_step": 3, "strategy": "ddp"},
                              "records epoch='1'; the trainer writes an integer >= 0"),
                             ({"epoch": 1, "step_in_epoch": -3, "global_step": 3, "strategy": "ddp"},
                              "records step_in_epoch=-3"),
                             ({"epoch": 1, "step_in_epoch": 0, "strategy": "ddp"}, "records global_step=None")]:
            path = os.path.join(directory, "other")
            save_per_rank(path, state, trainer.setup.group, extra)
            with pytest.raises(ax.errors.CheckpointError, match=match):
                trainer.load_checkpoint(path)


def case_a_checkpoint_of_another_strategy_names_both_strategies(world):
    # DDP's files resumed by zero1 or fsdp failed in terms of the other's format ("ZeroRedundancyOptimizer
    # state dict must have keys ..."); the trainer's own check, made after the load, never ran.
    with shared_dir(world, "axonhpc-trainer-") as directory:
        train(world, epochs=1, checkpoint_dir=directory)
        for strategy in ("zero1", "fsdp"):
            with pytest.raises(ax.errors.ConfigurationError,
                               match=f"was written with strategy 'ddp', this trainer uses '{strategy}'"):
                train(world, strategy, epochs=2, checkpoint_dir=directory)


def case_a_checkpoint_that_does_not_fit_changes_nothing_anywhere(world):
    # Saved with SGD and momentum; resumed by a trainer whose optimizer on the last rank is Adam: that rank
    # names the mismatch, the others refuse with it, and no rank's model or optimizer changed.
    with shared_dir(world, "axonhpc-trainer-") as directory:
        train(world, epochs=1, checkpoint_dir=directory)
        model = make_model(seed=7)
        kind = "adam" if world.rank == world.world_size - 1 else "sgd"
        trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters(), kind), nn.CrossEntropyLoss(),
                                        progress=False)
        before = {k: v.copy() for k, v in model.state_dict().items()}
        if world.rank == world.world_size - 1:
            error, match = ax.errors.StateDictError, "cannot load state dict into Adam"
        else:
            error, match = ax.errors.CheckpointError, "restoring checkpoint .* failed on group ranks"
        with pytest.raises(error, match=match):
            trainer.fit(make_data(), 2, batch_size=BATCH, checkpoint_dir=directory)
        for name, value in model.state_dict().items():  # every rank built seed 7: DDP's copy changes nothing
            np.testing.assert_array_equal(value, before[name], err_msg=name)
        assert all(not st for st in trainer.optimizer.state_dict()["state"])  # no state loaded


def case_evaluate_reduces_over_the_whole_set(world):
    trainer = train(world, "ddp", epochs=1)
    x, y = make_data(37, seed=9)  # not a multiple of the world size
    metrics = trainer.evaluate((x, y), batch_size=5)
    out = trainer.model(x)
    loss_fn = nn.CrossEntropyLoss()
    np.testing.assert_allclose(metrics["loss"], loss_fn(out, y), rtol=1e-12)
    assert metrics["accuracy"] == pytest.approx(float((out.argmax(axis=1) == y).mean()))


def case_nonfinite_gradients_skip_the_step_on_every_rank(world):
    for strategy in ("ddp", "fsdp"):
        x, y = make_data()
        poisoned = x.copy()
        model = make_model(seed=0 if world.rank == 0 else 50 + world.rank)
        before = {}

        def watch(trainer, step, loss):
            if step == 2:  # parameters after step 2, before the poisoned step 3
                before.update(full_parameters(trainer))

        trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                        strategy=strategy, progress=False, verbose=False, on_step=watch,
                                        skip_nonfinite_steps=True)
        # the last rank's third batch holds a NaN: its gradients, and after averaging everyone's, are NaN
        trainer._ensure_setup(None)
        loader = trainer._loader(x, y, BATCH)
        loader.set_epoch(0)
        rows = list(loader.sampler)[2 * BATCH:3 * BATCH] if world.rank == world.world_size - 1 else []
        poisoned[rows, 0] = np.nan
        after = {}
        trainer.on_step = lambda t, step, loss: (watch(t, step, loss), after.update(full_parameters(t))
                                                  if step == 3 else None)
        trainer.fit((poisoned, y), 1, batch_size=BATCH)
        assert trainer.setup.skipped_steps == 1
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=f"{strategy} {name}")
        assert all(np.isfinite(v).all() for v in full_parameters(trainer).values())


def case_a_bad_target_on_one_rank_is_refused_on_every_rank_before_the_update(world):
    """The last rank's third batch holds a class out of range: every rank raises (that rank the loss's error, the
    others one naming it), and no rank has stepped its optimizer for that batch."""
    last = world.world_size - 1
    for strategy, accumulate in (("ddp", 1), ("ddp", 2), ("zero1", 1), ("fsdp", 1), ("tp+dp", 1)):
        x, y = make_data()
        model = make_model(seed=0 if world.rank == 0 else 50 + world.rank)
        before = {}

        def watch(trainer, step, loss):
            if step == 1:  # the parameters after step 1; step 2 holds the bad batch
                before.update(full_parameters(trainer))

        trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                        strategy=strategy, progress=False, verbose=False, on_step=watch,
                                        mesh=world.mesh(dp=world.world_size, tp=1) if strategy == "tp+dp" else None)
        trainer._ensure_setup(None)
        loader = trainer._loader(x, y, BATCH)
        loader.set_epoch(0)
        bad = y.copy()
        if world.rank == last:
            bad[list(loader.sampler)[accumulate * BATCH:(accumulate + 1) * BATCH]] = 7  # step 2's first micro-batch
        if world.rank == last:
            expected, match = ax.errors.ShapeError, r"targets must be in \[0, 3\), got values in \[7, 7\]"
        else:
            expected = ax.errors.CollectiveRefusedError
            match = (rf"the training step refused the batch of rank {last} \(world numbering\): ShapeError: "
                     r"CrossEntropyLoss targets must be in \[0, 3\)")
        with pytest.raises(expected, match=match):
            trainer.fit((x, bad), 1, batch_size=BATCH, grad_accumulation=accumulate)
        assert trainer.global_step == 1, (strategy, accumulate)
        after = full_parameters(trainer)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=f"{strategy} {name}")
        # the trainer goes on after the refusal: the next fit trains on every rank alike
        trainer.on_step = None
        trainer.fit((x, y), 1, batch_size=BATCH, grad_accumulation=accumulate)

    metrics_bad = y.copy()
    if world.rank == last:
        metrics_bad[:] = 9
    expected = ax.errors.ShapeError if world.rank == last else ax.errors.CollectiveRefusedError
    with pytest.raises(expected, match="targets must be in" if world.rank == last else
                       rf"evaluate refused the batch of rank {last}"):
        trainer.evaluate((x, metrics_bad), batch_size=5)
    assert np.isfinite(trainer.evaluate((x, y), batch_size=5)["loss"])


def case_bad_arguments(world):
    model = make_model()
    errors = ax.errors.ConfigurationError
    with pytest.raises(errors, match="unknown strategy 'dp'"):
        ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(), strategy="dp")
    trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(errors, match="batch_size must be a positive int, got 0"):
        trainer.fit(make_data(), 1, batch_size=0)
    with pytest.raises(errors, match="train_arrays: 96 inputs but 5 targets"):
        trainer.fit((make_data()[0], np.zeros(5)), 1)
    with pytest.raises(errors, match="mixed_precision needs strategy 'fsdp', 'ddp' or 'zero1' \\(strategy is "
                                     "'pipeline'\\)"):
        ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(), strategy="pipeline",
                              progress=False).fit(make_data(), 1, mixed_precision=ax.MixedPrecision(np.float16))
    with pytest.raises(errors, match="param_dtype must be float16 or bfloat16, got float32"):
        trainer.fit(make_data(), 1, mixed_precision=ax.MixedPrecision(np.float32))
    with pytest.raises(errors, match="reduce_dtype and buffer_dtype are for strategy='fsdp'"):
        trainer.fit(make_data(), 1, mixed_precision=ax.MixedPrecision(np.float16, reduce_dtype=np.float32))
    with pytest.raises(errors, match="needs mesh="):
        ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                              strategy="tp+dp", progress=False).fit(make_data(), 1)
    ax.barrier()


def make_float32_model(seed=0):
    return nn.Sequential(nn.Linear(6, 16, seed=seed), nn.Tanh(), nn.Linear(16, 3, seed=seed + 1))


def reference_autocast(replicas, epochs=EPOCHS):
    """``reference`` in float32 under nn.autocast(float16) with a loss scaler, each rank's batch on its own.

    A float16 product over the concatenated batch would round differently, so each rank's part is run
    alone and the float32 gradients are averaged, which is what the data-parallel all-reduce computes.
    """
    x, y = make_data()
    model = make_float32_model()
    opt = make_optimizer(model.parameters())
    scaler = ax.GradScaler()  # the trainer's defaults
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        parts = []
        for r in range(replicas):
            sampler = DistributedSampler(len(x), replicas, r, shuffle=True, seed=0, drop_last=True)
            sampler.set_epoch(epoch)
            parts.append(sampler.indices())
        for k in range(0, len(parts[0]), BATCH):
            opt.zero_grad()
            total = [np.zeros_like(p.data) for p in model.parameters()]
            for part in parts:
                rows = part[k:k + BATCH]
                model.zero_grad(set_to_none=True)
                with nn.autocast("float16"):
                    loss_fn(model(x[rows]), y[rows])
                model.backward(loss_fn.backward(scaler.scale(1.0)))
                for t, p in zip(total, model.parameters()):
                    t += p.grad
            for t, p in zip(total, model.parameters()):
                p.grad = t / np.float32(replicas)
            scaler.step(opt)
            scaler.update()
    return model, scaler


def case_ddp_and_zero1_autocast_float16(world):
    """fit(mixed_precision=MixedPrecision(float16)) with ddp and zero1: float32 masters, float16 products."""
    ref, ref_scaler = reference_autocast(world.world_size)
    for strategy in ("ddp", "zero1"):
        model = make_float32_model(seed=0 if world.rank == 0 else 50 + world.rank)
        trainer = ax.DistributedTrainer(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                        strategy=strategy, progress=False, exit_on_preemption=False)
        trainer.fit(make_data(), EPOCHS, batch_size=BATCH, mixed_precision=ax.MixedPrecision(np.float16))
        assert trainer.setup.compute_dtype == np.float16
        assert trainer.setup.scaler.scale_value == ref_scaler.scale_value
        assert trainer.setup.scaler.skipped_steps == ref_scaler.skipped_steps
        assert all(p.data.dtype == np.float32 for p in model.parameters())
        assert_parity(trainer, ref, tol=1e-5)
        metrics = trainer.evaluate(make_data())
        assert np.isfinite(metrics["loss"])


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}
CASES.update(_strategy_cases())
