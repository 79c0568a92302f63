"""Tokens per second and peak activation memory of examples/train_gpt.py on every dp x tp x pp layout.

    python benchmarks/gpt_layouts.py --max-ranks 4 --repeats 3 --steps 30

Each layout runs the example under mpiexec (one process for 1x1x1) with
OMP_NUM_THREADS=1, ``--repeats`` times; the table shows the median tokens/s,
the ratio to the one-process run of the same session (the baseline), and the
busiest rank's peak activation memory in the last step, without and with
``--checkpoint-activations``. The model and batch are the example's
defaults unless given after ``--``.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def run(layout, steps, extra):
    dp, tp, pp = layout
    n = dp * tp * pp
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--dp", str(dp), "--tp", str(tp),
           "--pp", str(pp), "--steps", str(steps), *extra]
    if n > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(n)] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    rate = float(re.search(r"^(\d+) tokens/s", out.stdout, re.M).group(1))
    mib = float(re.search(r"^peak activations ([\d.]+) MiB", out.stdout, re.M).group(1))
    return rate, mib


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    rows = []
    for layout in LAYOUTS:
        if layout[0] * layout[1] * layout[2] > args.max_ranks:
            continue
        rates, mib = [], None
        for _ in range(args.repeats):
            rate, mib = run(layout, args.steps, extra)
            rates.append(rate)
        _, mib_ckpt = run(layout, 2, extra + ["--checkpoint-activations"])
        rows.append((layout, statistics.median(rates), mib, mib_ckpt))
    base = rows[0][1]
    print(f"{'dp x tp x pp':>12}  {'tokens/s':>9}  {'vs 1 proc':>9}  {'act. MiB':>8}  {'ckpt MiB':>8}")
    for (dp, tp, pp), rate, mib, mib_ckpt in rows:
        print(f"{f'{dp} x {tp} x {pp}':>12}  {rate:9.0f}  {rate / base:9.2f}  {mib:8.2f}  {mib_ckpt:8.2f}")


if __name__ == "__main__":
    main()
