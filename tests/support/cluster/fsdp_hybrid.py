"""Run on simulated hosts: FSDP HYBRID_SHARD over the real node layout equals single-process training.

    python fsdp_hybrid.py TESTS_DIR     (TESTS_DIR holds support/ddp_cases.py)
"""
import sys

import numpy as np

import axonhpc as ax
from axonhpc import nn

sys.path.insert(0, sys.argv[1])
from support.ddp_cases import STEPS, make_data, make_model, make_optimizer, shard, train_reference  # noqa: E402

world = ax.init()
n, r = world.world_size, world.rank
fsdp = ax.FSDP(make_model(seed=0 if r == 0 else 1000 + r), sharding_strategy="hybrid_shard")
assert fsdp.shard_world_size == world.local_size, (fsdp.shard_world_size, world.local_size)
assert fsdp.replicate_group.size == world.num_nodes, (fsdp.replicate_group.size, world.num_nodes)
opt = make_optimizer("adam", fsdp.parameters())
loss_fn = nn.CrossEntropyLoss()
for step in range(STEPS):
    opt.zero_grad()
    x, y = make_data(step)
    loss_fn(fsdp(shard(x, r, n)), shard(y, r, n))
    fsdp.backward(loss_fn.backward())
    opt.step()
full = fsdp.full_state_dict(rank0_only=True)
if r == 0:
    for name, value in train_reference(np.float64, "adam").state_dict().items():
        np.testing.assert_allclose(full[name], value, rtol=1e-12, atol=1e-12, err_msg=name)
    print(f"hybrid ok: {world.num_nodes} nodes x {world.local_size} ranks", flush=True)
