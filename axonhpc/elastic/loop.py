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
from ..backends.failures import describe_ranks
from ..checkpoint.boxes import Box
from ..checkpoint.io import gather_text
from ..checkpoint.model_slices import fill_model_state, state_pieces
from ..checkpoint.sliced import save_slices
from ..backends import ReduceOp
from ..collectives import all_reduce
from ..errors import CheckpointError, ConfigurationError, PeerFailedError, RecoveryError
from ..groups.runtime import current_world, init
from ..observe.log import get_logger
from ..parallel.comm_hooks import allreduce_hook
from ..settings import settings
from .buddy import BuddyCopies, shard_parameters
from . import replicas
from .respawn import joined, spawn
from .spares import Rendezvous
from .state import describe_missing, gather_state

KILL_POINTS = ("forward", "backward", "optimizer", "save", "spare")


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

    def line(self) -> str:
        """``recovered: lost rank(s) 2 at step 4, continuing on 3 ranks (dp=3) in 0.41 s``."""
        return (f"recovered: lost rank{'s' if len(self.lost) > 1 else ''} {', '.join(map(str, self.lost))} at step "
                f"{self.step}, continuing on {self.ranks} rank{'s' if self.ranks != 1 else ''} (dp={self.dp}) in "
                f"{self.seconds:.2f} s")


