"""Write, per rank, the BLAS pool size init chose (threadpoolctl's view) and its plan to ``--out DIR``/rank<r>.json;
used by tests/launch/test_threads.py.

``--fake-cores N`` makes every rank report N usable CPUs (0..N-1, the same set: they overlap);
``--fake-disjoint N`` gives rank r the CPUs r*N..r*N+N-1 (no overlap). The affinity masks still travel
with the node table through the real init.
"""
import json
import sys

import os

import axonhpc as ax
import axonhpc.groups.world
import axonhpc.threads as threads
from threadpoolctl import threadpool_info

if "--fake-cores" in sys.argv or "--fake-disjoint" in sys.argv:
    disjoint = "--fake-disjoint" in sys.argv
    n = int(sys.argv[sys.argv.index("--fake-disjoint" if disjoint else "--fake-cores") + 1])
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    first = rank * n if disjoint else 0
    axonhpc.groups.world.usable_cores = lambda: frozenset(range(first, first + n))  # what World.__init__ reads

world = ax.init()
plan = threads.current_plan()
blas = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
out = sys.argv[sys.argv.index("--out") + 1]
with open(os.path.join(out, f"rank{world.rank}.json"), "w") as f:
    json.dump({"rank": world.rank, "blas": blas, "threads": plan.threads, "cores": plan.cores,
               "sharing": plan.sharing, "chosen": plan.chosen}, f)
