"""The current world: ``init``, ``run_local``, and ending the job on an uncaught error."""
from __future__ import annotations

import numbers
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional, Tuple

from ..observe import tracing
from ..errors import (ArgumentTypeError, CollectiveMismatchError, CollectiveRefusedError, ConfigurationError,
                      InvalidGroupError, PeerFailedError)
from ..observe.log import get_logger, set_rank_source
from ..settings import BACKENDS, settings
from ..threads import apply_plan, plan_threads
from .process_group import ProcessGroup
from .world import World

_global_world: Optional[World] = None


class _ThreadWorld(threading.local):
    """run_local gives each thread its own world; None elsewhere (a class default: no exception per lookup)."""

    world: Optional[World] = None


_thread = _ThreadWorld()
_previous_excepthook = None


def init(comm=None, backend: Optional[str] = None, debug: Optional[bool] = None,
         timeout: Optional[float] = None, fault_tolerant: Optional[bool] = None) -> World:
    """Build the world (once; idempotent) and make it the default for ``group=None``.

    With ``ax.settings.abort_on_exception`` an uncaught exception on any rank of a multi-rank world aborts the
    whole job, so no rank is left waiting. Thread pools are sized per rank (``axonhpc.threads``).

    Args:
        comm: an mpi4py intracommunicator (default ``MPI.COMM_WORLD``); given, it builds a new default world.
        backend: "auto", "mpi", "nccl" or "local" (one in-process rank; ``run_local`` for more). Default:
            ``ax.settings.backend``. See docs/gpu.md.
        timeout: seconds, 0 for none (None keeps ``ax.settings.timeout``).
        fault_tolerant: a rank that dies must not end the job (Open MPI 5 with ULFM; docs/fault-tolerance.md).

    Raises:
        BackendUnavailableError: the requested backend cannot work here.
        ConfigurationError: unknown backend name, a negative ``timeout``, or ``fault_tolerant`` where a dead
            rank would end the job anyway.
        ArgumentTypeError: a ``timeout`` that is not a number.
    """
    global _global_world
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise ArgumentTypeError(f"init(timeout={timeout!r}): the timeout is a number of seconds (or None to "
                                    f"keep ax.settings.timeout), got {type(timeout).__name__}")
        if not timeout >= 0 or timeout == float("inf"):
            raise ConfigurationError(f"init(timeout={timeout!r}) must be a positive number of seconds, or 0 for no "
                                     f"timeout (AXONHPC_TIMEOUT takes the same)")
    if fault_tolerant is not None and not isinstance(fault_tolerant, bool):
        raise ArgumentTypeError(f"init(fault_tolerant={fault_tolerant!r}): True or False, got "
                                f"{type(fault_tolerant).__name__}")
    if debug is not None:
        settings.debug = bool(debug)
    if fault_tolerant is not None:
        settings.fault_tolerant = fault_tolerant
    if timeout is not None:
        settings.timeout = float(timeout) if timeout > 0 else None
    if comm is None and _global_world is not None:
        return _global_world
    given = backend if backend is not None else settings.backend
    choice = given.lower() if isinstance(given, str) else given
    if choice not in BACKENDS:
        where = "init(backend=...)" if backend is not None else "ax.settings.backend (AXONHPC_BACKEND)"
        raise ConfigurationError(f"unknown backend {given!r} from {where}; use one of: {', '.join(BACKENDS)}")
    if settings.fault_tolerant:
        _check_fault_tolerance(choice, comm)
    if choice == "local":
        world = World.mock()
    else:
        from .device_path import build_world

        world = build_world(choice, comm)  # MPI, plus NCCL for cupy arrays where it works
    _global_world = world
    if choice != "local":  # ranks that are processes; run_local's thread ranks share one process's pools
        apply_plan(plan_threads(world.usable_cores, world.cpu_sharers), log=world.rank == 0)
        for hook in AFTER_INIT:  # the collectives' watchdog and flight signal (a layer above this one)
            hook(world)
    if settings.timeline_dir:
        tracing.record_run(world.rank, settings.timeline_dir)
    if settings.abort_on_exception:
        install_abort_on_exception(world)
    return world


def _check_fault_tolerance(choice: str, comm: Any) -> None:
    """Refuse ``fault_tolerant`` where a dead rank would end the job anyway; else let MPI errors raise.

    Every rank decides alike, from the MPI library and the launch's environment.
    """
    if choice == "local":
        raise ConfigurationError("fault_tolerant needs MPI ranks: the 'local' backend is one process, which has "
                                 "no peer to lose")
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigurationError(f"fault_tolerant needs mpi4py, which failed to import: {exc}") from None
    from ..backends.failures import ulfm_problem

    problem = ulfm_problem(MPI)
    if problem is not None:
        raise ConfigurationError(f"fault_tolerant (ax.init or AXONHPC_FAULT_TOLERANT): {problem}")
    # Errors come back to the caller (mpi4py raises them) instead of aborting; the world's communicators
    # are duplicates of this one and keep its handler.
    (MPI.COMM_WORLD if comm is None else comm).Set_errhandler(MPI.ERRORS_RETURN)


