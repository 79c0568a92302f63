"""``axonhpc bench gpt``: a GPT training step beside PyTorch's, and tokens/s of 2-rank layouts beside one process.

Run it without mpiexec. Two parts:

- **The step, on one thread or one GPU.** ``nn.GPT`` with ``CrossEntropyLoss`` and ``optim.AdamW``
  beside the same model in PyTorch eager as its users write it, loaded with our weights (both print
  one starting loss: the check they are the same model). BLAS and torch pinned to one thread; the
  steps alternate in rotating rounds; medians, their ratio, then the ten functions of our step with
  the most own time (cProfile). ``--device cuda`` runs both on the GPU, each step reading its loss.
- **Scaling on this machine, with the settings a user gets.** Worker jobs train ``ParallelGPT`` on
  one process and on ``--ranks`` ranks as dp, dp with FSDP, tp and pp, without ``OMP_NUM_THREADS``
  and friends, so ``ax.init`` sizes the thread pools as for the user. The table gives the median
  tokens/s over ``--repeats`` jobs and the ratio to one process. CPU only.

Tests never assert these times; docs/performance.md quotes them with the machine they came from.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import BenchError, InvalidArgumentError
from ..mpiexec import NOT_FOUND, find_mpiexec
from ..settings import THREAD_VARIABLES, THREADS_SET_BY
from .jobs import check_counts, run_worker_job, write_result
from .step import Device
from .timing import median_times, pin_blas_threads

LAYOUTS = {  # name -> (dp, tp, pp, fsdp), for 2 ranks; dp grows with --ranks
    "dp": ("ranks", 1, 1, False),
    "dp+fsdp": ("ranks", 1, 1, True),
    "tp": (1, "ranks", 1, False),
    "pp": (1, 1, "ranks", False),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="axonhpc bench gpt", description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (the global batch of the layouts)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the step comparison runs (the table of layouts is CPU-only)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the step comparison")
    p.add_argument("--steps", type=int, default=5, help="steps per round and candidate")
    p.add_argument("--profile-steps", type=int, default=10, help="steps profiled for the top-10 table (0: none)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even where it is installed")
    p.add_argument("--unfused", action="store_true",
                   help="also time our step with settings.fused_kernels off (the layers' work as array operations): "
                        "what the fused kernels save, in the same rounds")
    p.add_argument("--no-scaling", action="store_true", help="skip the table of layouts")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the layouts in the scaling table")
    p.add_argument("--layouts", default="dp,dp+fsdp,tp,pp", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--scaling-steps", type=int, default=20, help="timed training steps per job")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per job")
    p.add_argument("--repeats", type=int, default=3, help="jobs per layout (the table gives their median)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="single", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_counts(p, args, ("width", "layers", "heads", "context", "batch", "vocab", "rounds", "steps", "ranks",
                           "scaling_steps", "repeats"), ("warmup", "profile_steps"))
    if args.width % args.heads:
        p.error(f"--heads {args.heads} must divide --width {args.width}")
    args.layout_list = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layout_list if name not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if not args.worker and not args.no_scaling and args.device == "cpu":
        problem = layout_problem(args)
        if problem:
            p.error(problem)
    return args


def layout_problem(args: argparse.Namespace) -> Optional[str]:
    """Why a layout of ``--layouts`` cannot train this model on ``--ranks`` ranks (None if all can).

    Checked before any job starts, so a bad combination costs no timed jobs first; the rules are the ones
    ``_worker`` and ``ParallelGPT`` apply (pp: 2 * pp micro-batches, one block per stage at least).
    """
    for name in args.layout_list:
        dp, tp, pp, _ = _layout_sizes(name, args.ranks)
        where = f"layout {name} on --ranks {args.ranks}"
        if args.layers < pp:
            return (f"--layers {args.layers} cannot be split into {pp} pipeline stages ({where}): give --layers "
                    f"{pp} or more, or leave {name} out of --layouts")
        if args.batch % (dp * 2 * pp if pp > 1 else dp):
            split = f"{2 * pp} micro-batches" if pp > 1 else f"dp={dp}"
            return f"--batch {args.batch} does not split into {split} ({where})"
        if args.heads % tp:
            return f"--heads {args.heads} does not split over tp={tp} ({where})"
    return None


def _tokens(args: argparse.Namespace, step: int) -> Tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: inputs and next-token targets, the same on every rank and layout."""
    rng = np.random.default_rng(1000 + step)
    seq = rng.integers(0, args.vocab, (args.batch, args.context + 1))
    return seq[:, :-1], seq[:, 1:]


