"""Train a GPT-style transformer on the standard library's own source with data, tensor and pipeline parallelism.

    python examples/train_gpt.py --steps 50                                # one process
    axonhpc launch -n 4 -- examples/train_gpt.py --dp 2 --tp 2 --steps 200  # 2 replicas x 2-way tensor parallel
    axonhpc launch -n 4 -- examples/train_gpt.py --tp 2 --pp 2 --microbatches 4
    axonhpc launch -n 2 -- examples/train_gpt.py --dp 2 --fsdp --checkpoint-activations
    axonhpc launch -n 2 -- examples/train_gpt.py --dp 2 --data my_corpus.txt      # your own text
    axonhpc launch -n 2 -- examples/train_gpt.py --dp 2 --data data/openwebtext   # nanoGPT's train.bin/val.bin
    axonhpc launch --fault-tolerant -n 4 -- examples/train_gpt.py --elastic --fsdp --batch 12 \
        --simulate-failure 2:3      # Open MPI with ULFM: rank 2 dies, the others go on (--spares 1: one replaces it)

The text is byte-level (vocabulary 256) from the ``.py`` files of the
standard library (``axonhpc.data.TextCorpus``), some files held out, or your
own corpus with ``--data`` (``axonhpc.data.FileCorpus``: a text file or
folder, or uint16 token files, memory-mapped). The
model is ``nn.GPT``; ``ax.ParallelGPT`` places its parts on a dp x tp x pp
mesh of the ranks (``--dp D --tp T --pp P``, D * T * P ranks): blocks split
into P pipeline stages run with ``--schedule`` over ``--microbatches``,
attention heads and MLP features split over T ranks, D replicas averaging
gradients with DDP (or sharding everything with ``--fsdp``, P = 1). Every
layout computes the same losses as one process from the same ``--seed``.

Rank 0 shows the loss as it goes and ends with exactly one ``final loss``
line (the last step's training loss, printed with repr), one ``held-out
loss`` line and the tokens per second. ``--save DIR`` writes a checkpoint
(every ``--save-every`` steps in the background, and at the end) that loads
under any other layout, FSDP's included (``--resume DIR``); ``--plot PREFIX``
writes ``PREFIX-loss.png`` (train and held-out loss) and, with P > 1,
``PREFIX-pipeline.png`` (the Gantt chart of the last step). ``--elastic``
(``axonhpc.elastic``, docs/fault-tolerance.md) survives ranks that die: the
survivors shrink dp, or a ``--spares`` rank takes the place, and redo the
step with the same global batch.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

import axonhpc as ax
from axonhpc import optim
from axonhpc.checkpoint import AsyncCheckpointer, load_model_slices, save_model_slices
from axonhpc.data import FileCorpus, TextCorpus, TextWindows
from axonhpc.elastic import ElasticTraining, is_replacement


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: the ranks left over)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per block")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state over dp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (windows per step over all replicas)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: 2 * pp)")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved_1f1b (2 stages per rank)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward instead of keeping them")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="bytes of standard library source to read")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on your own corpus: a text file or folder (bytes), or token files in nanoGPT's "
                        "layout (a flat uint16 .bin, or a folder with train.bin and val.bin), memory-mapped")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size of --data's token files (default: the largest token + 1)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the held-out loss")
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: only at the end)")
    p.add_argument("--save", default=None, metavar="DIR", help="write a checkpoint here at the end (any layout loads it)")
    p.add_argument("--save-every", type=int, default=0, help="also write --save every N steps")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue from this checkpoint (any layout's)")
    p.add_argument("--elastic", action="store_true",
                   help="go on when ranks die: shrink dp and redo the step (Open MPI with ULFM, under axonhpc "
                        "launch --fault-tolerant; with tp or pp a replica that lost a rank is dropped; --batch "
                        "divisible by every dp width it may reach)")
    p.add_argument("--simulate-failure", default=None, metavar="R:K[:WHERE]",
                   help="with --elastic: rank R SIGKILLs itself once K steps are done (WHERE: forward, backward, "
                        "optimizer, save, or spare: a spare as it starts to wait; in a recovery: shrink, agree, "
                        "split, restore); comma-separated for several")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="with --elastic: N of the ranks wait, and one takes the place of each rank lost, so dp stays")
    p.add_argument("--respawn", action="store_true",
                   help="with --elastic: once no spare is left, start a replacement for each rank lost, so dp stays")
    p.add_argument("--plot", default=None, metavar="PREFIX", help="write PREFIX-loss.png (and PREFIX-pipeline.png)")
    return p.parse_args(argv)


def layout(args, world_size):
    """(dp, tp, pp) from the flags; dp defaults to the ranks that tp and pp leave."""
    tp, pp = args.tp, args.pp
    dp = args.dp if args.dp is not None else max(1, world_size // (tp * pp))
    if dp * tp * pp != world_size:
        sys.exit(f"train_gpt: --dp {dp} --tp {tp} --pp {pp} needs {dp * tp * pp} ranks, this run has {world_size}")
    return dp, tp, pp


class Progress:
    """Rank 0's progress bar: redrawn in place on a terminal, a line every tenth of the run elsewhere."""

    def __init__(self, total, enabled):
        self.total, self.enabled = total, enabled
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step, loss):
        if not self.enabled:
            return
        done = step + 1
        if not self.tty and done % max(1, self.total // 10) and done != self.total:
            return
        width = 30
        filled = width * done // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] step {done}/{self.total}  loss {loss:.4f}  {time.perf_counter() - self.start:.1f}s"
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)
        if self.tty and done == self.total:
            print(flush=True)


