"""ZeroRedundancyOptimizer (ZeRO-1) parity with single-process training: threads as ranks (1-4) and MPI ranks."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc import optim
from support.ddp_cases import make_model
from support.runner import case_tests
from support.zero_cases import CASES


test_zero_case_local, test_zero_case_mpi = case_tests(CASES)


def test_bad_arguments():
    mock = ax.ProcessGroup.mock()
    params = make_model().parameters()
    with pytest.raises(ax.errors.ConfigurationError, match="got an instance of SGD; pass the class"):
        ax.ZeroRedundancyOptimizer(optim.SGD(params, lr=0.1), params, group=mock)
    with pytest.raises(ax.errors.ConfigurationError, match="optimizer_class.*got 'adam'"):
        ax.ZeroRedundancyOptimizer("adam", params, group=mock)
    with pytest.raises(ax.errors.ConfigurationError, match=r"params\[1\] is a ndarray, not a Parameter"):
        ax.ZeroRedundancyOptimizer(optim.Adam, [params[0], np.zeros(3)], group=mock)
    with pytest.raises(ax.errors.ConfigurationError, match="params must be an iterable.*got a int"):
        ax.ZeroRedundancyOptimizer(optim.Adam, 3, group=mock)
    with pytest.raises(ax.errors.ConfigurationError, match=r"params\[2\] is the same Parameter as params\[0\] "
                                                           r"\(shape \(16, 6\), dtype float64\)"):
        ax.ZeroRedundancyOptimizer(optim.Adam, [params[0], params[1], params[0]], group=mock)
    with pytest.raises(ax.errors.ConfigurationError, match=r"betas must be two numbers in \[0, 1\), got \(0\.9, 1\.5\)"):
        ax.ZeroRedundancyOptimizer(optim.Adam, params, group=mock, betas=(0.9, 1.5))
    with pytest.raises(ax.errors.ConfigurationError, match=r"SGD takes no hyperparameter 'moment' \(got moment=0.9\); "
                                                          r"it takes \['lr', 'momentum', .*\]; did you mean 'momentum'\?"):
        ax.ZeroRedundancyOptimizer(optim.SGD, params, group=mock, lr=0.1, moment=0.9)
    with pytest.raises(TypeError, match="group must be a ProcessGroup or None, got int"):
        ax.ZeroRedundancyOptimizer(optim.Adam, params, group=0)
    view = ax.nn.Parameter(np.zeros((4, 4))[:, ::2])
    with pytest.raises(ax.errors.NonContiguousBufferError, match=r"params\[0\]\.data"):
        ax.ZeroRedundancyOptimizer(optim.Adam, [view], group=mock)
    with pytest.raises(ax.errors.UnsupportedDtypeError, match=r"params\[0\]\.data has dtype complex128"):
        ax.ZeroRedundancyOptimizer(optim.Adam, [ax.nn.Parameter(np.zeros(3, dtype=complex))], group=mock)


def test_wrong_gradient_shape_raises_before_sending():
    model = make_model()
    opt = ax.ZeroRedundancyOptimizer(optim.SGD, model.parameters(), group=ax.ProcessGroup.mock(), lr=0.1)
    before = [p.data.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad = np.zeros_like(p.data)
    model.parameters()[2].grad = np.zeros(3)
    with pytest.raises(ax.errors.ShapeError, match=r"params\[2\]\.grad has shape \(3,\), the parameter has \(8, 16\)"):
        opt.step()
    assert all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))


def test_state_dict_errors_name_the_keys():
    model = make_model()
    opt = ax.ZeroRedundancyOptimizer(optim.Adam, model.parameters(), group=ax.ProcessGroup.mock())
    with pytest.raises(ax.errors.StateDictError, match=r"got \['hyperparameters', 'state'\]"):
        opt.load_state_dict(opt.optimizer.state_dict())  # the inner optimizer's dict, not the wrapper's


def test_repr_shows_the_ranges():
    opt = ax.ZeroRedundancyOptimizer(optim.Adam, make_model().parameters(), group=ax.ProcessGroup.mock())
    assert "float64[0:275] of 275" in repr(opt)


def test_a_function_params_to_optimizer_is_taken_in_place_of_a_class():
    """For a class whose constructor does not take its hyperparameters by name (the trainer's zero1 uses this)."""
    mock = ax.ProcessGroup.mock()
    model = make_model()
    opt = ax.ZeroRedundancyOptimizer(lambda ps: optim.SGD(ps, lr=0.5, momentum=0.9), model.parameters(), group=mock)
    assert isinstance(opt.optimizer, optim.SGD) and opt.lr == 0.5 and opt.momentum == 0.9
    before = [p.data.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad = np.ones_like(p.data)
    opt.step()
    assert all(np.allclose(p.data, b - 0.5) for p, b in zip(model.parameters(), before))
    with pytest.raises(ax.errors.ConfigurationError, match="returned a list, not an axonhpc.optim.Optimizer"):
        ax.ZeroRedundancyOptimizer(lambda ps: list(ps), model.parameters(), group=mock)
