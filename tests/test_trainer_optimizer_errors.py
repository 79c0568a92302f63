"""A strategy that rebuilds the optimizer says clearly when the optimizer's class cannot be rebuilt (issue 18).

The fix lives in ``axonhpc/trainer/strategies.py`` (``rebuild_optimizer`` and the ``zero1`` branch); until
it lands this test is a strict xfail, so it fails (XPASS) the moment the fix makes it pass and the marker
must then go.
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


@pytest.mark.xfail(strict=True, raises=TypeError,
                   reason="pending: trainer/strategies.py rebuilds the optimizer without checking its signature")
@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_an_optimizer_class_without_momentum_gets_a_configuration_error(strategy):
    model = nn.Sequential(nn.Linear(4, 2, seed=0))
    trainer = ax.DistributedTrainer(model, PlainSGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                    strategy=strategy, verbose=False)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    y = np.zeros(8, dtype=np.int64)
    with pytest.raises(ConfigurationError, match=r"PlainSGD.*momentum.*lambda params"):
        ax.run_local(lambda world: trainer.fit((x, y), 1, batch_size=4), world_size=1)
