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
turn the 75 into the step's 137. ``AXONHPC_ABORT_ON_EXCEPTION=0`` turns this off, as it does the abort on an
uncaught exception.

Under ``--fault-tolerant`` the rank ends its process at once with its status (``os._exit``), as the runtime's
excepthook ends one with an uncaught exception there (SIGKILL; ``os._exit(1)`` for a survivor's
``PeerFailedError``): ULFM's survivors see a failed process, which is what it is built for, and go on without it
(or raise ``PeerFailedError``). ``MPI_Abort`` is no use there: under
``--with-ft ulfm`` prterun does not end the other ranks (they waited for ever at exit, in the collective free
of a shared-memory window, with 4 ranks), and a plain exit would wait there the same way.

[Note: the job's exit status under --fault-tolerant]
Under ULFM prterun exits 0 when a rank was killed by a signal and the others finished, 137 when a process a
recovery spawned was killed even though the survivors recovered from it, and its status for a rank that failed
is whatever its bookkeeping kept. So ``axonhpc launch`` asks the ranks: it names a folder in
``AXONHPC_LAUNCH_STATUS_DIR``, and each rank of the job writes there, as it leaves this module, ``rank<r>``: its
exit status, and the job ranks whose loss it survived by recovering (``axonhpc.elastic`` notes them in
``axonhpc.backends.failures.SURVIVED``). A replacement spawned by a recovery writes one too, under the job rank
the survivors gave it (``n`` and up). The folder is on the launcher's host: a job whose ranks span hosts (an
allocation of several nodes, a hostfile) has ranks that cannot see it, so each rank that can first says so
(``start<r>``, as it starts) and a rank on another host writes nothing. The launcher then decides
(``axonhpc.job_status``): a rank's own non-zero status first (before a survivor's ``PeerFailedError``, 1), then 1
for a rank that started here and left no record (killed) unless a survivor recovered from its loss, else 0,
which also replaces prterun's non-zero status when a loss was recovered from. Ranks on other hosts are left to
mpiexec's status. And once each of the ``n`` ranks has left its script or was recovered from, a job
still running ``job_status.FINISH_GRACE`` seconds later is ended: a rank that ended while the others were in
``MPI_Finalize`` left them there for ever, in the agreement of ULFM's shrink, and a replacement sometimes waits
there for good in its disconnect from the job.
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any, List


def _status(code: Any) -> int:
    """The process exit status Python gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed to stderr, status 1


def _live_mpi() -> Any:
    """mpi4py's MPI module if the script initialised MPI and has not finalised it; else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi


def _end_job(status: int, message: Any) -> None:
    """End the MPI job (or, fault-tolerant, this rank) with ``status`` if this rank is one of several (see the
    note); else return."""
    mpi = _live_mpi()
    if mpi is None or mpi.COMM_WORLD.Get_size() == 1 or os.environ.get("AXONHPC_ABORT_ON_EXCEPTION", "1") == "0":
        return
    if message is not None and not isinstance(message, int):
        print(message, file=sys.stderr)  # what Python would have printed for SystemExit("...")
    rank = mpi.COMM_WORLD.Get_rank()
    fault_tolerant = os.environ.get("AXONHPC_FAULT_TOLERANT") == "1"
    what = "ending this rank at once: the survivors go on without it" if fault_tolerant else \
        "ending the job, whose other ranks could wait for it"
    sys.stderr.write(f"[axonhpc rank {rank}] exits with status {status}: {what} (AXONHPC_ABORT_ON_EXCEPTION=0: "
                     f"just exit)\n")
    sys.stdout.flush()
    sys.stderr.flush()
    if fault_tolerant:
        os._exit(status)
    # MPI_Abort kills the ranks at once, and mpiexec may stop forwarding this rank's output before it read the line
    # above (a full run lost it once, under load): a moment first, as the watchdog gives its error before aborting.
    time.sleep(0.5)
    mpi.COMM_WORLD.Abort(status)


# The launchers' variables for a process's rank and the size of its job: Open MPI's, then a PMI launcher's (MPICH).
_LAUNCHER_RANKS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def _job_rank() -> Any:
    """This process's rank in the launched job: for a replacement the job rank its survivors gave it (``n`` and
    up), None for one that never joined them."""
    mpi = _live_mpi()
    if mpi is not None:
        if mpi.Comm.Get_parent() != mpi.COMM_NULL:
            respawn = sys.modules.get("axonhpc.elastic.respawn")
            return getattr(respawn, "_joined", {}).get("id")
        return mpi.COMM_WORLD.Get_rank()
    for name, _ in _LAUNCHER_RANKS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def _started_here() -> None:
    """Tell ``axonhpc launch`` that this rank of the job runs where it can read the records (see the note): its
    host has the launcher's folder. A replacement (a job of its own, of fewer ranks) says nothing here."""
    folder = os.environ.get("AXONHPC_LAUNCH_STATUS_DIR")
    if not folder or not os.path.isdir(folder):
        return  # a rank on another host
    for rank_name, size_name in _LAUNCHER_RANKS:
        rank, size = os.environ.get(rank_name, ""), os.environ.get(size_name, "")
        if rank.isdigit() and size == os.environ.get("AXONHPC_LAUNCH_RANKS"):
            try:
                open(os.path.join(folder, f"start{rank}"), "w").close()
            except OSError:
                pass
            return


def _record(status: int, cause: Any = None) -> None:
    """Write this rank's exit status, and the job ranks it survived, for ``axonhpc launch`` (see the note)."""
    folder = os.environ.get("AXONHPC_LAUNCH_STATUS_DIR")
    if not folder or not os.path.isdir(folder):
        return  # none asked for, or a rank on another host than the launcher's
    try:
        rank = _job_rank()
        if rank is None:
            return
        failures = sys.modules.get("axonhpc.backends.failures")
        survived = sorted(getattr(failures, "SURVIVED", ()))
        errors = sys.modules.get("axonhpc.errors")
        # A survivor's PeerFailedError: the launcher prefers the failed rank's own status to this rank's 1.
        peer = errors is not None and isinstance(cause, errors.PeerFailedError)
        path = os.path.join(folder, f"rank{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{status} {','.join(map(str, survived))} {'peer' if peer else ''}\n")
        os.replace(path + ".tmp", path)
    except Exception as exc:  # noqa: BLE001 - the record must never change how the rank ends
        sys.stderr.write(f"[axonhpc] could not record this rank's exit status for axonhpc launch: {exc}\n")


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
    _started_here()
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        status = _status(exc.code)
        _record(status)
        if status != 0 and getattr(exc, "every_rank", False) is not True:
            _end_job(status, exc.code)
        raise
    except BaseException as exc:
        _record(1, exc)  # what Python exits with; the runtime's excepthook then ends the job (or, fault-tolerant, the rank)
        raise
    _record(0)


if __name__ == "__main__":
    main(sys.argv[1:])
