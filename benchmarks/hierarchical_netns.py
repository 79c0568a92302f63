"""All-reduce algorithms (native, hierarchical, ring, rhd) across simulated hosts with a bandwidth limit.

    python benchmarks/hierarchical_netns.py [--hosts 2] [--ranks-per-host 2] [--rate 200mbit]
                                            [--sizes 64K,1M,8M] [--iters 5] [--repeats 3]
                                            [--algorithms native,hierarchical,ring,rhd]

Needs root (network namespaces; see tests/support/cluster/netns.py). The hosts are
joined by veth links whose outgoing rate is limited with ``tc tbf``; ranks on
one host talk through shared memory inside MPI... except that MPICH's UCX is
forced onto TCP (``UCX_TLS=tcp,self``), so intra-host traffic goes over
loopback, which is not rate-limited. Each configuration is timed in one job:
per size, rounds rotate the order of the algorithms, a round's time is the
slowest rank's, and the median over rounds and over ``--repeats`` jobs is
reported with each algorithm's ratio to native (above 1: faster than the
MPI library's own all-reduce).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support", "cluster"))


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def worker(sizes, iters, algorithms):
    import numpy as np

    import axonhpc as ax

    world = ax.init()
    results = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        samples = {a: [] for a in algorithms}
        for algorithm in algorithms:  # warm-up, and the node groups and private communicators get built
            ax.all_reduce(x, algorithm=algorithm)
        for k in range(iters):
            for algorithm in algorithms[k % len(algorithms):] + algorithms[:k % len(algorithms)]:
                ax.barrier()
                start = time.perf_counter()
                ax.all_reduce(x, algorithm=algorithm)
                elapsed = np.array([time.perf_counter() - start])
                ax.all_reduce(elapsed, ax.ReduceOp.MAX)
                samples[algorithm].append(float(elapsed[0]))
        results[nbytes] = {a: statistics.median(v) for a, v in samples.items()}
    if world.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate", default="200mbit", help="tc tbf rate of every host's link (default 200mbit)")
    parser.add_argument("--sizes", default="64K,1M,8M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flavour", choices=("mpich", "openmpi"), default="mpich")
    parser.add_argument("--algorithms", default="native,hierarchical",
                        help="comma-separated, native first (default native,hierarchical)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    algorithms = args.algorithms.split(",")
    if algorithms[0] != "native":
        parser.error("--algorithms must start with native (the baseline of the ratios)")
    if args.worker:
        return worker(sizes, args.iters, algorithms)
    import netns

    reason = netns.unavailable_reason()
    if reason:
        print(f"hierarchical_netns: {reason}", file=sys.stderr)
        return 2
    runs = []
    with netns.Hosts(args.hosts) as hosts:
        hosts.shape(args.rate)
        for _ in range(args.repeats):
            result = hosts.run(args.flavour, [args.ranks_per_host] * args.hosts,
                               [os.path.abspath(__file__), "--worker", "--sizes", args.sizes, "--iters",
                                str(args.iters), "--algorithms", args.algorithms], timeout=900)
            lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
            if result.returncode != 0 or not lines:
                print(result.stdout + result.stderr, file=sys.stderr)
                return 1
            runs.append(json.loads(lines[-1][7:]))
    print(f"# all-reduce of float32, {args.hosts} hosts x {args.ranks_per_host} ranks ({args.flavour}), "
          f"inter-host links limited to {args.rate} (tc tbf), medians of {args.iters} rounds x {args.repeats} jobs")
    print(f"{'size':>10} " + " ".join(f"{a + ' ms':>16}" for a in algorithms))
    for nbytes in sizes:
        times = {a: statistics.median(r[str(nbytes)][a] for r in runs) for a in algorithms}
        cells = [f"{times['native'] * 1e3:>16.2f}"] + [
            f"{times[a] * 1e3:>8.2f} ({times['native'] / times[a]:4.2f}x)" for a in algorithms[1:]]
        print(f"{nbytes:>10} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
