"""The ``axonhpc`` command (also ``python -m axonhpc``).

    axonhpc info                         what MPI, threads, GPU libraries, ranks and nodes this is
    axonhpc bench NAME [args]            benchmarks (allreduce, ddp, fsdp, pack, pipeline)
    axonhpc launch -n N [--] script.py   mpiexec wrapper that works as root and aborts on errors
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List, Optional

from .mpiexec import NOT_FOUND, find_mpiexec, launch_command, mpiexec_flavour

BENCHMARKS = {
    "allreduce": "axonhpc.bench.allreduce",
    "ddp": "axonhpc.bench.ddp",
    "fsdp": "axonhpc.bench.fsdp",
    "pack": "axonhpc.bench.pack",
    "pipeline": "axonhpc.bench.pipeline",
}


def _cmd_info(args) -> int:
    from .info import info

    facts = info()
    if args.json:
        print(json.dumps(facts, indent=2, default=str))
    elif facts.get("rank", 0) == 0:
        width = max(len(k) for k in facts)
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _cmd_bench(args) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.name])
    return int(module.main(args.rest) or 0)


def _cmd_launch(args) -> int:
    if args.n < 1:
        print(f"axonhpc launch: -n must be at least 1, got {args.n}", file=sys.stderr)
        return 2
    rest = list(args.command)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        print("axonhpc launch: no script given (usage: axonhpc launch -n N -- script.py args...)", file=sys.stderr)
        return 2
    script, script_args = rest[0], rest[1:]
    if not os.path.isfile(script):
        print(f"axonhpc launch: script {script!r} does not exist", file=sys.stderr)
        return 2
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print(f"axonhpc launch: {NOT_FOUND}", file=sys.stderr)
        return 2
    flavour = mpiexec_flavour(mpiexec)
    cmd = launch_command(mpiexec, flavour, args.n, script, script_args, args.hosts, os.geteuid() == 0)
    env = dict(os.environ)
    # Under launch an uncaught exception on one rank ends the job (opt out with =0).
    env.setdefault("AXONHPC_ABORT_ON_EXCEPTION", "1")
    if args.verbose:
        print("axonhpc launch:", " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd, env=env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonhpc", description="MPI-native distributed training for HPC clusters")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="MPI vendor and version, thread level, GPU libraries, ranks and nodes")
    p.add_argument("--json", action="store_true", help="print every rank's facts as JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("bench", help="benchmarks; run under mpiexec for more than one rank")
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (--help for each)")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("launch", help="run a script on N ranks with mpiexec")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--hosts", default=None, help="comma-separated host list passed to mpiexec")
    p.add_argument("-v", "--verbose", action="store_true", help="print the mpiexec command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py args...")
    p.set_defaults(func=_cmd_launch)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
