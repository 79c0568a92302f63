"""A strategy that rebuilds the optimizer says clearly when the optimizer's class cannot be rebuilt (issue 18).

The check lives in ``axonhpc/trainer/optimizers.py`` (``check_rebuildable``, called by ``build`` before the
wrapper sends anything and by ``rebuild_optimizer``).
"""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.errors import ConfigurationError


class PlainSGD(optim.SGD):
    """An optimizer whose constructor takes only ``lr``; its hyperparameters() still lists momentum & co."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_an_optimizer_class_without_momentum_gets_a_configuration_error(strategy):
    model = nn.Sequential(nn.Linear(4, 2, seed=0))
    trainer = ax.DistributedTrainer(model, PlainSGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                    strategy=strategy, verbose=False)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    y = np.zeros(8, dtype=np.int64)
    with pytest.raises(ConfigurationError, match=r"PlainSGD.*momentum.*lambda params"):
        ax.run_local(lambda world: trainer.fit((x, y), 1, batch_size=4), world_size=1)


@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "pipeline"])
def test_the_check_comes_before_the_wrapper_on_every_rank(strategy, monkeypatch):
    """No wrapper (whose constructor communicates) is built before the check: every rank raises, none waits."""
    from axonhpc.trainer import strategies

    def built(*args, **kwargs):
        raise AssertionError("the wrapper was built before the optimizer was checked")

    for name in ("DDP", "FSDP"):
        monkeypatch.setattr(strategies, name, built)
    monkeypatch.setattr(strategies.Pipeline, "from_modules", built)
    model = nn.Sequential(nn.Linear(4, 4, seed=0), nn.Tanh(), nn.Linear(4, 2, seed=1))
    trainer = ax.DistributedTrainer(model, PlainSGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                    strategy=strategy, verbose=False)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    y = np.zeros(8, dtype=np.int64)
    seen = []

    def fit(world):
        try:
            trainer.fit((x, y), 1, batch_size=2)
        except ConfigurationError as exc:
            seen.append((world.rank, str(exc)))

    ax.run_local(fit, world_size=2)
    assert sorted(rank for rank, _ in seen) == [0, 1]
    text = seen[0][1]
    assert "PlainSGD(params, lr)" in text
    assert "does not take momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False" in text
    assert "optimizer=lambda params: PlainSGD(params, lr=0.1)" in text


def test_check_rebuildable_names_what_is_missing_and_passes_good_optimizers():
    from axonhpc.trainer.optimizers import check_rebuildable, rebuild_optimizer

    class NeedsScale(optim.SGD):
        def __init__(self, params, lr, scale, **rest):
            super().__init__(params, lr=lr * scale, **rest)

    params = nn.Linear(2, 2, seed=0).parameters()
    with pytest.raises(ConfigurationError, match=r"NeedsScale.*needs scale, which hyperparameters\(\) does not report"):
        check_rebuildable(NeedsScale(params, lr=0.1, scale=2.0))
    for good in (optim.SGD(params, lr=0.1, momentum=0.9), optim.Adam(params, lr=1e-3), optim.AdamW(params)):
        check_rebuildable(good)
        again = rebuild_optimizer(good, params)
        assert type(again) is type(good) and again.hyperparameters() == good.hyperparameters()
    check_rebuildable(lambda ps: optim.SGD(ps, lr=0.1))  # a callable is not checked: it is called as given
    with pytest.raises(ConfigurationError, match="PlainSGD"):
        rebuild_optimizer(PlainSGD(params, lr=0.1), params)


@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "pipeline"])
def test_the_suggested_callable_trains(strategy):
    """What the message suggests works: ``optimizer=lambda params: PlainSGD(params, lr=0.1)``, on 2 ranks."""
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    losses = []

    def fit(world):
        model = nn.Sequential(nn.Linear(4, 8, seed=0), nn.Tanh(), nn.Linear(8, 2, seed=1))
        options = {"num_microbatches": 2} if strategy == "pipeline" else {}
        trainer = ax.DistributedTrainer(model, lambda params: PlainSGD(params, lr=0.5), nn.CrossEntropyLoss(),
                                        strategy=strategy, verbose=False, progress=False, **options)
        history = trainer.fit((x, y), 3, batch_size=4)
        losses.append([record["loss"] for record in history])

    ax.run_local(fit, world_size=2)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]
