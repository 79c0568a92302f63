"""Run the multi-rank test suite on one rank of an mpiexec job.

    mpiexec -n 4 python scripts/mpi_pytest.py LOGDIR [pytest args...]

Rank 0 writes to the console; every other rank writes to LOGDIR/rank<r>.log.
Each rank gets its own --basetemp (ranks would otherwise delete each other's
temporary files). At the end rank 0 prints every rank's summary line, and the
log of any rank that failed, and each rank exits with its own pytest status
(so mpiexec fails when any rank failed). An exception escaping pytest aborts
the whole job so that no rank is left waiting for it.
"""
import os
import sys
import time
import traceback


def main() -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    logdir = os.path.abspath(sys.argv[1])
    os.makedirs(logdir, exist_ok=True)
    log_path = os.path.join(logdir, f"rank{rank}.log")
    if rank != 0:
        log = open(log_path, "w", buffering=1)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
    import pytest

    class Summary:
        line = ""

        def pytest_terminal_summary(self, terminalreporter):
            stats = terminalreporter.stats
            counts = {k: len(v) for k, v in stats.items() if k in ("passed", "failed", "error", "skipped")}
            Summary.line = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))

    args = [
        "--with-mpi",
        "-p", "no:cacheprovider",
        "--color=no",
        f"--basetemp={os.path.join(logdir, f'tmp-rank{rank}')}",
        f"--junitxml={os.path.join(logdir, f'junit-rank{rank}.xml')}",
    ] + sys.argv[2:]
    try:
        code = int(pytest.main(args, plugins=[Summary()]))
    except BaseException:  # noqa: BLE001 - a crash outside any test: end the job
        sys.stderr.write(f"rank {rank}: pytest crashed\n{traceback.format_exc()}")
        sys.stderr.flush()
        time.sleep(0.5)
        comm.Abort(3)
        return 3
    sys.stdout.flush()
    verdicts = comm.gather((code, Summary.line), root=0)
    if rank == 0:
        for r, (c, line) in enumerate(verdicts):
            print(f"[n={size}] rank {r}: exit {c}: {line}")
        for r, (c, _) in enumerate(verdicts):
            if c != 0 and r != 0:
                with open(os.path.join(logdir, f"rank{r}.log"), errors="replace") as f:
                    print(f"----- log of rank {r} -----\n{f.read()}")
        sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