def parse_failures(text: Optional[str]) -> List[Tuple[int, int, str]]:
    """``"R:K[:where][,...]"`` as ``(rank, steps done, where)``: rank R SIGKILLs itself once K steps are done.

    ``where``: "forward" (default), "backward", "optimizer", "save" or "spare"
    (K is then the steps done when the run started).

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

    Attributes:
        parts: the current ``build(world)`` result (None on a spare).
        done: the steps done.
        recoveries: a ``Recovery`` per recovery so far.
        width: the data-parallel width kept while spares last.

    Raises:
        ConfigurationError: fault tolerance is off, or the model is not data-parallel over the whole world.
    """

    def __init__(self, build: Callable[[Any], Any], first_step: int = 0, simulate_failure: Optional[str] = None,
                 save: Optional[str] = None, spares: int = 0, respawn: bool = False):
        if not settings.fault_tolerant:
            raise ConfigurationError("ElasticTraining needs fault tolerance: ax.init(fault_tolerant=True) in a job "
                                     "started with axonhpc launch --fault-tolerant (Open MPI with ULFM)")
        from mpi4py import MPI

        self._MPI = MPI
        self.build = build
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
            self._set_up(current_world(), None, None)
            return
        mine = self.comm.Split(0 if self.active else MPI.UNDEFINED, self.job_rank)
        if self.active:
            self._working_comm = mine
            self._set_up(init(comm=mine), None, None)
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
        self._rebuild(self.comm, self.members, facts["lost"], facts["working"], None, False, False,
                      facts["target"], facts["failed_step"], time.perf_counter(), time.time())

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

    def close(self) -> None:
        """Collective: let the spares go (working ranks, after the last step); the communicator is then theirs alone."""
        while self.active and self.rendezvous is not None:
            if self.rendezvous.wait():
                self.rendezvous = None
                self.comm, self.members = self._working_comm, list(self.working)
                return
            self._recover(False, ending=True)

    # -- set-up -------------------------------------------------------------------------------
    def _set_up(self, world: Any, whole: Optional[Dict[str, np.ndarray]], described: Any) -> None:
        parts = self.build(world)
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
        """Shrink, agree, rebuild; True if this rank's interrupted step was finished. ``ending``: failure came in ``close``."""
        MPI, start, caught = self._MPI, time.perf_counter(), time.time()
        was_active, old_parts, old_working = self.active, self.parts, self.working
        if self.rendezvous is not None:
            self.rendezvous.revoke()  # wake the spares
        comm, survivors = self._shrink()
        lost = [m for m in self.members if m not in survivors]
        # Every survivor, spares too: the most steps any working rank finished, the fewest, whether the run ends,
        # and the working ranks' mesh (a spare has built none).
        facts = np.array([self.done, -self.done, int(ending), *self.shape] if was_active else
                         [-1, -(1 << 62), int(ending), 0, 0, 0], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, facts, op=MPI.MAX)
        target, failed_step, ending = int(facts[0]), 1 - int(facts[1]), bool(facts[2])
        self.shape = tuple(int(v) for v in facts[3:])
        if ending:  # the working ranks had finished: the spares leave, the working ones go on as they are
            keep = [m for m in old_working if m in survivors]
            mine = comm.Split(0 if self.job_rank in keep else MPI.UNDEFINED, self.job_rank)
            self.rendezvous, self.working, self.members = None, keep, keep
            self.comm = self._working_comm = mine if self.active else comm
            return False
        empty = replicas.fill(old_working, survivors).count(None)
        if self.respawn and empty:
            ids = list(range(self.next_id, self.next_id + empty))
            self.next_id += len(ids)
            told = {"members": survivors + ids, "width": self.width, "working": old_working, "lost": lost,
                    "target": target, "failed_step": failed_step, "next_id": self.next_id, "shape": self.shape}
            comm, survivors = spawn(MPI, comm, told, ids), survivors + ids
        return self._rebuild(comm, survivors, lost, old_working, old_parts, was_active, entered, target, failed_step,
                             start, caught)

    def _rebuild(self, comm: Any, survivors: List[int], lost: List[int], old_working: List[int], old_parts: Any,
                 was_active: bool, entered: bool, target: int, failed_step: int, start: float, caught: float) -> bool:
        """Collective over ``comm`` (survivors and replacements): the new world, its run, and the state in it."""
        MPI = self._MPI
        working, dp = replicas.plan(replicas.fill(old_working, survivors), self.shape)
        if dp == 0:
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} no data-parallel replica is whole "
                                f"(dp x tp x pp = {' x '.join(map(str, self.shape))}); resume from the last checkpoint",
                                lost)
        self.comm, self.members, self.working = comm, survivors, working
        self.rendezvous = Rendezvous(MPI, comm) if len(survivors) > len(working) else None
        mine = comm.Split(0 if self.active else MPI.UNDEFINED, working.index(self.job_rank) if self.active else 0)
        shm.abandon_open_windows()  # the old world's: freeing them would wait for the dead
        if not self.active:
            if was_active:  # its replica was dropped: it waits as a spare, and may take a place later
                self._wait_as_spare()
            return False  # a spare: back to waiting (or the run ended, or it took a place and is rebuilt)
        self._working_comm = mine
        world = init(comm=mine)
        finished = False
        if was_active and self.done < target:
            if self.done + 1 != target or not entered:
                raise RecoveryError(f"after the loss of {describe_ranks(lost)} this rank had done {self.done} steps and "
                                    f"another {target}; the step's last collective should have made that impossible",
                                    lost)
            self._finish()
            finished = True
        self.done = target
        buddy, shape = self.buddy, self.shape
        if buddy is not None or (old_parts is not None and shard_parameters(old_parts.model) is not None):
            pairs = replicas.unkept_shards(old_working, working, lost, shape)
            if pairs:
                raise RecoveryError(f"FSDP shards are lost with their buddy copies: {'; '.join(pairs)} "
                                    f"({describe_ranks(lost)} of the job); resume from the last checkpoint", lost)
        pieces, described = [], None
        if old_parts is not None:
            pieces, described = state_pieces(old_parts.model.parameter_boxes(), old_parts.optimizer)
        source = old_working[replicas.neighbour(old_working.index(self.job_rank), shape, -1)] if was_active else None
        if buddy is not None and source not in working:  # the source's own shards are not in the new run
            copy, _ = state_pieces(old_parts.model.parameter_boxes(shard_rank=buddy.source, shards=buddy.copies),
                                   buddy.copy_optimizer)
            pieces += copy
        whole, missing = gather_state(world.default_group, pieces)
        described = next(d for d in map(json.loads, gather_text(json.dumps(described), world.default_group))
                         if d is not None)  # a spare has none, and may hold rank 0 now
        if missing:
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} no survivor holds {describe_missing(missing)}; "
                                f"resume from the last checkpoint", lost)
        abandon = getattr(old_parts, "abandon", None)
        if abandon is not None:
            abandon()
        del old_parts, pieces
        self.buddy = None
        try:
            self._set_up(world, whole, described)
        except (ConfigurationError, CheckpointError) as problem:
            saved = self._save_whole(world, whole, described) if self.save else ""
            raise RecoveryError(f"after the loss of {describe_ranks(lost)} the run cannot go on on {world.world_size} "
                                f"rank{'s' if world.world_size != 1 else ''}: {problem}{saved}", lost) from problem
        took = np.array([time.perf_counter() - start])  # the longest: a spare's or replacement's clock started late
        all_reduce(took, ReduceOp.MAX, group=world.default_group)
        record = Recovery(lost, failed_step, world.world_size, self.parts.model.dp.size, float(took[0]), caught)
        self.recoveries.append(record)
        if world.rank == 0:
            get_logger("elastic").warning(record.line())
        return finished

    def _shrink(self) -> Tuple[Any, List[int]]:
        """Collective over the survivors: the run's communicator without the failed ranks, and its job ranks."""
        MPI = self._MPI
        comm = self.comm.Shrink()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        group, old = comm.Get_group(), self.comm.Get_group()
        try:  # by the old communicator's ranks: replacements are in no COMM_WORLD the others know
            ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), old)
            return comm, [self.members[r] for r in ranks]
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