# ------------------------------------------------------------------ the step beside PyTorch's

def our_step(args: argparse.Namespace, xp: Any = np, fused: bool = True) -> Tuple[Callable[[], float], Any]:
    """Our one-process training step (returns its loss) and the model, on ``xp``'s arrays (numpy or cupy);
    ``fused``: the step runs with ``settings.fused_kernels`` so (the setting is restored after each step)."""
    from .. import nn, optim
    from ..settings import settings

    model = nn.GPT(args.vocab, args.context, args.width, args.heads, args.layers, dtype=np.dtype(args.dtype), seed=0)
    if xp is not np:
        model.to("cuda")
    loss_fn = nn.CrossEntropyLoss()
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (xp.asarray(a) for a in _tokens(args, 0))

    def step() -> float:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        return loss

    if fused:
        return step, model

    def unfused_step() -> float:
        saved = settings.fused_kernels
        settings.fused_kernels = False
        try:
            return step()
        finally:
            settings.fused_kernels = saved

    return unfused_step, model


def torch_step(args: argparse.Namespace, ours: Any, dev: str = "cpu") -> Optional[Callable[[], float]]:
    """The same model, loss and optimizer in PyTorch eager, from ``ours``'s initial weights (None without torch)."""
    try:
        import torch
    except ImportError:
        return None
    import torch.nn.functional as F

    from .._dtypes import to_host

    if dev == "cpu":
        torch.set_num_threads(1)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    width, heads = args.width, args.heads

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(width, width) for _ in range(4))

        def forward(self, h: Any) -> Any:
            b, t, _ = h.shape
            q, k, v = (proj(h).view(b, t, heads, width // heads).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(ctx.transpose(1, 2).reshape(b, t, width))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.attn = Attention()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width), torch.nn.Dropout(0.0))

        def forward(self, h: Any) -> Any:
            h = h + self.attn(self.ln1(h))
            return h + self.mlp(self.ln2(h))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = torch.nn.Embedding(args.vocab, width)
            self.pos_emb = torch.nn.Embedding(args.context, width)
            self.blocks = torch.nn.Sequential(*(Block() for _ in range(args.layers)))
            self.ln_f = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, args.vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            h = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
            return self.head(self.ln_f(self.blocks(h)))

    model = GPT().to(dtype)
    model.load_state_dict({name: torch.from_numpy(np.array(to_host(value))) for name, value in ours.state_dict().items()})
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (torch.from_numpy(a).to(dev) for a in _tokens(args, 0))

    def step() -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def profile_lines(step: Callable[[], Any], steps: int, top: int = 10) -> List[str]:
    """The ``top`` functions of ``steps`` calls of ``step`` by their own time (cProfile), per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(entry[2] for entry in stats.stats.values()) or 1.0
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    lines = []
    for (path, line, name), (_, calls, own, _, _) in rows:
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        lines.append(f"  {own / steps * 1e3:8.2f} ms  {100 * own / total:5.1f}%  {calls // steps:5d} calls  {where}")
    return lines


def compare_steps(args: argparse.Namespace) -> Dict[str, Any]:
    """Time our step and PyTorch's in interleaved rounds; print the table and our profile."""
    _limiter = pin_blas_threads(1)  # noqa: F841 - kept for the comparison
    device = Device(args.device)
    print(f"device: {device.describe()}", flush=True)
    ours, model = our_step(args, device.xp)
    theirs = None if args.no_torch else torch_step(args, model, args.device)
    first = ours()
    line = f"same model: first-step loss ours {first:.6f}"
    if theirs is not None:
        first_torch = theirs()
        line += f", torch {first_torch:.6f} (|difference| {abs(first - first_torch):.1e})"
        if not abs(first - first_torch) <= 1e-3 * abs(first_torch):
            raise BenchError(f"the two models differ: first-step loss {first} against torch's {first_torch}")
    print(line, flush=True)
    candidates = {"axonhpc": ours}
    if args.unfused:  # a model of its own: the same weights, its own optimizer state
        unfused, _ = our_step(args, device.xp, fused=False)
        first_unfused = unfused()
        if not abs(first - first_unfused) <= 1e-5 * abs(first):
            raise BenchError(f"the step with fused kernels off starts at loss {first_unfused}, ours at {first}")
        candidates["unfused"] = unfused
    if theirs is not None:
        candidates["torch"] = theirs
    for fn in candidates.values():
        fn()  # one more warm step each
    times = median_times(candidates, args.steps, args.rounds)
    tokens = args.batch * args.context
    where = "one thread" if args.device == "cpu" else "one GPU, each step reading its loss"
    print(f"median of {args.rounds} interleaved rounds of {args.steps} steps, {where}:", flush=True)
    for name, seconds in times.items():
        print(f"  {name:9s} {seconds * 1e3:9.2f} ms/step  {tokens / seconds:10.0f} tokens/s", flush=True)
    if "unfused" in times:
        print(f"  fused     {times['axonhpc'] / times['unfused']:9.2f} (axonhpc / unfused: the step with the fused "
              "kernels over the step without them)", flush=True)
    if "torch" in times:
        print(f"  ratio     {times['axonhpc'] / times['torch']:9.2f} (axonhpc / torch; below 1 is faster)", flush=True)
    else:
        print("  torch           n/a (not installed, or --no-torch)", flush=True)
    if args.profile_steps:
        print(f"top 10 functions of our step by their own time (cProfile over {args.profile_steps} steps; "
              "profiling slows small calls):", flush=True)
        print("\n".join(profile_lines(ours, args.profile_steps)), flush=True)
    return {name: seconds for name, seconds in times.items()}


# ------------------------------------------------------------------ the layouts

def _layout_sizes(name: str, ranks: int) -> Tuple[int, int, int, bool]:
    if name == "single":
        return 1, 1, 1, False
    dims = LAYOUTS[name]
    dp, tp, pp = (ranks if d == "ranks" else d for d in dims[:3])
    return dp, tp, pp, dims[3]


def _worker(args: argparse.Namespace) -> None:
    from .. import optim
    from ..collectives import all_reduce, barrier
    from ..backends import ReduceOp
    from ..groups import init
    from ..parallel import ParallelGPT
    from ..threads import current_plan

    world = init()
    dp, tp, pp, fsdp = _layout_sizes(args.layout, world.world_size)
    if dp * tp * pp != world.world_size:
        raise BenchError(f"layout {args.layout} needs {dp * tp * pp} ranks, the job has {world.world_size}")
    if args.batch % dp:
        raise BenchError(f"--batch {args.batch} must divide over dp={dp}")
    mesh = world.mesh(dp=dp, tp=tp, pp=pp)
    model = ParallelGPT(mesh, args.vocab, args.context, args.width, args.heads, args.layers,
                        dtype=np.dtype(args.dtype), seed=0, fsdp=fsdp, num_microbatches=2 * pp if pp > 1 else 1)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    share = args.batch // dp
    rows = slice(mesh.coords.dp * share, (mesh.coords.dp + 1) * share)

    def step(k: int) -> None:
        x, y = _tokens(args, k)
        model.zero_grad()
        model.train_step(x[rows], y[rows])
        opt.step()

    for k in range(args.warmup):
        step(k)
    barrier()
    start = time.perf_counter()
    for k in range(args.scaling_steps):
        step(args.warmup + k)
    elapsed = np.array([time.perf_counter() - start])
    all_reduce(elapsed, ReduceOp.MAX)
    if world.rank == 0:
        plan = current_plan()
        write_result({"tokens_per_s": args.scaling_steps * args.batch * args.context / float(elapsed[0]),
                      "threads": plan.threads if plan is not None else None,
                      "sized": bool(plan is not None and plan.chosen)}, args.out)


def default_environment() -> Dict[str, str]:
    """This environment without the thread variables: what a user who sets none of them runs with."""
    return {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES + (THREADS_SET_BY,)}


def scaling_table(args: argparse.Namespace) -> Dict[str, float]:
    """Tokens/s of one process and of each layout on ``--ranks`` ranks, medians of ``--repeats`` jobs."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise BenchError(NOT_FOUND)
    worker_args = ["--worker", "--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads),
                   "--context", str(args.context), "--batch", str(args.batch), "--vocab", str(args.vocab),
                   "--dtype", args.dtype, "--scaling-steps", str(args.scaling_steps), "--warmup", str(args.warmup)]
    # "single1": one process with one BLAS thread, beside the default one process: how much of the
    # one process's speed is its second thread (its GEMMs run on every core; our kernels on one).
    configs = [("single", 1), ("single1", 1)] + [(name, args.ranks) for name in args.layout_list]
    samples: Dict[str, List[float]] = {name: [] for name, _ in configs}
    threads: Dict[str, str] = {}
    for _ in range(args.repeats):  # round-robin, so a slow spell of the machine hits every layout alike
        for name, n in configs:
            env = default_environment()
            if name == "single1":
                env.update({var: "1" for var in THREAD_VARIABLES})
            result = run_worker_job(mpiexec, n, "axonhpc.bench.gpt", worker_args + ["--layout", name.rstrip("1")],
                                    f"layout {name}", args.timeout, env=env)
            samples[name].append(result["tokens_per_s"])
            threads[name] = f"{result['threads']} ({'axonhpc' if result['sized'] else 'the environment'})"
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"tokens/s on this machine ({os.cpu_count()} cores), {args.ranks} ranks against one process, no thread "
          f"variables set (ax.init sizes the pools); median of {args.repeats} jobs of {args.scaling_steps} steps:",
          flush=True)
    labels = {"single": "1 process", "single1": "1 process, OMP_NUM_THREADS=1", "dp+fsdp": f"dp={args.ranks} fsdp"}
    width = max(len(labels.get(name, f"{name}={args.ranks}")) for name, _ in configs)
    print(f"  {'layout':{width}s} {'ranks':>5s} {'tokens/s':>10s} {'vs 1 process':>13s}  threads/rank (set by)",
          flush=True)
    base = medians["single"]
    for name, n in configs:
        label = labels.get(name, f"{name}={args.ranks}")
        print(f"  {label:{width}s} {n:5d} {medians[name]:10.0f} {medians[name] / base:12.2f}x  {threads[name]}",
              flush=True)
    return medians


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    print(f"axonhpc bench gpt: width {args.width}, {args.layers} layers, {args.heads} heads, context {args.context}, "
          f"batch {args.batch}, vocab {args.vocab}, {args.dtype}, AdamW", flush=True)
    try:
        compare_steps(args)
        if args.device != "cpu" and not args.no_scaling:
            print("table of layouts: skipped with --device cuda (its jobs run on the CPU; on one GPU the ranks "
                  "would share it)", flush=True)
        elif not args.no_scaling:
            scaling_table(args)
    except (BenchError, InvalidArgumentError) as exc:
        print(f"axonhpc bench gpt: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
