"""``axonhpc bench ddp``: DDP weak scaling on 1 and 2 ranks, beside PyTorch DDP (gloo).

Run it *without* mpiexec: the driver launches ``mpiexec -n 1`` and ``-n 2`` workers with BLAS and
OpenMP pinned to one thread per rank and the same per-rank batch, so the efficiency is T1 / T2.

[Note: what one worker job measures]
One job times, in rotating rounds, the plain model ("compute": the ceiling set by the ranks sharing
the machine), DDP ``OVERLAPPED`` and DDP ``SYNCHRONOUS``. Each step starts after an untimed barrier;
its time is the maximum over ranks, and the job reports the median. OVERLAPPED also reports
``ddp.last_step`` (the final wait and the buckets done before it: the evidence of overlap) and one
raw ``MPI_Allreduce`` of all gradients, the floor for any synchronisation. The PyTorch job does the
same with gloo. The machine is noisy, so the 1- and 2-rank jobs alternate ``--repeats`` times and
the median of job medians is reported.

[Note: one process as users run it]
Pinning one thread per rank makes T1 / T2 a fair weak-scaling ratio, but nobody runs one process that
way: ``axonhpc launch -n 1`` (and ``ax.init()``) give it the machine's cores. So each repeat also runs
the plain model on one rank with the thread variables left unset, as a user starts it, and the table is
followed by DDP's 2-rank step against that: what going from one process to two ranks gains here.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..mpiexec import NOT_FOUND, find_mpiexec
from ..settings import THREAD_VARIABLES, THREADS_SET_BY
from .jobs import BenchError, check_counts, parse_counts, run_worker_job, write_result
from .timing import human_bytes, pin_blas_threads

DEFAULT_SIZES = "512,1024,1024,10"
ROUND_STEPS = 10  # steps of one configuration before the next one's turn
RANKS = (1, 2)

AXON_CONFIGS = ("compute", "overlapped", "synchronous")
TORCH_CONFIGS = ("torch_compute", "torch_ddp")
LABELS = {
    "compute": "axonhpc compute (no DDP)",
    "overlapped": "axonhpc DDP OVERLAPPED",
    "synchronous": "axonhpc DDP SYNCHRONOUS",
    "torch_compute": "torch compute (no DDP)",
    "torch_ddp": "torch DDP (gloo)",
}


def parse_sizes(text: str) -> List[int]:
    """Layer widths "512,1024,1024,10" -> [512, 1024, 1024, 10] (at least two, all positive)."""
    return parse_counts(text, "--sizes", "layer widths (input, ..., classes)", min_items=2)


def parameter_count(sizes: Sequence[int]) -> int:
    """Weights and biases of the MLP with these widths."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def make_mlp(sizes: Sequence[int], relu_in_linear: bool = False):
    """The benchmarks' float32 MLP with these widths (Linear, then ReLU between layers; fixed seeds).

    ``relu_in_linear``: each ReLU is the ``activation`` of the Linear before it; the same numbers.
    """
    from ..nn import Linear, ReLU, Sequential

    layers = []
    last = len(sizes) - 2
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i and not relu_in_linear:
            layers.append(ReLU())
        activation = "relu" if relu_in_linear and i < last else None
        layers.append(Linear(a, b, dtype=np.float32, seed=i, activation=activation))
    return Sequential(*layers)


def _step_schedule(configs: Sequence[str], steps: int) -> List[tuple]:
    """(config, n_steps) chunks in rotating order, ``steps`` per config in all."""
    chunks, done, k = [], 0, 0
    while done < steps:
        n = min(ROUND_STEPS, steps - done)
        names = list(configs[k % len(configs):]) + list(configs[:k % len(configs)])
        chunks += [(name, n) for name in names]
        done += n
        k += 1
    return chunks


