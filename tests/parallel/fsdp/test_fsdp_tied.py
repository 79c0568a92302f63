"""FSDP and weight tying across a unit and the root unit: refused on every rank before anything is sent; tied
modules both left to the root unit train as one process does. Threads as ranks (1-4) and MPI ranks."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from support.runner import mpi_test, threads_test

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
ROWS = 3  # per rank


def _tied_model():
    """``Sequential(a, Tanh, b, Tanh, head)`` where ``b`` holds ``a``'s weight and bias."""
    a = nn.Linear(4, 4, dtype=np.float64, seed=0)
    b = nn.Linear(4, 4, dtype=np.float64, seed=1)
    b.weight, b.bias = a.weight, a.bias
    head = nn.Linear(4, 2, dtype=np.float64, seed=2)
    return nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), head)


class _Scaled(nn.Module):
    """A model holding its child's weight as a parameter of its own as well."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=np.float64, seed=0)
        self.w = self.lin.weight

    def forward(self, x):
        return self.lin(x) @ self.w

    def backward(self, g):
        raise AssertionError("never called: the wrapper refuses the model")


def _options(strategy):
    return dict(sharding_strategy=strategy, **({"ranks_per_node": 1} if strategy == "hybrid_shard" else {}))


def case_tie_across_a_unit_and_the_root_unit_is_refused(world):
    for strategy in STRATEGIES:
        for listed, unit, root in ((0, "0", "2"), (2, "2", "0")):
            model = _tied_model()
            match = (f"parameter '{unit}.weight' of FSDP unit '{unit}' is also '{root}.weight' of module '{root}', "
                     f"which no unit holds \\(it is left to the root unit\\); list the modules that share it in one "
                     f"unit, or leave both out of units=\\[...\\]")
            with pytest.raises(ax.errors.ConfigurationError, match=match):
                ax.FSDP(model, units=[model[listed], model[4]], **_options(strategy))
            ax.barrier()  # every rank is still in step: nothing was sent by the failed constructor
    model = _Scaled()
    with pytest.raises(ax.errors.ConfigurationError,
                       match="parameter 'lin.weight' of FSDP unit 'lin' is also 'w' of the model itself"):
        ax.FSDP(model, units=[model.lin])
    ax.barrier()


def case_tied_modules_left_to_the_root_unit_train_as_one_process(world):
    """units=[head]: ``a`` and ``b`` go to the root unit together; one SGD step equals one process's on the
    whole batch (the tied gradient is the sum of both uses, averaged over the ranks)."""
    n, r = world.world_size, world.rank
    x = np.random.default_rng(7).standard_normal((n * ROWS, 4))
    reference = _tied_model()
    out = reference(x)
    reference.backward(np.ones_like(out) / n)
    optim.SGD(reference.parameters(), lr=0.1).step()
    for strategy in STRATEGIES:
        model = _tied_model()
        fsdp = ax.FSDP(model, units=[model[4]], **_options(strategy))
        opt = optim.SGD(fsdp.parameters(), lr=0.1)
        out = fsdp(x[r * ROWS:(r + 1) * ROWS])
        fsdp.backward(np.ones_like(out))
        opt.step()
        full = fsdp.full_state_dict(rank0_only=False)
        for name, value in reference.state_dict().items():
            np.testing.assert_allclose(full[name], value, rtol=1e-12, atol=1e-12, err_msg=f"{strategy}: {name}")


CASES = {name: fn for name, fn in globals().items() if name.startswith("case_")}

test_tied_case_on_threads = threads_test(CASES, sizes=(1, 2, 3, 4))
test_tied_case_on_mpi_ranks = mpi_test(CASES, min_size=2, marks=[pytest.mark.timeout(300)])
