"""DDP parity with single-process training: threads as ranks (1-4) and MPI ranks."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.parallel.ddp.wrapper import FIRST_BUCKET_BYTES
from support.ddp_cases import CASES, make_model
from support.runner import case_tests


test_ddp_case_local, test_ddp_case_mpi = case_tests(CASES)


def test_first_bucket_is_small():
    big = ax.nn.Sequential(*[ax.nn.Linear(512, 512, dtype=np.float64, seed=i) for i in range(4)])
    ddp = ax.DDP(big, group=ax.ProcessGroup.mock())
    first = ddp.bucket_plan[0]
    sizes = dict((n, p.data.nbytes) for n, p in ddp.named_parameters())
    assert first[0] == "3.bias"
    assert sum(sizes[n] for n in first) <= FIRST_BUCKET_BYTES or len(first) == 1
    assert len(ddp.bucket_plan) == 2  # 4 KiB first bucket, then the rest under the 25 MiB cap


def test_bad_arguments():
    with pytest.raises(ax.errors.ConfigurationError, match="bucket_size_mb must be positive, 'auto' or None, got 0"):
        ax.DDP(make_model(), group=ax.ProcessGroup.mock(), bucket_size_mb=0)
    with pytest.raises(ValueError, match="unknown gradient sync strategy 'sometimes'"):
        ax.DDP(make_model(), group=ax.ProcessGroup.mock(), strategy="sometimes")
    with pytest.raises(ax.errors.ConfigurationError, match="has none"):
        ax.DDP(ax.nn.Sequential(ax.nn.ReLU()), group=ax.ProcessGroup.mock())


def test_train_and_eval_switch_the_wrapped_model_and_return_the_wrapper():
    model = ax.nn.Sequential(ax.nn.Linear(4, 4, seed=0), ax.nn.Dropout(0.5, seed=1))
    for wrapper in (ax.DDP(model, group=ax.ProcessGroup.mock()), ax.FSDP(model, group=ax.ProcessGroup.mock())):
        assert wrapper.eval() is wrapper and not any(m.training for m in model.modules())
        assert wrapper.train() is wrapper and all(m.training for m in model.modules())
        assert wrapper.train(False) is wrapper and not model[1].training
        wrapper.train()
