"""What ``axonhpc launch`` runs on every rank: the user's script, and a job that ends when a rank exits with an error.

    python <this file> script.py args...     (or  -m module args...)

It is run as a file, not with ``-m axonhpc.launched``: importing the axonhpc package would load numpy before
the script could set its environment (thread counts) the way it can under plain ``python script.py``. So it
imports nothing of axonhpc's, and replaces its own directory on ``sys.path`` with the script's.

[Note: a rank that exits with an error]
MPI ends a job when a rank dies, not when one exits. A rank that calls ``sys.exit(4)`` (an argparse error,
a failed check) while the others wait for it in a collective first waits itself, at exit, in the collective
frees of its shared-memory windows and in ``MPI_Finalize``: the job hangs until a timeout, and the 4 is lost.
``sys.excepthook`` never sees ``SystemExit``, so the abort on an uncaught exception (``groups.runtime``)
cannot help. This module runs the script as ``python script.py`` would (``__main__``, ``sys.argv``, the
script's directory first on ``sys.path``) and catches a ``SystemExit`` with a non-zero status from it. Where
MPI runs with more than one rank, it then aborts the job with that status: ``MPI_Abort`` passes it on as
mpiexec's exit status under MPICH and Open MPI alike (measured here), so the job ends at once and
``axonhpc launch`` exits with the rank's code. Status 0 exits as usual, and so does a ``SystemExit`` whose
``every_rank`` attribute is True: every rank raises it together (the trainer's preemption exit, 75), so none
waits for another, and under ``srun`` (the SLURM templates run scripts through this file too) an abort would
turn the 75 into the step's 137. Under ``--fault-tolerant`` the rank just exits: ULFM's survivors go on
without it. ``AXONHPC_ABORT_ON_EXCEPTION=0`` turns this off, as it does the abort on an uncaught exception.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Any, List


def _status(code: Any) -> int:
    """The process exit status Python gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed to stderr, status 1


def _end_job(status: int, message: Any) -> None:
    """Abort the MPI job with ``status`` if this rank is one of several (see the note); else return."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    if os.environ.get("AXONHPC_ABORT_ON_EXCEPTION", "1") == "0" or os.environ.get("AXONHPC_FAULT_TOLERANT") == "1":
        return
    if message is not None and not isinstance(message, int):
        print(message, file=sys.stderr)  # what Python would have printed for SystemExit("...")
    rank = mpi.COMM_WORLD.Get_rank()
    sys.stderr.write(f"[axonhpc rank {rank}] exits with status {status}: ending the job, whose other ranks could "
                     f"wait for it (AXONHPC_ABORT_ON_EXCEPTION=0: just exit)\n")
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(status)


def main(argv: List[str]) -> None:
    """Run ``argv`` (``script.py args...`` or ``-m module args...``) as ``python`` would."""
    if not argv:
        raise SystemExit(f"usage: python {__file__} script.py args...  (or -m module args...)")
    # sys.path[0] is this file's directory (axonhpc/): python would put the script's there, or for -m the
    # current directory.
    if argv[0] == "-m":
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        status = _status(exc.code)
        if status != 0 and getattr(exc, "every_rank", False) is not True:
            _end_job(status, exc.code)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