# -- workers (run under mpiexec) ---------------------------------------------------------------
def _axon_worker(args) -> Optional[dict]:
    from mpi4py import MPI

    from ..bucketing import GradSyncStrategy
    from ..groups import init
    from ..nn import CrossEntropyLoss
    from ..optim import SGD
    from ..parallel import DDP

    limiter = pin_blas_threads(1) if args.threads == "one" else None  # noqa: F841 - keeps the limit in force
    init()  # the default group DDP replicates over (and, with the variables unset, its own thread plan)
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    sizes = parse_sizes(args.sizes)

    rng = np.random.default_rng(1234 + rank)
    x = rng.standard_normal((args.batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], args.batch)
    models = {"compute": make_mlp(sizes),
              "overlapped": DDP(make_mlp(sizes), strategy=GradSyncStrategy.OVERLAPPED),
              "synchronous": DDP(make_mlp(sizes), strategy=GradSyncStrategy.SYNCHRONOUS)}
    opts = {name: SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    loss_fn = CrossEntropyLoss()
    stats: Dict[str, List[dict]] = {"overlapped": [], "synchronous": []}

    def step(name: str, record: bool) -> None:
        model, opt = models[name], opts[name]
        opt.zero_grad()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward(), input_grad=False)  # as torch: the data needs no gradient
        opt.step()
        if record and name in stats:
            stats[name].append(dict(model.last_step))

    times: Dict[str, List[float]] = {name: [] for name in AXON_CONFIGS}
    for name in AXON_CONFIGS:
        for _ in range(args.warmup):
            step(name, False)
    for name, count in _step_schedule(AXON_CONFIGS, args.steps):
        for _ in range(count):
            comm.Barrier()
            start = time.perf_counter()
            step(name, True)
            times[name].append(time.perf_counter() - start)

    # The floor: one raw MPI_Allreduce of every gradient, as one buffer.
    grads = np.ones(parameter_count(sizes), dtype=np.float32)
    raw = []
    for k in range(args.warmup + 10):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, [grads, MPI.FLOAT])
        if k >= args.warmup:
            raw.append(time.perf_counter() - start)

    def slowest(samples: List[float]) -> np.ndarray:
        job = np.array(samples, dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, [job, MPI.DOUBLE], op=MPI.MAX)  # a step lasts until its slowest rank ends
        return job

    from ..threads import current_plan

    plan = current_plan()
    result = {"world_size": n, "configs": {}, "threads": 1 if args.threads == "one" or plan is None else plan.threads}
    for name in AXON_CONFIGS:
        result["configs"][name] = {"ms": float(np.median(slowest(times[name]))) * 1e3}
    for name, records in stats.items():
        means = {key: float(np.median([r[key] for r in records])) for key in records[0]}
        result["configs"][name].update({
            "backward_ms": means["backward_s"] * 1e3, "final_wait_ms": means["final_wait_s"] * 1e3,
            "completed_before_wait": means["completed_before_wait"], "buckets": int(means["buckets"]),
        })
    result["raw_allreduce_ms"] = float(np.median(slowest(raw))) * 1e3
    comm.Free()
    return result if rank == 0 else None


def _torch_worker(args) -> Optional[dict]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    rank, n = int(os.environ.get("PMI_RANK", "0")), int(os.environ.get("PMI_SIZE", "1"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=n)
    sizes = parse_sizes(args.sizes)

    def mlp():
        torch.manual_seed(0)
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(a, b))
        return torch.nn.Sequential(*layers)

    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.batch, sizes[0], generator=gen)
    y = torch.randint(0, sizes[-1], (args.batch,), generator=gen)
    models = {"torch_compute": mlp(), "torch_ddp": TorchDDP(mlp())}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(name: str) -> None:
        model, opt = models[name], opts[name]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    times: Dict[str, List[float]] = {name: [] for name in TORCH_CONFIGS}
    for name in TORCH_CONFIGS:
        for _ in range(args.warmup):
            step(name)
    for name, count in _step_schedule(TORCH_CONFIGS, args.steps):
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    result = {"world_size": n, "configs": {}}
    for name in TORCH_CONFIGS:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        result["configs"][name] = {"ms": statistics.median(t.tolist()) * 1e3}
    dist.destroy_process_group()
    return result if rank == 0 else None


def _run_worker(args) -> int:
    result = _axon_worker(args) if args.worker == "axon" else _torch_worker(args)
    if result is not None:
        write_result(result, args.out)
    return 0