def held_out_loss(model, windows, batches):
    """Mean loss over the first ``batches`` held-out global batches, in eval mode."""
    model.eval()
    total = sum(model.loss(*to_device(*windows.batch(k))) for k in range(batches))
    model.train()
    return total / batches


_xp = np


def to_device(x, y):
    return _xp.asarray(x), _xp.asarray(y)


def peak_activations(run):
    """The last step's peak activation bytes, the largest over the ranks."""
    peak = np.array([run.model.peak_activation_bytes], dtype=np.int64)
    ax.all_reduce(peak, ax.ReduceOp.MAX)
    return peak


def write_loss_plot(path, train, held):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=(7, 4))
    axes.plot([s for s, _ in train], [v for _, v in train], label="train (per step)", lw=1)
    axes.plot([s for s, _ in held], [v for _, v in held], "o-", label="held-out")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per byte)")
    axes.legend()
    axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Run:
    """One world's part of the run: the mesh, the data, the model, the optimizer and the checkpoint writer.

    ``--elastic`` builds a new one on the survivors after a rank is lost (``ax.elastic.ElasticTraining``).
    """

    def __init__(self, args, world, corpus, resume=None):
        self.world = world
        if args.elastic:  # dp is what the ranks left give: it shrinks when a replica is dropped
            args = argparse.Namespace(**{**vars(args), "dp": world.world_size // (args.tp * args.pp)})
        self.dp, tp, pp = layout(args, world.world_size)
        self.mesh = world.mesh(dp=self.dp, tp=tp, pp=pp)
        stages_per_rank = 2 if ax.PipelineSchedule.parse(args.schedule) is ax.PipelineSchedule.INTERLEAVED_1F1B else 1
        self.microbatches = args.microbatches or (2 * pp if pp > 1 else 1)
        self.stages = pp * stages_per_rank
        self.train = TextWindows(corpus.train, args.context, args.batch, self.dp, self.mesh.coords.dp, seed=args.seed)
        self.held = TextWindows(corpus.val, args.context, args.batch, self.dp, self.mesh.coords.dp, shuffle=False)
        self.model = ax.ParallelGPT(self.mesh, corpus.vocab_size, args.context, args.width, args.heads, args.layers,
                                    dropout=args.dropout, dtype=np.dtype(args.dtype), seed=args.seed,
                                    fsdp=args.fsdp, num_microbatches=self.microbatches, schedule=args.schedule,
                                    stages_per_rank=stages_per_rank,
                                    checkpoint_activations=args.checkpoint_activations,
                                    device=None if args.device == "cpu" else "cuda")
        self.optimizer = optim.AdamW(self.model.parameters(), lr=args.lr)
        self.writer = AsyncCheckpointer() if args.save else None  # --save-every writes in the background
        self.first_step = 0
        if resume:
            self.first_step = int(load_model_slices(resume, self.model.parameter_boxes(), self.optimizer)["step"])
            self.model.step = self.first_step  # dropout masks are keyed by the step

    def train_step(self, step):
        self.model.zero_grad()
        return self.model.train_step(*to_device(*self.train.batch(step)))

    def save(self, path, step):
        save_model_slices(path, self.model.parameter_boxes(), self.optimizer, extra={"step": step}, writer=self.writer)

    def abandon(self):
        """After a lost rank: drop a background save in flight (the previous checkpoint stays in place)."""
        if self.writer is not None:
            self.writer.abandon()


class Steps:
    """The steps of a plain run, or (``--elastic``) of one that goes on when ranks die."""

    def __init__(self, args, corpus):
        self.args, self.corpus = args, corpus
        self.elastic = self.plain = None
        if args.elastic:
            world = ax.current_world()  # only the job's first working ranks load --resume, not a spare or replacement
            self._resume = args.resume if world.rank < world.world_size - args.spares and not is_replacement() else None
            self.elastic = ElasticTraining(self._build, simulate_failure=args.simulate_failure, save=args.save,
                                           spares=args.spares, respawn=args.respawn)
            if self.elastic.active and not self.elastic.recoveries:  # a spare that took a place has the state
                self.elastic.done = self.elastic.parts.model.step = self.elastic.parts.first_step
        else:
            self.plain = Run(args, ax.init(), corpus, resume=args.resume)
            self.plain_done = self.plain.first_step

    def _build(self, world):
        resume, self._resume = self._resume, None  # only the first world loads --resume
        return Run(self.args, world, self.corpus, resume=resume)

    @property
    def run(self):
        return self.elastic.parts if self.elastic is not None else self.plain

    @property
    def done(self):
        return self.elastic.done if self.elastic is not None else self.plain_done

    def step(self):
        """One step; its loss, or None when ranks were lost and the step is to be redone."""
        if self.elastic is None:
            loss = self.plain.train_step(self.plain_done)
            self.plain.optimizer.step()
            self.plain_done += 1
            return loss
        return self.elastic.step(lambda run: run.train_step(self.elastic.done))

    def call(self, fn, where=None):
        """``fn(run)`` between steps; with ``--elastic``, redone on the survivors if ranks are lost in it."""
        if self.elastic is None:
            return fn(self.plain)
        while True:
            if where is not None:
                self.elastic.fail_point(where)
            before = len(self.elastic.recoveries)
            out = self.elastic.call(fn)
            if len(self.elastic.recoveries) == before:
                return out
            if where == "save":
                return None  # the interrupted save is not redone: the next one is written

    @property
    def active(self):
        """False on a spare once the run has ended without it."""
        return self.elastic is None or self.elastic.active

    def close(self):
        """After the last step: the spares go (``--spares``)."""
        if self.elastic is not None:
            self.elastic.close()

    def recovered(self, seen):
        """The recovery lines since ``seen`` recoveries (rank 0 prints them)."""
        return [r.line() for r in self.elastic.recoveries[seen:]] if self.elastic is not None else []


def main(argv=None):
    global _xp
    args = parse_args(argv)
    if args.device == "cuda":
        if args.elastic:
            sys.exit("train_gpt: --elastic keeps its copies in host memory; it has not run with --device cuda")
        from axonhpc.backends.devices import device_facts

        facts = device_facts()
        if facts.cupy is None or facts.devices < 1:
            sys.exit(f"train_gpt --device cuda needs cupy and a CUDA device: "
                     f"{'; '.join(facts.problems) or 'cupy sees no CUDA device'}")
        import cupy

        _xp = cupy
    if args.spares and not args.elastic:
        sys.exit("train_gpt: --spares needs --elastic")
    if args.respawn and not args.elastic:
        sys.exit("train_gpt: --respawn needs --elastic")
    if args.simulate_failure and not args.elastic:
        sys.exit("train_gpt: --simulate-failure needs --elastic (without it a lost rank ends the job)")
    if args.elastic and args.dp is not None:
        sys.exit("train_gpt: --elastic sets dp from the ranks left (dp = working ranks / (tp x pp)); leave out --dp")
    ax.init(fault_tolerant=True) if args.elastic else ax.init()
    if args.data:  # your own corpus: text bytes, or nanoGPT's uint16 token files, memory-mapped
        corpus = FileCorpus(args.data, held_out=0.1, seed=args.seed, vocab_size=args.vocab)
    else:
        corpus = TextCorpus(max_bytes=args.max_bytes, held_out=0.1, seed=args.seed)
    steps = Steps(args, corpus)
    if not steps.active:
        return 0  # a spare the run did not need
    run = steps.run
    main_rank = run.world.rank == 0
    first_step = steps.done
    if args.resume and main_rank:
        print(f"resumed from {args.resume} at step {first_step}", flush=True)
    n_params = int(sum(p.data.size for p in ax.nn.GPT(corpus.vocab_size, args.context, args.width, args.heads,
                                                        args.layers, seed=0).parameters())) if main_rank else 0
    if main_rank:
        print(f"GPT: {args.layers} blocks, width {args.width}, {args.heads} heads, context {args.context}, "
              f"{n_params} parameters, {args.dtype}, on dp={run.dp} x tp={args.tp} x pp={args.pp} = "
              f"{run.world.world_size} rank(s){' (FSDP)' if args.fsdp else ''}"
              f"{' (elastic' + (f', {args.spares} spare(s))' if args.spares else ')') if args.elastic else ''}; "
              f"{corpus}", flush=True)
        if args.pp > 1:
            print(f"pipeline: {args.schedule}, {run.microbatches} micro-batches, {run.stages} stages", flush=True)
    progress = Progress(args.steps, main_rank)
    curve, held_curve = [], []
    loss = math.nan
    tokens = 0
    seen = 0
    start = time.perf_counter()
    while steps.active and steps.done < args.steps:
        step = steps.done
        out = steps.step()
        run = steps.run
        for line in steps.recovered(seen):
            if run.world.rank == 0:
                print(("\n" if progress.tty and progress.enabled else "") + line, flush=True)
            seen += 1
            progress.enabled = run.world.rank == 0
        if out is None:
            continue  # ranks were lost: the survivors redo the step
        loss = out
        tokens += args.batch * args.context
        curve.append((step + 1, loss))
        progress.update(step, loss)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            held = steps.call(lambda r: held_out_loss(r.model, r.held, min(args.eval_batches, r.held.steps_per_epoch)))
            held_curve.append((step + 1, held))
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            steps.call(lambda r: r.save(args.save, step + 1), where="save")
        elif args.save:
            steps.call(lambda r: r.writer.poll())  # put a finished background save in place (one small all-reduce)
    seconds = time.perf_counter() - start
    if not steps.active:
        return 0  # its replica was dropped, and the run ended without it
    steps.close()
    peak = steps.call(peak_activations)
    if args.save:
        steps.call(lambda r: (r.save(args.save, args.steps), r.writer.wait()))
    held_loss = steps.call(lambda r: held_out_loss(r.model, r.held, min(args.eval_batches, r.held.steps_per_epoch)))
    held_curve.append((args.steps, held_loss))
    run = steps.run
    timelines = ax.gather_timelines(run.model.pipeline) if (args.plot and run.model.pipeline is not None and
                                                            run.mesh.coords.dp == 0 and run.mesh.coords.tp == 0) else None
    if run.world.rank == 0:
        print(f"final loss {loss!r}")
        print(f"held-out loss {held_loss!r}")
        print(f"{tokens / max(seconds, 1e-9):.0f} tokens/s ({args.steps - first_step} steps of {args.batch} x "
              f"{args.context} tokens in {seconds:.1f} s)")
        print(f"peak activations {peak[0] / 2**20:.2f} MiB on the busiest rank", flush=True)
        if args.plot:
            os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
            write_loss_plot(args.plot + "-loss.png", curve, held_curve)
            print(f"wrote {args.plot}-loss.png")
            if timelines is not None:
                ax.write_gantt_png(timelines, args.plot + "-pipeline.png")
                print(f"wrote {args.plot}-pipeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
