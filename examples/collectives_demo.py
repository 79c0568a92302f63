"""A multi-rank tour of axonhpc's collectives; rank 0 prints what happened.

    mpiexec -n 2 python examples/collectives_demo.py      (or: axonhpc launch -n 4 -- examples/collectives_demo.py)

Every rank fills its arrays from its own rank number, so each printed result
can be checked by hand; the script also checks them itself and exits non-zero
if any rank saw a wrong value.
"""
import sys

import numpy as np

import axonhpc as ax


def say(world, text):
    if world.rank == 0:
        print(text, flush=True)


def main() -> int:
    world = ax.init()
    n, r = world.world_size, world.rank
    say(world, f"world: {n} ranks on {world.num_nodes} node(s), backend {world.backend.name}")
    facts = ax.gather(np.array([world.rank, world.local_rank, world.node_rank]), dst=0)
    if r == 0:
        for rank, local, node in facts:
            print(f"  rank {rank}: local rank {local} on node {node}")
    problems = []

    x = np.full(4, r + 1.0, dtype=np.float32)
    ax.all_reduce(x)
    say(world, f"all_reduce SUM of (rank + 1): {x[0]:g}   (expected {n * (n + 1) / 2:g})")
    if x[0] != n * (n + 1) / 2:
        problems.append(f"all_reduce gave {x[0]}")

    m = np.full(3, float(r))
    ax.all_reduce_mean(m)
    say(world, f"all_reduce mean of rank: {m[0]:g}   (expected {(n - 1) / 2:g})")

    b = np.arange(3, dtype=np.int64) * 7 if r == 0 else np.zeros(3, dtype=np.int64)
    ax.broadcast(b, src=0)
    say(world, f"broadcast from rank 0: {b.tolist()}")
    if b.tolist() != [0, 7, 14]:
        problems.append(f"broadcast gave {b.tolist()}")

    g = ax.all_gather(np.array([r * r]))
    say(world, f"all_gather of rank^2: {g.ravel().tolist()}")

    part = ax.reduce_scatter(np.arange(2 * n, dtype=np.float64))
    say(world, f"reduce_scatter of arange({2 * n}) on every rank: rank 0 keeps {part.tolist()}")
    if part.tolist() != [n * 2.0 * r, n * (2.0 * r + 1)]:
        problems.append(f"reduce_scatter gave {part.tolist()}")

    evens = world.split(r % 2)
    s = np.array([r])
    ax.all_reduce(s, group=evens)
    say(world, f"split by parity: rank 0's group {list(evens.ranks)} sums ranks to {s[0]}")

    if n >= 2:
        ring = np.empty(2)
        works = [ax.irecv(ring, (r - 1) % n, tag=1), ax.isend(np.full(2, float(r)), (r + 1) % n, tag=1)]
        for w in works:
            w.wait()
        say(world, f"ring send/recv: rank 0 received {ring[0]:g} from rank {(r - 1) % n}")
        if ring[0] != (r - 1) % n:
            problems.append(f"ring received {ring[0]}")

    verdicts = ax.gather(np.array([len(problems)]), dst=0)
    ok = True if r != 0 else int(verdicts.sum()) == 0
    say(world, "all checks passed on every rank" if ok else f"FAILED: {int(verdicts.sum())} problem(s)")
    for p in problems:
        print(f"rank {r}: {p}", file=sys.stderr, flush=True)
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