# -- driver ----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for gloo's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_available(timeout: float = 120.0) -> bool:
    """Whether ``import torch`` works in this interpreter (tried in a child, so the driver stays light)."""
    try:
        out = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def run_job(mpiexec: str, kind: str, n: int, args, timeout: float, default_threads: bool = False) -> dict:
    """Run one worker job on ``n`` ranks and return rank 0's result; ``default_threads``: with the thread
    variables unset, as a user starts it ([Note: one process as users run it]).

    Raises:
        BenchError: the job failed, timed out or wrote no result.
    """
    worker_args = ["--worker", kind, "--sizes", args.sizes, "--batch", str(args.batch), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", "default" if default_threads else "one"]
    if kind == "torch":
        worker_args += ["--port", str(free_port())]
    env = None
    if default_threads:
        env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES + (THREADS_SET_BY,)}
    return run_worker_job(mpiexec, n, "axonhpc.bench.ddp", worker_args, f"{kind} job", timeout, env=env)


def as_users_run_it(jobs: Dict[int, List[dict]], defaults: List[dict]) -> Optional[str]:
    """DDP OVERLAPPED on 2 ranks against the plain model in one process with its default threads (medians of
    per-repeat ratios), or None without those jobs."""
    pairs = [(d, two) for d, two in zip(defaults, jobs[2]) if "overlapped" in two["configs"]]
    if not pairs:
        return None
    one = statistics.median(d["configs"]["compute"]["ms"] for d, _ in pairs)
    ratio = statistics.median(d["configs"]["compute"]["ms"] / two["configs"]["overlapped"]["ms"] for d, two in pairs)
    threads = defaults[0]["threads"]
    return (f"# one process as `axonhpc launch -n 1` runs it ({threads} BLAS thread{'s' if threads != 1 else ''}): "
            f"plain model {one:.2f} ms/step; DDP OVERLAPPED on 2 ranks (1 thread each, twice the samples) "
            f"{ratio * 100:.1f}% of its step rate per rank, {2 * ratio:.2f}x its samples/s")


def summarize(jobs: Dict[int, List[dict]]) -> List[dict]:
    """Table rows: per config, the median over repeats of each rank count's job median.

    Efficiencies are medians of per-repeat ratios: one repeat's jobs run back to back, so a slow spell of
    the machine hits both sides of a ratio.
    """
    rows = []
    configs = [c for c in LABELS if all(c in j["configs"] for n in RANKS for j in jobs[n])]
    pairs = list(zip(jobs[1], jobs[2]))
    for name in configs:
        row = {"config": name, "label": LABELS[name]}
        for n in RANKS:
            row[f"ms_{n}"] = statistics.median(j["configs"][name]["ms"] for j in jobs[n])
        row["efficiency"] = statistics.median(a["configs"][name]["ms"] / b["configs"][name]["ms"] for a, b in pairs)
        # Against the same library's plain model on one rank: ideal data parallelism costs nothing.
        base = "torch_compute" if name.startswith("torch") else "compute"
        row["vs_compute"] = (statistics.median(a["configs"][base]["ms"] / b["configs"][name]["ms"] for a, b in pairs)
                             if base in configs else float("nan"))
        rows.append(row)
    return rows


def overlap_lines(jobs: Dict[int, List[dict]]) -> List[str]:
    """What ``ddp.last_step`` says about OVERLAPPED and SYNCHRONOUS, per rank count (medians over steps)."""
    lines = []
    for n in RANKS:
        axon = [j for j in jobs.get(n, []) if "overlapped" in j["configs"]]
        if not axon:
            continue

        def med(config, key):
            return statistics.median(j["configs"][config][key] for j in axon)

        lines.append(
            f"{n} rank{'s' if n > 1 else ' '}: OVERLAPPED backward {med('overlapped', 'backward_ms'):.2f} ms, "
            f"final wait {med('overlapped', 'final_wait_ms'):.2f} ms, "
            # both medians over jobs: "auto" sizes the buckets in each job, so their count may differ
            f"{med('overlapped', 'completed_before_wait'):.2f}/{med('overlapped', 'buckets'):g} buckets "
            f"done before it; SYNCHRONOUS all-reduce pass {med('synchronous', 'final_wait_ms'):.2f} ms; "
            f"raw MPI_Allreduce of all gradients {statistics.median(j['raw_allreduce_ms'] for j in axon):.2f} ms")
    return lines


