"""Training that survives the loss of ranks: shrink the world, rebuild, and redo the interrupted step.

[Note: why every survivor resumes from the same state]
A step has two halves: the first does all of the step's communication and
ends with one more 8-byte all-reduce; the second only updates this rank's
memory (optimizer, buddy copy). Nobody finishes that last all-reduce before
every rank has entered it, so when a rank dies either no survivor has
started the second half, or every survivor holds what it needs. The
survivors agree on the most steps any finished; those one step behind finish
theirs from the gradients they hold. The state after that step is then
whole somewhere: in every DDP replica, or in a lost FSDP shard's buddy
(``elastic.buddy``).

[Note: recovery]
On ``PeerFailedError`` the survivors shrink the communicator (ULFM), agree on
the step, gather the state (``elastic.state``), build a new world and call
``build(world)`` again, then redo the interrupted step with the same global
batch: the sampler's global batch ``k`` is the same samples on any number of
ranks, so the run follows the loss of the uninterrupted one. Where the state
is not whole or the ranks left cannot divide the global batch, every
survivor raises ``RecoveryError``; with ``save`` set, a whole state is first
written there.

[Note: a rank lost while the run is built]
Building the first world's run is collective (a wrapper compares the model
and broadcasts rank 0's parameters), so a rank can die in it, when some
survivors have built their part and others have not. The working ranks
therefore end the build with ``MPI_Comm_agree`` (ULFM's fault-tolerant
agreement) on "built here": it raises ``MPI_ERR_PROC_FAILED`` on every
survivor alike when a rank failed before taking part, so either every rank
built its part or every survivor knows the build was cut short. In that case
there is no state to gather: nothing was trained. The survivors shrink as for
any loss and build the run's first world again on themselves (``start``, a
checkpoint loaded there too), with the same global batch, then agree again.

[Note: a failure during recovery]
A rank can die while the survivors recover: in the shrink, the agreement on
the step, the ``Split`` that brings spares in, the new world's set-up or the
gathering of the state. A recovery is therefore made of attempts. Each starts
from what the rank held when the recovery began (the old run is kept until
the end: ``_Before``), shrinks the communicator once more, and ends with
``MPI_Comm_agree`` over the attempt's communicator on "went through here".
That agreement fails on every survivor alike when a rank failed in the
attempt; a survivor that met the failure itself first revokes the attempt's
communicators, so none is left waiting in one of its calls. The survivors
then try again without the newly lost ranks, with every loss so far counted:
a rank behind by one step has finished it on the old run (which the next
attempt starts from), and an FSDP shard whose keeper died in the meantime is
known lost, so every survivor raises ``RecoveryError`` naming both. Only an
agreed attempt replaces the old run and records the ``Recovery``. An attempt
that failed although the next shrink finds no rank lost ends the run with
``RecoveryError`` instead of trying for ever.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..backends import shm
from ..backends.failures import describe_ranks, failure_classes, note_survived, revoke
from ..checkpoint.boxes import Box
from ..checkpoint.io import gather_text
from ..checkpoint.model_slices import fill_model_state, state_pieces
from ..checkpoint.sliced import save_slices
from ..backends import ReduceOp
from ..collectives import all_reduce, engine_calls
from ..errors import CheckpointError, CollectiveRefusedError, ConfigurationError, PeerFailedError, RecoveryError
from ..groups.runtime import current_world, init
from ..observe.log import get_logger
from ..parallel.comm_hooks import allreduce_hook
from ..settings import settings
from .buddy import BuddyCopies, shard_parameters
from . import replicas
from .respawn import joined, spawn
from .spares import Rendezvous
from .state import describe_missing, gather_state

KILL_POINTS = ("forward", "backward", "optimizer", "save", "spare", "shrink", "agree", "split", "restore")
_BUILT, _NO_ERROR = 1, 2  # the bits of the first world's build agreement


@dataclass
class _Before:
    """What a rank held as a recovery began; every attempt starts from it ([Note: a failure during recovery])."""

    active: bool
    parts: Any
    buddy: Optional[BuddyCopies]
    working: List[int]
    shape: replicas.Shape
    entered: bool
    unbuilt: bool


_AGAIN = object()  # what ``_settle`` returns when a rank failed during the attempt, on every survivor alike


@dataclass
class Recovery:
    """One recovery: who was lost, at which step (1-based), on how many ranks the run went on, how long it took.

    ``seconds``: from this rank's ``PeerFailedError`` to the rebuilt run; ``caught``: its ``time.time()``.
    """

    lost: List[int]
    step: int
    ranks: int
    dp: int
    seconds: float
    caught: float = 0.0
    fresh: bool = False  # lost while the run's first world was built: built anew on the survivors, nothing gathered

    def line(self) -> str:
        """``recovered: lost rank(s) 2 at step 4, continuing on 3 ranks (dp=3) in 0.41 s``."""
        when = "while the run was built" if self.fresh else f"at step {self.step}"
        return (f"recovered: lost rank{'s' if len(self.lost) > 1 else ''} {', '.join(map(str, self.lost))} {when}, "
                f"continuing on {self.ranks} rank{'s' if self.ranks != 1 else ''} (dp={self.dp}) in "
                f"{self.seconds:.2f} s")


def parse_failures(text: Optional[str]) -> List[Tuple[int, int, str]]:
    """``"R:K[:where][,...]"`` as ``(rank, steps done, where)``: rank R SIGKILLs itself once K steps are done.

    ``where``: "forward" (default), "backward", "optimizer", "save" or "spare"
    (K is then the steps done when the run started); or a point of a recovery
    this rank takes part in (K: the steps it had done when the recovery began;
    [Note: a failure during recovery]): "shrink" (as the survivors enter
    ``MPI_Comm_shrink``), "agree" (as they agree on the step), "split" (as they
    and the spares enter the ``Split`` that makes the new working ranks) or
    "restore" (as the state is gathered).

    Raises:
        ConfigurationError: another form, naming it.
    """
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        fields = item.strip().split(":")
        where = fields[2] if len(fields) == 3 else "forward"
        numbers = [f.strip() for f in fields[:2]]
        if len(fields) not in (2, 3) or where not in KILL_POINTS or not all(f.isdigit() for f in numbers):
            raise ConfigurationError(f"simulate_failure {item!r}: expected RANK:STEPS[:WHERE] (WHERE one of "
                                     f"{', '.join(KILL_POINTS)}), e.g. 2:3 or 1:5:backward")
        rank, steps = int(numbers[0]), int(numbers[1])
        out.append((rank, steps, where))
    return out


class ElasticTraining:
    """Steps of a data-parallel run that go on, on fewer replicas, when ranks die (Open MPI with ULFM).

    Args:
        build: ``build(world)`` returns the run's parts for that world: an
            object with ``model`` (with ``parameter_boxes()``; dp group DDP or
            FSDP covering the world, tp and pp optional) and ``optimizer``, plus
            whatever the steps use. Its ``update()``, if any, replaces
            ``optimizer.step()``; its ``abandon()``, if any, is called on the old
            parts before new ones are built.
        first_step: the steps already done (a resumed run).
        simulate_failure: see ``parse_failures``.
        save: a checkpoint directory for the whole state when the run cannot go on, or None.
        spares: this many of the highest ranks wait and replace lost ones
            (``elastic.spares``). On a spare the constructor returns once it
            trains (``active``) or the run has ended. Working ranks call
            ``close`` after the last step.
        respawn: where no spare is left, ``MPI_Comm_spawn`` a replacement
            (``elastic.respawn``).
        start: ``start(world)`` builds the run's first world (a checkpoint
            loaded, say): at the start, and again on the survivors when ranks
            are lost while it is built ([Note: a rank lost while the run is
            built]). None: ``build``.

    Attributes:
        parts: the current ``build(world)`` result (None on a spare).
        done: the steps done.
        recoveries: a ``Recovery`` per recovery so far.
        width: the data-parallel width kept while spares last.

    Raises:
        ConfigurationError: fault tolerance is off, or the model is not data-parallel over the whole world.
    """

    def __init__(self, build: Callable[[Any], Any], first_step: int = 0, simulate_failure: Optional[str] = None,
                 save: Optional[str] = None, spares: int = 0, respawn: bool = False,
                 start: Optional[Callable[[Any], Any]] = None):
        if not settings.fault_tolerant:
            raise ConfigurationError("ElasticTraining needs fault tolerance: ax.init(fault_tolerant=True) in a job "
                                     "started with axonhpc launch --fault-tolerant (Open MPI with ULFM)")
        from mpi4py import MPI

        self._MPI = MPI
        self.build = build
        self.start = build if start is None else start
        self.unbuilt = True  # no run built and agreed on yet: a loss now builds the first world anew
        self.done = int(first_step)
        self.save = save
        self.respawn = bool(respawn)
        self.shape: replicas.Shape = (1, 1, 1)  # the model's dp x tp x pp, from its first build
        self.recoveries: List[Recovery] = []
        self.buddy: Optional[BuddyCopies] = None
        self.parts: Any = None
        self.world: Any = None
        self.rendezvous: Optional[Rendezvous] = None
        facts = joined(MPI)
        if facts is not None and not facts.get("taken"):
            self._join(facts, simulate_failure)
            return
        self.comm = MPI.COMM_WORLD
        self.members = list(range(self.comm.Get_size()))  # the job ranks left, in the communicator's order
        self.job_rank = self.comm.Get_rank()
        self.next_id = len(self.members)  # the job rank of the next replacement (respawn)
        if isinstance(spares, bool) or not isinstance(spares, int) or not 0 <= spares < len(self.members):
            raise ConfigurationError(f"ElasticTraining spares={spares!r}: a number of ranks from 0 to "
                                     f"{len(self.members) - 1} (this job has {len(self.members)})")
        self.width = len(self.members) - spares  # the data-parallel width the run keeps while spares last
        self.working = self.members[:self.width]  # the job ranks that train; the others wait (spares)
        self._failures = [(k, where) for r, k, where in parse_failures(simulate_failure) if r == self.job_rank]
        self.rendezvous = Rendezvous(MPI, self.comm) if spares else None
        self._working_comm = self.comm  # the working ranks' communicator (the job's, without spares)
        if not spares:
            self._build_first(current_world())
            return
        mine = self.comm.Split(0 if self.active else MPI.UNDEFINED, self.job_rank)
        if self.active:
            self._working_comm = mine
            self._build_first(init(comm=mine))
        else:
            self._wait_as_spare()

    def _join(self, facts: Dict[str, Any], simulate_failure: Optional[str]) -> None:
        """A replacement (``elastic.respawn``): take part in the survivors' recovery, and train."""
        facts["taken"] = True
        self.comm, self.members, self.job_rank = facts["comm"], facts["members"], facts["id"]
        self.width, self.working, self.next_id = facts["width"], facts["working"], facts["next_id"]
        self.shape = tuple(facts["shape"])
        self._working_comm = self.comm
        self._failures = [(k, where) for r, k, where in parse_failures(simulate_failure) if r == self.job_rank]
        before = _Before(False, None, None, list(facts["working"]), self.shape, False, False)
        at, lost, start, caught = [self.comm, self.members], list(facts["lost"]), time.perf_counter(), time.time()
        def attempt() -> Optional[Callable[[], bool]]:  # the survivors' attempt, from where they spawned this process
            return self._rebuild(at[0], at[1], lost, before, facts["target"], facts["failed_step"], start, caught,
                                 facts.get("fresh", False))

        if self._settle(at, lost, attempt) is _AGAIN:
            self._recover_from(at[0], at[1], lost, before, False, start, caught)
        self._build_again()

    @property
    def active(self) -> bool:
        """Whether this rank trains now (False: a spare waiting, or one left over when the run ended)."""
        return self.job_rank in self.working

    def _wait_as_spare(self) -> None:
        """A spare's life: wait; after a failure join the recovery, and return if it made this rank a working one."""
        self._maybe_fail("spare")
        while not self.active:
            if self.rendezvous is None or self.rendezvous.wait():
                return  # the run ended
            self._recover(False)
        self._build_again()

    def close(self) -> None:
        """Collective: let the spares go (working ranks, after the last step); the communicator is then theirs alone."""
        while self.active and self.rendezvous is not None:
            if self.rendezvous.wait():
                self.rendezvous = None
                self.comm, self.members = self._working_comm, list(self.working)
                return
            self._recover(False, ending=True)

    # -- set-up -------------------------------------------------------------------------------
    def _build_first(self, world: Any) -> None:
        """Collective over the working ranks: the run's first world built and agreed on; after a rank lost in it,
        built again on the survivors ([Note: a rank lost while the run is built])."""
        if self._built_everywhere(world):
            self.unbuilt = False
            return
        self._recover(False)
        self._build_again()

    def _build_again(self) -> None:
        """After a recovery on a rank that trains: once more while the first world's build is cut short again."""
        while self.active and self.unbuilt:
            self._recover(False)

    def _built_everywhere(self, world: Any) -> bool:
        """Collective over the working ranks: ``start(world)``, then ``MPI_Comm_agree`` on whether every rank built.

        Raises:
            CollectiveRefusedError: on the other ranks, when one rank's build raised another error (raised there).
        """
        flags, problem = _BUILT | _NO_ERROR, None  # Agree ANDs the bits over the ranks
        try:
            self._set_up(world, None, None, first=True)
        except PeerFailedError:
            flags = _NO_ERROR
        except Exception as exc:  # this rank's own: the others must not wait in the agreement for it
            flags, problem = 0, exc
        flags = self._agree(self._working_comm, flags, problem)
        if not flags & _NO_ERROR:
            raise CollectiveRefusedError(f"another rank's build of the run's first world ({world.world_size} ranks) "
                                         f"raised an error (shown by that rank), so job rank {self.job_rank} stops too")
        return bool(flags & _BUILT)

    def _agree(self, comm: Any, flags: int, problem: Optional[BaseException]) -> int:
        """``MPI_Comm_agree`` of ``flags`` (_BUILT, _NO_ERROR: ANDed over the ranks) on ``comm``; then this rank's own
        ``problem``, if any, is raised. A rank that failed before taking part fails the agreement on every survivor
        alike: then nothing counts as built."""
        MPI = self._MPI
        try:
            flags = comm.Agree(flags)
        except MPI.Exception as exc:
            if exc.Get_error_class() not in failure_classes(MPI):
                raise
            flags = 0 if problem is not None else _NO_ERROR
        if problem is not None:
            raise problem
        return flags

    def _set_up(self, world: Any, whole: Optional[Dict[str, np.ndarray]], described: Any, first: bool = False) -> None:
        self.parts, self.buddy = None, None  # until this world's are built (a build cut short leaves none)
        parts = (self.start if first else self.build)(world)
        model, optimizer = parts.model, parts.optimizer
        shape = tuple(getattr(getattr(model, axis, None), "size", 1) for axis in ("dp", "tp", "pp"))
        if getattr(model, "dp", None) is None or shape[0] * shape[1] * shape[2] != world.world_size:
            raise ConfigurationError(f"ElasticTraining shrinks data parallelism: the model's dp x tp x pp must cover "
                                     f"all {world.world_size} ranks, it has {' x '.join(map(str, shape))}"
                                     f"{'' if getattr(model, 'dp', None) is not None else ' (no dp group)'}")
        if self.shape[1:] != (1, 1) and shape[1:] != self.shape[1:]:
            raise ConfigurationError(f"ElasticTraining keeps tp and pp: the model was built with tp x pp = "
                                     f"{shape[1]} x {shape[2]}, the run has {self.shape[1]} x {self.shape[2]}")
        self.shape = shape
        if whole is not None:
            fill_model_state(model.parameter_boxes(), optimizer, whole, described)
        if hasattr(model, "step"):
            model.step = self.done  # dropout masks are keyed by the step
        shards = shard_parameters(model)
        dp = model.dp
        self.buddy = BuddyCopies(shards, optimizer, dp) if shards is not None and dp.size > 1 else None
        if any(where == "backward" for _, where in self._failures):
            self._arm_backward(model)
        self.parts, self.world = parts, world

    def _arm_backward(self, model: Any) -> None:
        if getattr(model, "engine", None) is None:
            raise ConfigurationError("simulate_failure's backward point waits in a DDP or FSDP gradient hook; this "
                                     "model has none (a pipeline: pp > 1)")
        def hook(state: Any, bucket: Any) -> Any:
            self._maybe_fail("backward")
            return allreduce_hook(state, bucket)

        model.engine.register_comm_hook(None, hook)

    # -- simulated failures -------------------------------------------------------------------
    def _maybe_fail(self, where: str) -> None:
        if (self.done, where) in self._failures:
            os.kill(os.getpid(), signal.SIGKILL)

    def fail_point(self, where: str) -> None:
        """Die here (SIGKILL) if ``simulate_failure`` names this rank, this point and the steps done now."""
        self._maybe_fail(where)

    # -- steps --------------------------------------------------------------------------------
    def step(self, fn: Callable[[Any], Any]) -> Optional[Any]:
        """Collective: one training step, ``fn(parts)`` (forward, backward, gradient sync), then the optimizer.

        Returns:
            ``fn``'s result (the loss) once the step is done, or None when ranks
            failed and the survivors went on without this step done: call again
            (with ``parts`` as rebuilt) for step ``done``.

        Raises:
            RecoveryError: ranks failed and the run cannot go on (see the module note).
        """
        self._check_active("step")
        entered, result = False, None
        try:
            self._maybe_fail("forward")
            result = fn(self.parts)
            if self.buddy is not None:
                self.buddy.exchange()
            entered = True
            all_reduce(np.zeros(1, dtype=np.int64), group=self.world.default_group)  # the step's last collective
            self._maybe_fail("optimizer")
            self._finish()
            return result
        except PeerFailedError:
            finished = self._recover(entered)
            return result if finished else None

    def call(self, fn: Callable[[Any], Any]) -> Optional[Any]:
        """Collective: ``fn(parts)`` between steps; None if ranks failed in it (it is not redone)."""
        self._check_active("call")
        try:
            return fn(self.parts)
        except PeerFailedError:
            self._recover(False)
            return None

    def _check_active(self, what: str) -> None:
        if not self.active:
            raise ConfigurationError(f"ElasticTraining.{what} on job rank {self.job_rank}, which does not train: a "
                                     f"spare once the run has ended (or a dropped replica's rank); check run.active")

    def _finish(self) -> None:
        """The step's local half: the optimizer (``parts.update()`` where the parts have it), and the buddy copy's."""
        update = getattr(self.parts, "update", None)
        if update is not None:
            update()
        else:
            self.parts.optimizer.step()
        if self.buddy is not None:
            self.buddy.step()
        self.done += 1

    # -- recovery -----------------------------------------------------------------------------
    def _recover(self, entered: bool, ending: bool = False) -> bool:
        """Shrink, agree, rebuild; True if this rank's interrupted step was finished. ``ending``: failure came in ``close``.

        Collective over the survivors; tried again, on fewer ranks, while ranks fail during it ([Note: a failure
        during recovery]).
        """
        before = _Before(self.active, self.parts, self.buddy, list(self.working), self.shape, entered, self.unbuilt)
        return self._recover_from(self.comm, self.members, [], before, ending, time.perf_counter(), time.time())

    def _recover_from(self, comm: Any, members: List[int], lost: List[int], before: "_Before", ending: bool,
                      start: float, caught: float) -> bool:
        """Attempts at a recovery, each on ``comm`` shrunk, until one is agreed on by every survivor."""
        again = False
        while True:
            if self.rendezvous is not None:
                self.rendezvous.revoke()  # wake the spares
            self._maybe_fail("shrink")
            comm, survivors = self._shrink(comm, members)
            if again and survivors == members:  # alike on every survivor: the shrink agreed on who is left
                raise RecoveryError(f"a recovery from the loss of {describe_ranks(lost)} failed on "
                                    f"{len(members)} ranks, and no more ranks were lost; resume from the last "
                                    f"checkpoint", lost)
            lost = sorted(lost + [m for m in members if m not in survivors])
            note_survived(lost)  # axonhpc launch: their loss alone does not fail the job (a RecoveryError does)
            self.parts, self.buddy, self.working, self.shape = before.parts, before.buddy, before.working, before.shape
            self.unbuilt = before.unbuilt
            at = [comm, survivors]  # where this attempt is agreed on: the communicator merged with replacements
            finished = self._settle(at, lost, lambda: self._attempt(at, lost, before, ending, start, caught))
            if finished is not _AGAIN:
                return finished
            comm, members, again = at[0], at[1], True

    def _attempt(self, at: List[Any], lost: List[int], before: "_Before", ending: bool, start: float,
                 caught: float) -> Optional[Callable[[], bool]]:
        """One attempt at a recovery on ``at`` = [communicator, job ranks]: up to the agreement that settles it."""
        MPI = self._MPI
        comm, survivors = at
        self._maybe_fail("agree")
        # Every survivor, spares too: the most steps any working rank finished, the fewest, whether the run ends,
        # whether its first world's build was cut short (then on every working rank: [Note: a rank lost while the
        # run is built]), whether the run is sharded (FSDP), and the working ranks' mesh (a spare has built none).
        sharded = before.buddy is not None or (before.parts is not None and
                                               shard_parameters(before.parts.model) is not None)
        facts = np.array([self.done, -self.done, int(ending), int(before.unbuilt), int(sharded), *before.shape]
                         if before.active else [-1, -(1 << 62), int(ending), 0, 0, 0, 0, 0], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, facts, op=MPI.MAX)
        target, failed_step, ending, fresh = int(facts[0]), 1 - int(facts[1]), bool(facts[2]), bool(facts[3])
        sharded = bool(facts[4])
        self.shape = tuple(int(v) for v in facts[5:])
        if fresh and int(np.prod(self.shape)) != len(before.working):  # no rank had built its part: mesh unknown
            self.shape = (len(before.working), 1, 1)
        if ending:  # the working ranks had finished: the spares leave, the working ones go on as they are
            keep = [m for m in before.working if m in survivors]
            mine = comm.Split(0 if self.job_rank in keep else MPI.UNDEFINED, self.job_rank)

            def ended() -> bool:
                self.rendezvous, self.working, self.members = None, keep, keep
                self.comm = self._working_comm = mine if self.active else comm
                return False
            return ended
        if sharded and not fresh:  # every survivor alike, before anything is built: a lost shard and keeper end it
            pairs = replicas.unkept_shards(before.working, replicas.plan(replicas.fill(before.working, survivors),
                                                                         self.shape)[0], lost, self.shape)
            if pairs:
                raise RecoveryError(f"FSDP shards are lost with their buddy copies: {'; '.join(pairs)} "
                                    f"({describe_ranks(lost)} of the job); resume from the last checkpoint", lost)
        empty = replicas.fill(before.working, survivors).count(None)
        if self.respawn and empty:
            ids = list(range(self.next_id, self.next_id + empty))
            self.next_id += len(ids)
            told = {"members": survivors + ids, "width": self.width, "working": before.working, "lost": lost,
                    "target": target, "failed_step": failed_step, "next_id": self.next_id, "shape": self.shape,
                    "fresh": fresh}
            at[:] = spawn(MPI, comm, told, ids), survivors + ids
        return self._rebuild(at[0], at[1], lost, before, target, failed_step, start, caught, fresh)

    def _settle(self, at: List[Any], lost: List[int], attempt: Callable[[], Optional[Callable[[], bool]]]) -> Any:
        """Collective over ``at[0]``: ``attempt()``, then ``MPI_Comm_agree`` on whether it went through everywhere.

        ``attempt()`` returns what to do once it went through everywhere, or None where it did not (a rank failed).

        Returns:
            What that continuation returns, once every rank's attempt went through; ``_AGAIN`` (on every survivor
            alike) when a rank failed during the attempt: shrink and try again.

        Raises:
            RecoveryError: this rank's, or on the others when one rank's attempt raised an error.
        """
        MPI = self._MPI
        then, problem = None, None
        try:
            then = attempt()
        except RecoveryError as exc:  # a PeerFailedError too, but one that ends the run
            problem = exc
        except PeerFailedError:
            pass
        except MPI.Exception as exc:
            if exc.Get_error_class() not in failure_classes(MPI):
                problem = exc
        except Exception as exc:  # this rank's own: the others learn of it in the agreement, none waits for it
            problem = exc
        comm = at[0]
        if then is None:  # a survivor still waiting in this attempt (a Split, an all-reduce, init) stops
            for waited in (comm, self._working_comm):
                if waited != MPI.COMM_WORLD:  # never revoked: failures.py drives MPI's progress through it
                    revoke(MPI, waited)
        flags = self._agree(comm, (_BUILT if then is not None else 0) | (_NO_ERROR if problem is None else 0), problem)
        if not flags & _NO_ERROR:
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} another rank could not go on (its error is "
                                f"shown by that rank), so job rank {self.job_rank} stops too", lost)
        if not flags & _BUILT:
            return _AGAIN
        return then()

    def _rebuild(self, comm: Any, survivors: List[int], lost: List[int], before: "_Before", target: int,
                 failed_step: int, start: float, caught: float, fresh: bool = False) -> Optional[Callable[[], bool]]:
        """Collective over ``comm`` (survivors and replacements): the new world, its run, and the state in it.

        ``fresh``: the first world's build was cut short; it is built anew, nothing is gathered. Returns what to
        do once every rank's rebuild went through (``_settle``); the old run is kept until then.
        """
        MPI = self._MPI
        working, dp = replicas.plan(replicas.fill(before.working, survivors), self.shape)
        if dp == 0:
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} no data-parallel replica is whole "
                                f"(dp x tp x pp = {' x '.join(map(str, self.shape))}); resume from the last checkpoint",
                                lost)
        self.comm, self.members, self.working = comm, survivors, working
        self.rendezvous = Rendezvous(MPI, comm) if len(survivors) > len(working) else None
        self._maybe_fail("split")
        mine = comm.Split(0 if self.active else MPI.UNDEFINED, working.index(self.job_rank) if self.active else 0)
        shm.abandon_open_windows()  # the old world's: freeing them would wait for the dead
        engine_calls.forget_all()  # and their calls in flight, which no new world's wait may wait for
        if not self.active:
            def wait() -> bool:
                if before.active:  # its replica was dropped: it waits as a spare, and may take a place later
                    self._forget(before)
                    self._wait_as_spare()
                return False  # a spare: back to waiting (or the run ended, or it took a place and is rebuilt)
            return wait
        self._working_comm = mine
        world = init(comm=mine)
        if fresh:
            self.done = target
            return self._rebuild_first(world, lost, failed_step, start, caught)
        finished = False
        if before.active and self.done < target:
            if self.done + 1 != target or not before.entered:
                raise RecoveryError(f"after the loss of {describe_ranks(lost)} this rank had done {self.done} steps and "
                                    f"another {target}; the step's last collective should have made that impossible",
                                    lost)
            self._finish()  # on the old run, kept whatever happens next: a later attempt starts from it
            finished = True
        self.done = target
        old_parts, buddy, shape = before.parts, before.buddy, self.shape
        pieces, described = [], None
        if old_parts is not None:
            pieces, described = state_pieces(old_parts.model.parameter_boxes(), old_parts.optimizer)
        source = (before.working[replicas.neighbour(before.working.index(self.job_rank), shape, -1)]
                  if before.active else None)
        if buddy is not None and source not in working:  # the source's own shards are not in the new run
            copy, _ = state_pieces(old_parts.model.parameter_boxes(shard_rank=buddy.source, shards=buddy.copies),
                                   buddy.copy_optimizer)
            pieces += copy
        self._maybe_fail("restore")
        whole, missing = gather_state(world.default_group, pieces)
        described = next(d for d in map(json.loads, gather_text(json.dumps(described), world.default_group))
                         if d is not None)  # a spare has none, and may hold rank 0 now
        if missing:
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} no survivor holds {describe_missing(missing)}; "
                                f"resume from the last checkpoint", lost)
        abandon = getattr(old_parts, "abandon", None)
        if abandon is not None:
            abandon()  # local: a save in flight is dropped (again, in a later attempt)
        del pieces
        try:
            self._set_up(world, whole, described)
        except (ConfigurationError, CheckpointError) as problem:
            saved = self._save_whole(world, whole, described) if self.save else ""
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} the run cannot go on on {world.world_size} "
                                f"rank{'s' if world.world_size != 1 else ''}: {problem}{saved}", lost) from problem
        del whole
        record = Recovery(lost, failed_step, world.world_size, self.parts.model.dp.size, 0.0, caught)
        self._timed(record, start)

        def rebuilt() -> bool:
            self.unbuilt = False  # a spare or replacement that took a place
            self._forget(before)
            self._keep(record)
            return finished
        return rebuilt

    def _rebuild_first(self, world: Any, lost: List[int], failed_step: int, start: float,
                       caught: float) -> Optional[Callable[[], bool]]:
        """Collective over the new working ranks: the first world's run built anew on them, nothing gathered.

        None when it was cut short again (a rank failed in it): the attempt did not go through.
        """
        try:
            built = self._built_everywhere(world)
        except (ConfigurationError, CheckpointError) as problem:
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} while the run was built, it cannot be "
                                f"built on {world.world_size} rank{'s' if world.world_size != 1 else ''}: {problem}",
                                lost) from problem
        if not built:  # cut short again: every survivor tries again ([Note: a failure during recovery])
            return None
        record = Recovery(lost, failed_step, world.world_size, self.parts.model.dp.size, 0.0, caught, True)
        self._timed(record, start)

        def rebuilt() -> bool:
            self.unbuilt = False
            self._keep(record)
            return False
        return rebuilt

    @staticmethod
    def _forget(before: "_Before") -> None:
        """Once a recovery is agreed on: the old run is no longer needed for another attempt."""
        before.parts = before.buddy = None

    def _timed(self, record: Recovery, start: float) -> None:
        """Collective over the new world: ``record.seconds``, the longest recovery time of its ranks."""
        took = np.array([time.perf_counter() - start])  # the longest: a spare's or replacement's clock started late
        all_reduce(took, ReduceOp.MAX, group=self.world.default_group)
        record.seconds = float(took[0])

    def _keep(self, record: Recovery) -> None:
        """Local, once every survivor agreed on the recovery: ``record`` kept and logged (by the new rank 0)."""
        self.recoveries.append(record)
        if self.world.rank == 0:
            get_logger("elastic").warning(record.line())

    def _shrink(self, comm: Any, members: List[int]) -> Tuple[Any, List[int]]:
        """Collective over the survivors: ``comm`` without the failed ranks, and its job ranks (``members``' order)."""
        MPI = self._MPI
        shrunk = comm.Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        group, old = shrunk.Get_group(), comm.Get_group()
        try:  # by the old communicator's ranks: replacements are in no COMM_WORLD the others know
            ranks = MPI.Group.Translate_ranks(group, list(range(shrunk.Get_size())), old)
            return shrunk, [members[r] for r in ranks]
        finally:
            group.Free()
            old.Free()

    def _save_whole(self, world: Any, whole: Dict[str, np.ndarray], described: Any) -> str:
        """Write the whole state to ``save`` (rank 0 holds every piece); the text that says so, for the error."""
        pieces = {key: (Box.full(a.shape), a) for key, a in whole.items()} if world.rank == 0 else {}
        save_slices(self.save, pieces, group=world.default_group,
                    extra={"optimizer": described, "user": {"step": self.done}})
        return f". The state after {self.done} steps is saved in {self.save!r} (load_model_slices resumes it)"


__all__ = ["ElasticTraining", "Recovery", "parse_failures", "KILL_POINTS"]
