"""An FSDP run preempted mid-epoch and resumed on another number of ranks trains each sample of the epoch
once: the rest of the epoch's order, cut for the new world ([Note: resume] in trainer.trainer)."""
import shutil
import tempfile

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.data import DistributedSampler

N, BATCH, EPOCHS = 50, 4, 2


def data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((N, 6)), rng.integers(0, 3, N)


def model():
    return nn.Sequential(nn.Linear(6, 5, dtype=np.float64, seed=0), nn.Tanh(),
                         nn.Linear(5, 3, dtype=np.float64, seed=1))


def reference(first_width, stop_after, second_width):
    """One process: the global batches the two worlds see, each a mean over its samples.

    Width W splits an epoch's order o (drop_last) as o[r::W][:len//W] per rank, batches of BATCH per rank;
    step k's global batch is the union of the ranks' k-th batches. After ``stop_after`` steps of the first
    epoch at ``first_width``, the rest of that epoch's order is split at ``second_width``; later epochs whole.
    """
    x, y = data()
    m = model()
    opt = optim.SGD(m.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()

    def steps(order, width, limit=None):
        shares = [order[r::width][:len(order) // width] for r in range(width)]
        count = -(-len(shares[0]) // BATCH)
        for k in range(count if limit is None else limit):
            yield np.concatenate([s[k * BATCH:(k + 1) * BATCH] for s in shares])

    for epoch in range(EPOCHS):
        sampler = DistributedSampler(N, 1, 0, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(epoch)
        order = sampler.indices()
        if epoch == 0:
            head = (len(order) // first_width) * first_width
            batches = list(steps(order[:head], first_width, stop_after))
            done = stop_after * BATCH * first_width
            batches += list(steps(order[done:], second_width))
        else:
            batches = list(steps(order, second_width))
        for rows in batches:
            opt.zero_grad()
            loss_fn(m(x[rows]), y[rows])
            m.backward(loss_fn.backward())
            opt.step()
    return m


@pytest.mark.parametrize("first,second,stop", [(2, 3, 4), (3, 2, 2), (4, 1, 1), (1, 4, 5)])
def test_resumed_on_another_world_size_trains_the_rest_of_the_epoch(first, second, stop):
    directory = tempfile.mkdtemp(prefix="axonhpc-resize-")
    seen = {}

    def run(world, stop_at=None):
        def on_step(trainer, step, loss):
            if step == stop_at:
                trainer.request_stop()

        m = model()
        trainer = ax.DistributedTrainer(m, optim.SGD(m.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                        strategy="fsdp", progress=False, exit_on_preemption=False, on_step=on_step)
        trainer.fit(data(), EPOCHS, batch_size=BATCH, checkpoint_dir=directory)
        full = trainer.setup.wrapper.full_state_dict(rank0_only=False)
        if world.rank == 0:
            seen["params"] = full
            seen["preempted"] = trainer.preempted

    try:
        ax.run_local(lambda w: run(w, stop_at=stop), world_size=first)
        assert seen["preempted"]
        ax.run_local(run, world_size=second)
        assert not seen["preempted"]
        want = reference(first, stop, second).state_dict()
        for name, value in want.items():
            np.testing.assert_allclose(seen["params"][name], value, rtol=1e-12, atol=1e-13, err_msg=name)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
