"""Run on simulated hosts: each rank writes its node facts, its node group and collective results as JSON lines."""
import json
import socket
import sys

import numpy as np

import axonhpc as ax
from axonhpc.collectives.shm_path import plain_route

world = ax.init()
node = world.node_group()
x = np.full(1000, world.rank + 1.0)
flat, hier = x.copy(), x.copy()
ax.all_reduce(flat)
ax.all_reduce(hier, algorithm="hierarchical")
on_node = x.copy()
ax.all_reduce(on_node, group=node)  # the node group's all-reduce: through its shared memory
facts = {"rank": world.rank, "size": world.world_size, "host": socket.gethostname(), "local_rank": world.local_rank,
         "local_size": world.local_size, "node_rank": world.node_rank, "num_nodes": world.num_nodes,
         "node_group": list(node.ranks), "flat": float(flat[0]), "hierarchical": float(hier[0]),
         "equal": bool(np.array_equal(flat, hier)), "node_of": list(world.node_of),
         "one_node": [world.default_group.on_one_node, node.on_one_node],
         "engines": [plain_route(world.default_group)[0] is not None, plain_route(node)[0] is not None],
         "on_node": float(on_node[0])}
everyone = ax.gather(np.frombuffer(json.dumps(facts).ljust(512).encode(), dtype=np.uint8).copy())
if world.rank == 0:
    for row in everyone:
        sys.stdout.write(row.tobytes().decode().strip() + "\n")
    sys.stdout.flush()