def format_table(rows: List[dict], sizes: Sequence[int], args) -> str:
    """The table the driver prints (one row per configuration)."""
    params = parameter_count(sizes)
    lines = [f"# DDP weak scaling: MLP {'-'.join(map(str, sizes))} ({params:,} parameters, "
             f"{human_bytes(params * 4)} of float32 gradients), batch {args.batch} per rank, 1 BLAS thread per rank",
             f"# ms/step: median over {args.steps} steps after {args.warmup} warm-up (a step ends when its slowest "
             f"rank does), median of {args.repeats} repeat(s)",
             "# efficiency = T(1 rank) / T(2 ranks); vs compute = T(1 rank, same library, no DDP) / T(2 ranks);",
             "# both are medians over repeats of the ratio within a repeat (its 1- and 2-rank jobs run back to back)",
             f"{'config':<26} {'1 rank ms':>10} {'2 ranks ms':>11} {'efficiency':>11} {'vs compute':>11}"]
    for r in rows:
        lines.append(f"{r['label']:<26} {r['ms_1']:>10.2f} {r['ms_2']:>11.2f} {r['efficiency'] * 100:>10.1f}% "
                     f"{r['vs_compute'] * 100:>10.1f}%")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonhpc bench ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"MLP layer widths (default {DEFAULT_SIZES})")
    parser.add_argument("--batch", type=int, default=128, help="samples per rank (the same on 1 and 2 ranks)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per configuration per job")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per configuration first")
    parser.add_argument("--repeats", type=int, default=5,
                        help="run the 1-rank and 2-rank jobs this many times, alternately; medians are reported")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch DDP (gloo) comparison")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one worker job may take")
    parser.add_argument("--json", default=None, help="also write every job's result to this JSON file")
    parser.add_argument("--worker", choices=("axon", "torch"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", choices=("one", "default"), default="one", help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    check_counts(parser, args, ("batch", "steps", "repeats"))
    if args.worker:
        if not args.out:
            parser.error("--worker needs --out")
        return _run_worker(args)
    if os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        print("axonhpc bench ddp: run it without mpiexec; it launches its own 1- and 2-rank jobs",
              file=sys.stderr)
        return 2
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print(f"axonhpc bench ddp: {NOT_FOUND}", file=sys.stderr)
        return 2
    kinds = ["axon"]
    if not args.no_torch:
        if torch_available():
            kinds.append("torch")
        else:
            print("# torch is not importable here: PyTorch DDP comparison skipped", file=sys.stderr)
    jobs: Dict[int, List[dict]] = {n: [] for n in RANKS}
    defaults: List[dict] = []  # one process with its default threads, per repeat
    try:
        for rep in range(args.repeats):
            order = RANKS if rep % 2 == 0 else tuple(reversed(RANKS))  # alternate, so drift hits both alike
            for n in order:
                merged = {"world_size": n, "configs": {}}
                for kind in kinds:
                    result = run_job(mpiexec, kind, n, args, args.timeout)
                    merged["configs"].update(result.pop("configs"))
                    merged.update(result)
                jobs[n].append(merged)
            defaults.append(run_job(mpiexec, "axon", 1, args, args.timeout, default_threads=True))
    except BenchError as exc:
        print(f"axonhpc bench ddp: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): results for n, results in jobs.items()}, f, indent=1)
    print(format_table(summarize(jobs), sizes, args))
    lines = overlap_lines(jobs)
    if lines:
        print("# overlap, from ddp.last_step (medians over steps and repeats), beside one raw MPI_Allreduce:")
    for line in lines:
        print("# " + line)
    line = as_users_run_it(jobs, defaults)
    if line:
        print(line)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
