"""Train a small pipeline and write the executed timeline of its last step.

    axonhpc launch -n 2 -- examples/pipeline_timeline.py --schedule 1f1b --out timeline

writes timeline.json (open it in chrome://tracing or https://ui.perfetto.dev)
and, where matplotlib is installed, timeline.png: one row per rank, forwards
light, backwards dark, the gaps between them the pipeline bubble. The
measured bubble is printed beside the formula (p - 1) / (m + p - 1).
"""
import argparse
import sys

import numpy as np

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.parallel.pipeline.trace import gather_timelines, timeline_bubble, write_chrome_trace, write_gantt_png


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="timeline", help="file name stem for .json and .png")
    args = parser.parse_args(argv)

    world = ax.init()
    schedule = ax.PipelineSchedule.parse(args.schedule)
    v = 2 if schedule is ax.PipelineSchedule.INTERLEAVED_1F1B else 1
    total = world.world_size * v
    stages = []
    for s in range(total):
        layers = [nn.Linear(args.width, args.width, dtype=np.float32, seed=s), nn.Tanh()]
        if s == total - 1:
            layers.append(nn.Linear(args.width, 10, dtype=np.float32, seed=1000))
        stages.append(nn.Sequential(*layers))
    pipe = ax.Pipeline.from_modules(stages, num_microbatches=args.microbatches, schedule=schedule,
                                    loss_fn=nn.CrossEntropyLoss(), stages_per_rank=v)
    opt = optim.SGD(pipe.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, 10, args.batch)
    for _ in range(args.steps):
        opt.zero_grad()
        pipe.train_step(x, y)
        opt.step()
    timelines = gather_timelines(pipe)
    if timelines is not None:
        p, m = world.world_size, args.microbatches
        formula = (p - 1) / (v * m + p - 1)
        write_chrome_trace(timelines, args.out + ".json")
        print(f"{schedule.name}: p={p} m={m} v={v}: measured bubble {timeline_bubble(timelines):.3f}, "
              f"formula {formula:.3f}; wrote {args.out}.json", flush=True)
        try:
            write_gantt_png(timelines, args.out + ".png")
            print(f"wrote {args.out}.png", flush=True)
        except ImportError as exc:
            print(f"no PNG: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
