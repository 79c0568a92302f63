"""Optimizers and clipping against torch.optim over several steps (skipped without torch)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from axonhpc import nn, optim  # noqa: E402

CASES = [
    (optim.SGD, torch.optim.SGD, dict(lr=0.1)),
    (optim.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01)),
    (optim.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (optim.Adam, torch.optim.Adam, dict(lr=1e-2)),
    (optim.Adam, torch.optim.Adam, dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
    (optim.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (optim.AdamW, torch.optim.AdamW, dict(lr=3e-2, betas=(0.5, 0.9), eps=1e-4, weight_decay=0.3)),
]


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-6)])
@pytest.mark.parametrize("ours_cls,torch_cls,kwargs", CASES)
def test_optimizer_parity(ours_cls, torch_cls, kwargs, dtype, rtol):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((4, 3)).astype(dtype), rng.standard_normal(7).astype(dtype)]
    ours = [nn.Parameter(v.copy()) for v in values]
    theirs = [torch.tensor(v.copy(), requires_grad=True) for v in values]
    opt = ours_cls(ours, **kwargs)
    topt = torch_cls(theirs, **kwargs)
    for _ in range(8):
        for p, tp in zip(ours, theirs):
            g = rng.standard_normal(p.shape).astype(dtype)
            p.grad = g.copy()
            tp.grad = torch.tensor(g)
        opt.step()
        topt.step()
    for p, tp in zip(ours, theirs):
        np.testing.assert_allclose(p.data, tp.detach().numpy(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_parity(norm_type, max_norm):
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((5, 2)), rng.standard_normal(3)]
    ours = [nn.Parameter(np.zeros_like(g)) for g in grads]
    theirs = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads]
    for p, tp, g in zip(ours, theirs, grads):
        p.grad = g.copy()
        tp.grad = torch.tensor(g)
    total = optim.clip_grad_norm(ours, max_norm, norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert total == pytest.approx(ttotal.item(), rel=1e-13)
    for p, tp in zip(ours, theirs):
        np.testing.assert_allclose(p.grad, tp.grad.numpy(), rtol=1e-13)


def test_training_loop_parity():
    """A small MLP trained for several steps with AdamW and clipping follows PyTorch."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 6))
    y = rng.integers(0, 3, 16)
    model = nn.Sequential(nn.Linear(6, 8, dtype=np.float64, seed=0), nn.GELU(), nn.LayerNorm(8, dtype=np.float64),
                          nn.Linear(8, 3, dtype=np.float64, seed=1))
    tmodel = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.LayerNorm(8),
                                 torch.nn.Linear(8, 3)).double()
    tmodel.load_state_dict({k: torch.tensor(v) for k, v in model.state_dict().items()})
    loss_fn = nn.CrossEntropyLoss()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-2)
    for _ in range(10):
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        optim.clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(tmodel(torch.tensor(x)), torch.tensor(y))
        tloss.backward()
        torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 0.5)
        topt.step()
        topt.zero_grad()
        assert loss == pytest.approx(tloss.item(), rel=1e-10)
    for (name, p), tp in zip(model.named_parameters(), tmodel.parameters()):
        np.testing.assert_allclose(p.data, tp.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