def current_world() -> World:
    """The world of this thread (under ``run_local``), else the initialised one, else ``init()``."""
    world = getattr(_thread, "world", None)
    if world is not None:
        return world
    return _global_world if _global_world is not None else init()


def resolve_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """``group``, or the default group of the current world when None."""
    if group is None:
        return current_world().default_group
    if not isinstance(group, ProcessGroup):
        raise InvalidGroupError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
    return group


def _rank_facts() -> Optional[Tuple[int, int]]:
    """``(rank, world size)`` of the caller's world, if one exists (never builds one)."""
    world = getattr(_thread, "world", None) or _global_world
    return None if world is None else (world.rank, world.world_size)


set_rank_source(_rank_facts)


def is_initialized() -> bool:
    """True once ``init`` has built a world in this process."""
    return _global_world is not None


# Called with a reason just before an uncaught exception aborts the job (layers above register here).
BEFORE_ABORT: List[Callable[[str], Any]] = []
# Called with the world once ``init`` has built an MPI world (layers above register here).
AFTER_INIT: List[Callable[[World], Any]] = []


def told_elsewhere(exc: BaseException, rank: int) -> Optional[str]:
    """Why ``rank`` prints one line for ``exc``, not its traceback: another rank prints it in full (or None)."""
    if isinstance(exc, CollectiveRefusedError):
        return f"rank {exc.rank} refused the call and prints its traceback"
    ranks = getattr(exc, "ranks", ())
    if isinstance(exc, CollectiveMismatchError) and ranks and rank in ranks and rank != min(ranks):
        return f"the same error as on rank {min(ranks)}, which prints its traceback"
    return None


def install_abort_on_exception(world: World) -> None:
    """Make an uncaught exception on this rank print, flush and then abort the whole job."""
    global _previous_excepthook
    if _previous_excepthook is not None or world.world_size == 1:
        return
    _previous_excepthook = sys.excepthook

    def hook(exc_type, exc, tb):
        for last_words in BEFORE_ABORT:  # e.g. the flight recorder's dump
            try:
                last_words(f"uncaught {exc_type.__name__}")
            except Exception:  # noqa: BLE001 - nothing may stop the abort
                pass
        elsewhere = told_elsewhere(exc, world.rank)
        if elsewhere is None:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            get_logger("runtime").error(f"uncaught exception on rank {world.rank}; aborting the job "
                                        f"(set AXONHPC_ABORT_ON_EXCEPTION=0 to turn this off)\n{text}")
        else:  # the same error on several ranks: one traceback in the job's log, one line from each other rank
            first = str(exc).splitlines()[0] if str(exc) else ""
            get_logger("runtime").error(f"uncaught {exc_type.__name__} on rank {world.rank} ({elsewhere}); aborting "
                                        f"the job: {first[:300]}")
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(0.5 if elsewhere is None else 1.5)  # the traceback's rank aborts first, once it is printed
        if settings.fault_tolerant:
            # A process that ends is what ULFM is built to survive: the others raise PeerFailedError in their
            # next call that needs this rank (or, elastic, go on without it). MPI_Abort is not: under
            # --with-ft ulfm prterun does not end the other ranks, which then waited for ever at exit (the
            # collective free of a shared-memory window, 4 ranks), and after a failure it has left prterun
            # deadlocked (blocked on a lock, the ranks gone). axonhpc launch still exits with an error
            # ([Note: the job's exit status under --fault-tolerant] in axonhpc/launched.py).
            if not isinstance(exc, PeerFailedError):
                # This rank's own error. Survivors waiting for it in an MPI all-reduce (4 ranks, shared memory
                # off) never learnt of a process that ended with os._exit(1); of one killed, at once. Its
                # status is kept for axonhpc launch all the same (launched.py recorded 1 before this hook).
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)  # a survivor's PeerFailedError: every survivor raised it, none is left waiting
        world.abort(1)

    sys.excepthook = hook


def run_local(fn: Callable[[World], Any], world_size: int = 2) -> List[Any]:
    """Run ``fn(world)`` on ``world_size`` threads of this process, each with its own in-process ``World``.

    Returns:
        ``fn``'s results, in rank order.

    Raises:
        The first exception of the lowest failing rank (the others are woken, not left waiting), with what
        the other failing ranks raised added as notes.
    """
    from ..backends.local import LocalAbort, LocalBackend

    backends = LocalBackend.create_world(world_size)
    results: List[Any] = [None] * world_size
    errors: List[Optional[BaseException]] = [None] * world_size

    def body(rank: int) -> None:
        _thread.world = World(backends[rank])
        try:
            results[rank] = fn(_thread.world)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            backends[rank].abort_quietly(f"rank {rank} raised {type(exc).__name__}: {exc}")
        finally:
            _thread.world = None

    threads = [threading.Thread(target=body, args=(r,), name=f"axonhpc-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    primary = [e for e in errors if e is not None and not isinstance(e, LocalAbort)]
    failed = primary or [e for e in errors if e is not None]
    if failed:
        first = failed[0]
        for rank, exc in enumerate(errors):
            if exc is not None and exc is not first and not isinstance(exc, LocalAbort):
                where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
                at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
                first.add_note(f"rank {rank} raised {type(exc).__name__}: {exc}{at}")
        raise first
    return results
