"""FSDP on cupy arrays with CPU offload, on one rank (no communication): runs only where a GPU exists.

No GPU is lent to this project, so these tests have never run here; they skip.
"""
import importlib

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.backends.devices import device_facts

# cupy itself when a CUDA device is usable here (the library's own probe), else None: skip.
cupy = importlib.import_module("cupy") if device_facts().devices > 0 else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy is None, reason="needs cupy and a CUDA device")]


def _train(offload, device):
    model = nn.Sequential(nn.Linear(6, 8, dtype=np.float32, seed=0), nn.Tanh(), nn.Linear(8, 3, dtype=np.float32,
                                                                                           seed=1))
    if device:
        model.to("cuda")
    fsdp = ax.FSDP(model, group=ax.ProcessGroup.mock(), cpu_offload=offload)
    opt = optim.SGD(fsdp.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    target = np.zeros((4, 3), dtype=np.float32)
    if device:
        x, target = cupy.asarray(x), cupy.asarray(target)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(fsdp(x), target)
        fsdp.backward(loss_fn.backward())
        opt.step()
    return fsdp


@pytest.mark.parametrize("offload", ["none", "params", "optimizer_states", "full"])
def test_offloaded_master_shards_live_on_the_host_and_match_host_training(offload):
    fsdp = _train(offload, device=True)
    host = offload != "none"
    for p in fsdp.parameters():
        assert isinstance(p.data, np.ndarray) == host
        assert isinstance(p.grad, np.ndarray) == host
    reference = _train("none", device=False)
    for p, q in zip(fsdp.parameters(), reference.parameters()):
        got = p.data if isinstance(p.data, np.ndarray) else p.data.get()
        np.testing.assert_allclose(got, q.data, rtol=1e-5, atol=1e-6)
