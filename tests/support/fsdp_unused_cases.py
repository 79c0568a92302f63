"""FSDP units a backward does not reach, against a single-process reference ([Note: units and hooks] and
[Note: a unit no rank's backward reached] in ``parallel/fsdp/hooks.py``).

- A unit skipped on some ranks only, under NO_SHARD (which gathers nothing, so no all-gather tells the ranks
  apart; the sharded strategies' forward gathers differ and raise CollectiveMismatchError): its reduction came
  at the end of the backward there and in its place elsewhere, and two units of one size swapped gradients.
- A unit no rank reached: it got a zero gradient, and momentum and weight decay moved it.
"""
import numpy as np

import axonhpc as ax
from axonhpc import nn, optim

STEPS = 3
ROWS = 4  # per rank


class Skipping(nn.Module):
    """Three units of one size; ``b`` is skipped where ``skip`` says, ``head`` used only where ``use_head``."""

    def __init__(self, seed=0):
        super().__init__()
        self.a = nn.Linear(4, 4, dtype=np.float64, seed=1 + seed)
        self.b = nn.Linear(4, 4, dtype=np.float64, seed=2 + seed)
        self.c = nn.Linear(4, 4, dtype=np.float64, seed=3 + seed)
        self.head = nn.Linear(4, 4, dtype=np.float64, seed=4 + seed)
        self.skip = self.use_head = False

    def forward(self, x):
        h = self.a(x)
        if not self.skip:
            h = self.b(h)
        return self.head(h) if self.use_head else self.c(h)

    def backward(self, g):
        g = self.head.backward(g) if self.use_head else self.c.backward(g)
        if not self.skip:
            g = self.b.backward(g)
        return self.a.backward(g)


def _data(rank, step):
    return np.random.default_rng(100 * step + rank).standard_normal((ROWS, 4))


def _optimizer(params):
    return optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _reference(n, skip_on, head_at, set_to_none):
    """One model; each step's gradient is the ranks' mean, a rank without one adding zeros, and a parameter that
    no rank had one for is left None (as DDP with find_unused_parameters and a single process leave it)."""
    model = Skipping()
    opt = _optimizer(model.parameters())
    params = dict(model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        before = {name: None if p.grad is None else p.grad.copy() for name, p in params.items()}
        total = {}
        for rank in range(n):
            replica = Skipping()
            replica.load_state_dict(model.state_dict())
            replica.skip, replica.use_head = rank in skip_on(step), step in head_at
            out = replica(_data(rank, step))
            replica.backward(np.ones_like(out) / out.size / n)
            for name, p in replica.named_parameters():
                if p.grad is not None:
                    total[name] = total.get(name, 0) + p.grad
        for name, p in params.items():
            if name in total:
                p.grad = total[name] if before[name] is None else before[name] + total[name]
        opt.step()
    return model.state_dict()


def _fsdp(world, strategy, skip_on, head_at, set_to_none):
    model = Skipping(seed=0 if world.rank == 0 else 9)  # FSDP starts every rank from rank 0's values
    fsdp = ax.FSDP(model, units=[model.a, model.b, model.c, model.head], sharding_strategy=strategy)
    opt = _optimizer(fsdp.parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        model.skip, model.use_head = world.rank in skip_on(step), step in head_at
        out = fsdp(_data(world.rank, step))
        fsdp.backward(np.ones_like(out) / out.size)  # averaged over the ranks by the reduction
        opt.step()
    return fsdp.full_state_dict(rank0_only=False)


def _check(world, strategy, skip_on, head_at, set_to_none):
    want = _reference(world.world_size, skip_on, head_at, set_to_none)
    got = _fsdp(world, strategy, skip_on, head_at, set_to_none)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=name)


def case_a_unit_skipped_on_some_ranks_is_reduced_in_its_place(world):
    # b is skipped on the last rank in step 0 and on every odd rank in step 1: a and b (one size) swapped.
    n = world.world_size
    skip_on = lambda step: {n - 1} if step == 0 else {r for r in range(n) if r % 2} if step == 1 else set()  # noqa
    _check(world, "no_shard", skip_on, head_at=(), set_to_none=True)


def case_a_unit_no_rank_reached_keeps_no_gradient(world):
    # head is used only in the last step: before it, momentum and weight decay moved it on zero gradients.
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        for set_to_none in (True, False):
            _check(world, strategy, lambda step: set(), head_at=(STEPS - 1,), set_to_none=set_to_none)


def case_a_unit_skipped_everywhere_in_one_step_only(world):
    # b skipped on every rank in step 1: its gradient None there (momentum only, as a single process does).
    n = world.world_size
    _check(world, "full_shard", lambda step: set(range(n)) if step == 1 else set(), head_at=(), set_to_none=True)


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}
