"""Pipeline parallelism: run the actions of a pipeline schedule over point-to-point messages.

[Note: the executor]
Rank r of P owns stages r, r + P, ... (Megatron's layout). A module keeps one activation cache and other
micro-batches run through it before this one's backward, so after ``F`` of stage s on micro-batch i the cache
is stashed under (s, i) and ``B`` restores it. Stages s and s + 1 on one rank hand over locally.

[Note: loss gradient]
The last stage takes ``loss_fn.backward(1 / M)`` right after the loss: a loss object also keeps a single
cache, and taking its gradient at once means it never has to be stashed. Summed over M equal micro-batches
this is the gradient of the full-batch mean loss.

[Note: a refused batch]
A batch that does not split into ``num_microbatches`` is refused, but no rank may stop alone while the
others wait for its messages. Rank 0, which reads ``x``, computes nothing: it is a failed stage from the
start ([Note: a stage that fails]), so its refusal travels down the stages in place of their shape headers
([Note: a refused header] in ``transport``), no rank computes anything, and the step's vote ([Note: a batch
refused on one rank]) raises everywhere: the refusing rank its ``ShapeError``, the others
``CollectiveRefusedError`` naming it. A refused ``y`` on the last stage is a loss that refuses every
micro-batch (a zero gradient goes back), and an array a rank was given but does not read is voted on alike,
so every rank raises before the step returns.

[Note: a stage that fails]
A stage's forward, backward or send may raise on one rank alone (a layer given the wrong feature count, an
output the transport cannot carry, a bug in a user's layer) while the other ranks wait for its messages. As
DDP does for a failed backward ([Note: a failed backward] in ``ddp.wrapper``), the failing rank does not
raise there: it keeps the error as the step's problem and walks the rest of its schedule computing nothing
(``_StepState.failed``), with each of its ops replaced by the message it owes (``_PLACEHOLDERS``): a
refused header where its header had not gone out, else zeros of the promised shape, zeros for the
gradients it owes, and the receives it was due, whose contents it drops. A rank that hears a refused header
has nothing to compute either and goes on alike, so the refusal reaches every stage after the failed one,
across the interleaved wrap-around from the last rank to rank 0 too. Every message of the schedule is then
sent and received, each rank waits for its sends, and the vote at the step's end raises everywhere: the
failing rank its own error, the others ``CollectiveRefusedError`` naming it; the gradients of that step are
partial. Any ``Exception`` is passed on this way, a user's ``ValueError`` as much as an ``AxonError``,
except ``GROUP_FAILURES``, which the group knows already (they are raised at once). ``forward`` does the
same over its (micro-batch, stage) walk and ends with the same vote.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..._dtypes import array_module
from ...errors import GROUP_FAILURES, AxonError, ConfigurationError, ShapeError, UsageError
from ...groups import ProcessGroup, resolve_group
from ...collectives.p2p import largest_tag
from ...collectives.refusal import batch_refused, vote
from ...nn import cached_nbytes, call_backward
from ...observe import tracing
from ..grad_norm import clip_grad_norm, counted_here, tensor_group
from ..split import split_parameters
from ..same_model import check_same_model, compared_model
from .lowering import RECV_B, RECV_F, SEND_B, SEND_F, Op, Step, lower_schedule
from .render import format_schedule_table
from .replicas import StageReplicas
from .schedules import BACKWARD, FORWARD, Action, PipelineSchedule, pipeline_schedule
from .tied import TiedParameters, describe_ties, find_ties, unique_parameters
from .transport import ACT, EVAL_ACT, EVAL_HDR, GRAD, HDR, NUM_KINDS, Transport, message_tag


@dataclass(frozen=True)
class PipelineStage:
    """One stage this rank holds: its ``module`` and its ``index`` among ``num_stages`` stages."""

    module: Any
    index: int
    num_stages: int


class Pipeline:
    """Pipeline-parallel execution of a model split into stages; build it with ``from_modules`` or ``from_stages``.

    Args:
        stage_modules: every stage's module, in order, the same list on every rank.
        num_microbatches: micro-batches M per step; the batch size must be a multiple of M.
        loss_fn: ``loss_fn(out, y)`` on the last stage's output, ``loss_fn.backward(g)`` the gradient scaled by ``g``.
        stages_per_rank: model chunks per rank (v > 1 needs INTERLEAVED_1F1B).
        dp_group: the ranks holding the same stages in other replicas, or None. When given, parameters are
            copied from its rank 0 (collective) and ``train_step`` averages gradients and loss over it.

    A Parameter that stages on several ranks share (a tied embedding) has its copies made equal here and its
    gradient summed over those ranks after every ``train_step`` ([Note: tied parameters] in ``tied``).

    Attributes:
        last_step_stats: after ``train_step``: peak activations and bytes, ``timeline``, ``messages_sent``,
            ``dp_sync_time`` and ``step_time``.

    Raises:
        ConfigurationError: the number of modules is not ``P * stages_per_rank``, the schedule rejects the
            counts, or tags would not fit.
        NotAMemberError: this rank is not in ``group``.
        ModelMismatchError: the ranks passed different counts or schedules, or ``dp_group`` replicas differ.
    """

    def __init__(self, stage_modules: Sequence[Any], group: Any = None, num_microbatches: int = 8,
                 schedule: Union[PipelineSchedule, str] = PipelineSchedule.ONE_F_ONE_B,
                 loss_fn: Any = None, stages_per_rank: int = 1, dp_group: Any = None,
                 dp_bucket_size: int = 25_000_000):
        self.group = resolve_group(group).require_member("building a Pipeline")
        self.stage_modules = list(stage_modules)
        p = self.group.size
        # Before any other message: the pipeline's ranks run the same schedule and counts (one exchange),
        # or every rank raises instead of waiting for messages that never come.
        with compared_model(self.group, f"Pipeline over group {self.group.name}",
                            hint="every rank of the pipeline must pass the same number of stages, micro-batches, "
                                 "schedule and stages_per_rank, and tie the same Parameters between stages"
                            ) as described:
            self._check_counts(stages_per_rank, schedule, num_microbatches)
            setting = (f"pipeline: {len(self.stage_modules)} stages, num_microbatches={num_microbatches!r}, "
                       f"schedule={self.schedule.name}, stages_per_rank={stages_per_rank!r}")
            ties = find_ties(self.stage_modules, p)  # [Note: tied parameters]
            described.settings = [setting, describe_ties(ties)]
        self.loss_fn = loss_fn
        self.rank = self.group.rank
        self.size = p
        self.stages = list(range(self.rank, self.num_stages, p))
        self._transport = Transport(self.group, self.num_stages)  # the messages between stages
        self._steps = lower_schedule(self._table[self.rank], self.rank, p, self.num_stages)
        self._tied = TiedParameters(self.group, ties)
        self.last_step_stats: Dict[str, Any] = {}
        self.dp_group = None
        self._replicas: Optional[StageReplicas] = None
        if dp_group is not None:
            self._replicas = StageReplicas(dp_group, self.stages, self.stage_modules, setting, dp_bucket_size)
            self.dp_group = self._replicas.group

    def _check_counts(self, stages_per_rank: Any, schedule: Any, num_microbatches: Any) -> None:
        """The constructor's local checks; sets the schedule and counts (see ``__init__``'s Raises)."""
        p = self.group.size
        if not isinstance(stages_per_rank, int) or isinstance(stages_per_rank, bool) or stages_per_rank < 1:
            raise ConfigurationError(f"stages_per_rank must be a positive int, got {stages_per_rank!r}")
        if len(self.stage_modules) != p * stages_per_rank:
            raise ConfigurationError(
                f"Pipeline got {len(self.stage_modules)} stage modules, but a group of {p} ranks with "
                f"stages_per_rank={stages_per_rank} needs exactly {p * stages_per_rank}"
            )
        self.schedule = PipelineSchedule.parse(schedule)
        self.num_stages = len(self.stage_modules)
        if isinstance(num_microbatches, int) and not isinstance(num_microbatches, bool) and num_microbatches > 0:
            # Before the schedule's table, whose size grows with num_microbatches.
            largest = message_tag(num_microbatches - 1, self.num_stages - 1, NUM_KINDS - 1, self.num_stages)
            bound = largest_tag(self.group)
            if largest > bound:
                raise ConfigurationError(
                    f"num_microbatches={num_microbatches} x num_stages={self.num_stages} needs message tags up "
                    f"to {largest}, above the {bound} that point-to-point messages carry on group "
                    f"{self.group.name}; use fewer micro-batches or stages")
        self.num_microbatches = num_microbatches
        self.stages_per_rank = stages_per_rank
        # Validates the counts (positive ints, interleaving needs m % P == 0) once, here.
        self._table = pipeline_schedule(self.schedule, self.num_stages, num_microbatches, stages_per_rank)

    @classmethod
    def from_modules(cls, stage_modules: Sequence[Any], group: Any = None, num_microbatches: int = 8,
                     schedule: Union[PipelineSchedule, str] = PipelineSchedule.ONE_F_ONE_B,
                     loss_fn: Any = None, stages_per_rank: int = 1, dp_group: Any = None,
                     dp_bucket_size: int = 25_000_000) -> "Pipeline":
        """Build this rank's pipeline from the full list of stage modules (same arguments as the class)."""
        return cls(stage_modules, group=group, num_microbatches=num_microbatches, schedule=schedule,
                   loss_fn=loss_fn, stages_per_rank=stages_per_rank, dp_group=dp_group,
                   dp_bucket_size=dp_bucket_size)

    @classmethod
    def from_stages(cls, stages: Sequence[PipelineStage], group: Any = None, num_microbatches: int = 8,
                    schedule: Union[PipelineSchedule, str] = PipelineSchedule.ONE_F_ONE_B,
                    loss_fn: Any = None, dp_group: Any = None, dp_bucket_size: int = 25_000_000) -> "Pipeline":
        """Build a pipeline from only the stages this rank holds (r, r + P, ...), so no rank builds the whole model.

        Raises ConfigurationError, before any message, for no stages, inconsistent ``num_stages``, a count the group
        size does not divide, or indices other than this rank's.
        """
        pg = resolve_group(group).require_member("building a Pipeline")
        stages = list(stages)
        try:
            total = cls._check_stages(stages, pg)
        except AxonError as exc:
            # The other ranks are in the constructor's first exchange: take part, marked as failed, so that
            # they raise (naming this rank) instead of waiting; then raise here.
            check_same_model(pg, f"Pipeline over group {pg.name}", [], exc)
            raise
        modules: List[Any] = [None] * total
        for st in stages:
            modules[int(st.index)] = st.module
        return cls(modules, group=pg, num_microbatches=num_microbatches, schedule=schedule, loss_fn=loss_fn,
                   stages_per_rank=total // pg.size, dp_group=dp_group, dp_bucket_size=dp_bucket_size)

    @staticmethod
    def _check_stages(stages: List[PipelineStage], pg: Any) -> int:
        """``from_stages``' local checks; returns the number of stages."""
        if not stages:
            raise ConfigurationError(f"Pipeline.from_stages needs this rank's stages; group rank {pg.rank} gave none")
        totals = sorted({int(st.num_stages) for st in stages})
        if len(totals) != 1:
            raise ConfigurationError(f"the stages of group rank {pg.rank} disagree on num_stages: {totals}")
        total = totals[0]
        if total < 1 or total % pg.size != 0:
            raise ConfigurationError(
                f"num_stages={total} must be a positive multiple of the pipeline group size {pg.size}"
            )
        expected = list(range(pg.rank, total, pg.size))
        given = sorted(int(st.index) for st in stages)
        if given != expected:
            raise ConfigurationError(
                f"group rank {pg.rank} of {pg.size} must hold stages {expected} of {total}, got {given}"
            )
        return total

    # -- facts --------------------------------------------------------------
    def owner(self, stage: int) -> int:
        """The group rank that holds ``stage``."""
        return self._transport.owner(stage)

    @property
    def is_last(self) -> bool:
        """True on the rank that holds the last stage (where losses and outputs appear)."""
        return self.owner(self.num_stages - 1) == self.rank

    def parameters(self) -> List[Any]:
        """This rank's stages' Parameters, in stage order, each shared Parameter once (for its optimizer)."""
        return unique_parameters([self.stage_modules[s] for s in self.stages])

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Collective over the pipeline's group: scale this rank's gradients so that the norm of the whole model's
        (every stage's, a tied Parameter once) is at most ``max_norm``; returns that norm, before clipping, on
        every rank: what ``optim.clip_grad_norm`` over the unsplit model gives.

        Call it between ``train_step`` (which sums tied gradients and averages over ``dp_group``: every replica
        computes the same norm) and the optimizer's step.

        Stages of tensor-parallel layers are summed over their group first (a split parameter counted on every
        rank of it, a whole one on its rank 0), then over the pipeline: every rank of the mesh gets the model's
        norm.

        Raises:
            InvalidArgumentError: a non-positive ``norm_type`` or a ``max_norm`` that is not a number, on every
                rank; CollectiveMismatchError on every rank if the ranks passed different ones.
            ConfigurationError: this rank's stages hold layers split over more than one group, over a group
                that holds another rank of this pipeline, or over a group of some other kind of layer (raised
                here, and as a refusal on every other rank).
        """
        params = self.parameters()
        split: Dict[int, Any] = {}
        for s in self.stages:
            split.update(split_parameters(self.stage_modules[s]))
        problem, tensor = None, None
        try:
            tensor = tensor_group(split, "Pipeline.clip_grad_norm")
            self._check_tensor_layout(tensor, split)
        except ConfigurationError as exc:
            problem = exc
        elsewhere = self._tied.held_elsewhere()
        counted, uncounted = counted_here(params, split, None if problem else tensor, elsewhere)
        return clip_grad_norm(counted, max_norm, norm_type, uncounted, sum_over=[tensor, self.group],
                              problem=problem)

    def _check_tensor_layout(self, tensor: Any, split: Dict[int, Any]) -> None:
        """ConfigurationError unless every layer with a group of its own in this rank's stages is a tensor-parallel
        one over ``tensor``, whose ranks hold this rank's stages (none of them is in this pipeline but this one).

        A block with a group of its own (``TensorParallelAttention``) is one of them when every parameter it holds
        is held by its tensor-parallel linear layers over the same ranks: they say how each is split.
        """
        layers = {id(layer) for layer, _ in split.values()}

        def built_of_split_layers(m: Any) -> bool:
            held = {id(p) for layer in m.modules() if id(layer) in layers
                    and tuple(layer.group.ranks) == tuple(m.group.ranks) for p in layer.parameters()}
            return all(id(p) in held for p in m.parameters())

        other = sorted(name for s in self.stages for name, m in self.stage_modules[s].named_modules()
                       if isinstance(getattr(m, "group", None), ProcessGroup) and m.group.size > 1
                       and id(m) not in layers and not built_of_split_layers(m))
        if other:
            raise ConfigurationError(f"Pipeline.clip_grad_norm: stages hold layers split over groups of their own "
                                     f"that are not tensor-parallel linear layers ({other[:3]}): how their "
                                     f"parameters are split is not known, so no norm is computed")
        if tensor is not None and set(tensor.ranks) & set(self.group.ranks) != {self.group.ranks[self.rank]}:
            raise ConfigurationError(f"Pipeline.clip_grad_norm: the tensor-parallel group {tensor.name} "
                                     f"{list(tensor.ranks)} shares ranks with this pipeline {list(self.group.ranks)} "
                                     f"other than this one: its ranks must hold the same stages (a mesh's tp "
                                     f"group beside its pp group)")

    def schedule_table(self) -> List[List[Action]]:
        """The per-rank action lists this pipeline runs (a fresh copy)."""
        return [list(actions) for actions in self._table]

    def schedule_text(self, *, timed: bool = True, forward_cost: int = 1, backward_cost: int = 1) -> str:
        """This pipeline's schedule as a step-by-rank grid: ``format_schedule_table(self.schedule_table(), ...)``."""
        return format_schedule_table(self._table, timed=timed, forward_cost=forward_cost,
                                     backward_cost=backward_cost)

    # -- training -----------------------------------------------------------
    def train_step(self, x: Any, y: Any) -> Optional[float]:
        """One forward and backward of the whole batch; the mean micro-batch loss on the last stage's rank, else None.

        Gradients add into the Parameters, as in one process (zero them before a step that should not accumulate;
        a Parameter tied across ranks adds this step's sum once). ``x`` is read on rank 0, ``y`` on the last.

        Raises:
            ConfigurationError: no ``loss_fn`` was given.
            ShapeError: the batch size is not a multiple of ``num_microbatches`` on this rank (the other ranks
                raise ``CollectiveRefusedError`` naming it: [Note: a refused batch]), or a stage's output is not
                one array that messages carry (dtype, at most 16 dimensions).
            Exception: what a stage's forward or backward raised on this rank; the other ranks raise
                ``CollectiveRefusedError`` naming it, after the step's messages ([Note: a stage that fails]).
        """
        if self.loss_fn is None:
            raise ConfigurationError("Pipeline.train_step needs a loss_fn (pass loss_fn= to from_modules)")
        st = _StepState(None, None, time.perf_counter())
        st.xs = self._batch(x, "x", self.rank == 0, st)
        st.ys = self._batch(y, "y", self.is_last, st)
        st.failed = self.rank == 0 and st.xs is None  # [Note: a refused batch]
        self._tied.set_aside()  # only this step's part of a tied gradient is summed over its owners
        try:
            for step in self._steps:
                self._run_step(step, st)
            for work, _ in st.pending:
                work.wait()
            replicas = None if self._replicas is None else self._replicas.group
            vote(self.group, st.problem, batch_refused(self.group, "Pipeline.train_step"), wider=replicas,
                 elsewhere="Pipeline.train_step: the loss of another data-parallel replica refused its batch")
        except BaseException:
            self._tied.put_back()
            raise
        loss = sum(st.losses) / self.num_microbatches if self.is_last else None
        self._tied.sum_gradients()  # a Parameter stages on other ranks share: its whole gradient everywhere
        dp_sync_time = 0.0
        if self._replicas is not None:  # average the stages' gradients and the loss over dp_group
            loss, dp_sync_time = self._replicas.average(self.parameters, loss, self.is_last, self.rank)
        self.last_step_stats = {
            "peak_activations": st.peak,
            "peak_activation_bytes": st.peak_bytes,
            "timeline": st.timeline,
            "messages_sent": len(st.pending),
            "dp_sync_time": dp_sync_time,
            "step_time": time.perf_counter() - st.start,
        }
        return loss

    def _run_step(self, step: Step, st: "_StepState") -> None:
        """Interpret one lowered action: its receives, then its timed and traced work."""
        # An action starts once its input has arrived: the wait for it is idle time (the bubble),
        # not part of the action.
        for op in step.waits:
            self._run_op(op, st)
        start = time.perf_counter() - st.start
        for op in step.work:
            self._run_op(op, st)
        end = time.perf_counter() - st.start
        if st.failed:  # nothing (or not all of it) was computed
            return
        st.timeline.append((step.action, start, end))
        recorder = tracing.active()
        if recorder is not None:
            s, i = step.action.stage, step.action.microbatch
            kind = "forward" if step.action.kind == FORWARD else "backward"
            recorder.add(f"{kind} stage {s} mb {i}", "compute", st.start + start, st.start + end,
                         stage=s, microbatch=i)

    def _run_op(self, op: Op, st: "_StepState") -> None:
        """Run one op, or, once this rank failed or heard a refusal, what it owes in its place; an op that raises
        makes this rank fail ([Note: a stage that fails])."""
        if not st.failed:
            try:
                self._OPS[op.kind](self, op, st)
                return
            except Exception as exc:
                if op.kind in (RECV_F, RECV_B) or isinstance(exc, GROUP_FAILURES):
                    raise  # a message that did not arrive: the transport's own error, not this rank's to pass on
                st.fail(exc)
        self._PLACEHOLDERS[op.kind](self, op, st)

    # The ops of a lowered schedule (see lowering.py). Every hand-over, received or computed on this
    # rank, goes through ``st.handover`` under (receiving stage, micro-batch, message kind).
    def _op_recv_f(self, op: Op, st: "_StepState") -> None:
        got = self._transport.receive_activation(op.stage, op.microbatch, st.shapes, st.handover, ACT, HDR)
        if got is None:  # the stage before has no output: [Note: a refused header]
            st.failed = True
        else:
            st.handover[(op.stage, op.microbatch, ACT)] = got

    def _op_forward(self, op: Op, st: "_StepState") -> None:
        s, i = op.stage, op.microbatch
        module = self.stage_modules[s]
        out = _one_array(module(st.xs[i] if s == 0 else st.handover.pop((s, i, ACT))), s)
        seed = None
        if s == self.num_stages - 1:
            loss = None
            if st.ys is not None:  # else the targets were refused (st.problem): [Note: a refused batch]
                try:
                    loss = self.loss_fn(out, st.ys[i])
                except AxonError as exc:  # voted on at the step's end: [Note: a batch refused on one rank]
                    st.problem = st.problem or exc
            if loss is None:
                seed = array_module(out).zeros_like(out)
            else:
                st.losses.append(float(loss))
                seed = self.loss_fn.backward(1.0 / self.num_microbatches)
        else:
            st.handover[(s + 1, i, ACT)] = out
        # Only the output's description is kept: the gradient for it is received into a
        # fresh buffer, and holding the output itself would double the memory per stash.
        st.stash_bytes[(s, i)] = cached_nbytes(module)
        st.held_bytes += st.stash_bytes[(s, i)]
        st.stash[(s, i)] = (module.stash_activations(), (array_module(out), out.shape, out.dtype), seed)
        st.peak = max(st.peak, len(st.stash))
        st.peak_bytes = max(st.peak_bytes, st.held_bytes)

    def _op_send_f(self, op: Op, st: "_StepState") -> None:
        out = st.handover.pop((op.stage + 1, op.microbatch, ACT))
        self._transport.send_activation(out, op.stage, op.microbatch, st.sent, st.pending, st.handover, ACT, HDR)

    def _op_recv_b(self, op: Op, st: "_StepState") -> None:
        _, out_meta, _ = self._stashed(op, st)
        st.handover[(op.stage, op.microbatch, GRAD)] = self._transport.receive_gradient(op.stage, op.microbatch,
                                                                                         out_meta)

    def _op_backward(self, op: Op, st: "_StepState") -> None:
        s, i = op.stage, op.microbatch
        caches, _, seed = self._stashed(op, st)
        del st.stash[(s, i)]
        st.held_bytes -= st.stash_bytes.pop((s, i))
        grad = seed if seed is not None else st.handover.pop((s, i, GRAD))
        module = self.stage_modules[s]
        module.restore_activations(caches)
        grad_in = call_backward(module.backward, grad, input_grad=s > 0)  # nothing before stage 0 reads it
        if s > 0:
            st.handover[(s - 1, i, GRAD)] = grad_in

    def _op_send_b(self, op: Op, st: "_StepState") -> None:
        s, i = op.stage, op.microbatch
        grad_in = st.handover.pop((s - 1, i, GRAD))
        if s in st.shapes:  # the receiver allocates its output's dtype; match it exactly
            grad_in = grad_in.astype(st.shapes[s][0], copy=False)
        self._transport.send(grad_in, s - 1, i, GRAD, st.pending, st.handover)

    _OPS = {RECV_F: _op_recv_f, FORWARD: _op_forward, SEND_F: _op_send_f,
            RECV_B: _op_recv_b, BACKWARD: _op_backward, SEND_B: _op_send_b}

    # In place of each op once this rank has failed: only the messages it owes ([Note: a stage that fails]).
    def _placeholder_recv_f(self, op: Op, st: "_StepState") -> None:
        self._transport.receive_activation(op.stage, op.microbatch, st.shapes, st.handover, ACT, HDR)

    def _placeholder_send_f(self, op: Op, st: "_StepState") -> None:
        self._transport.send_placeholder(op.stage, op.microbatch, st.sent, st.pending, st.handover, ACT, HDR)

    def _placeholder_recv_b(self, op: Op, st: "_StepState") -> None:
        self._transport.drain_gradient(op.stage, op.microbatch, st.sent)

    def _placeholder_send_b(self, op: Op, st: "_StepState") -> None:
        self._transport.send_zero_gradient(op.stage, op.microbatch, st.shapes, st.pending, st.handover)

    def _compute_nothing(self, op: Op, st: "_StepState") -> None:
        pass

    _PLACEHOLDERS = {RECV_F: _placeholder_recv_f, FORWARD: _compute_nothing, SEND_F: _placeholder_send_f,
                     RECV_B: _placeholder_recv_b, BACKWARD: _compute_nothing, SEND_B: _placeholder_send_b}

    def _stashed(self, op: Op, st: "_StepState") -> Tuple[Any, Tuple[Any, Any, Any], Any]:
        """The stash of (stage, micro-batch) that a backward needs, or UsageError if its forward has not run."""
        key = (op.stage, op.microbatch)
        if key not in st.stash:
            raise UsageError(f"schedule runs {Action(op.stage, BACKWARD, op.microbatch)} before its forward "
                             f"on rank {self.rank}")
        return st.stash[key]

    def forward(self, x: Any) -> Any:
        """Inference through the stages, keeping no caches; the whole output on the last stage's rank, None elsewhere.

        Collective over the pipeline's group: it ends with a vote (one 8-byte all-reduce), so that a stage that
        fails raises on every rank ([Note: a stage that fails]). ``x`` is read on rank 0 only, and not looked at
        elsewhere.

        Raises:
            ShapeError: on rank 0, ``x`` has no batch axis or one ``num_microbatches`` does not divide, or, on
                the failing rank, a stage's output is not one array that messages carry; the other
                ranks raise ``CollectiveRefusedError`` naming it ([Note: a refused batch]).
            Exception: what a stage's forward raised on this rank (the others: ``CollectiveRefusedError``).
        """
        st = _StepState(None, None, time.perf_counter())
        st.xs = self._batch(x if self.rank == 0 else None, "x", self.rank == 0, st)
        st.failed = self.rank == 0 and st.xs is None  # [Note: a refused batch]
        outputs: List[Any] = []
        # Every rank walks (micro-batch, stage) in increasing order; an input only ever comes
        # from an earlier pair, so with non-blocking sends this order cannot deadlock.
        for i in range(self.num_microbatches):
            for s in self.stages:
                self._evaluate(s, i, st, outputs)
        for work, _ in st.pending:
            work.wait()
        vote(self.group, st.problem, batch_refused(self.group, "Pipeline.forward"))
        if not self.is_last:
            return None
        return array_module(outputs[0]).concatenate(outputs, axis=0)

    def _evaluate(self, s: int, i: int, st: "_StepState", outputs: List[Any]) -> None:
        """``forward``'s stage ``s`` on micro-batch ``i``: receive, compute, send (or, failed, what it owes)."""
        inp = None
        if s > 0:  # taken even when failed, so that nothing is left on the wire
            inp = self._transport.receive_activation(s, i, st.shapes, st.handover, EVAL_ACT, EVAL_HDR)
            if inp is None:  # the stage before has no output: [Note: a refused header]
                st.failed = True
        if not st.failed:
            module = self.stage_modules[s]
            try:
                out = _one_array(module(st.xs[i] if s == 0 else inp), s)
                module.stash_activations()  # drop the cache: no backward follows
                if s == self.num_stages - 1:
                    outputs.append(out)
                else:
                    self._transport.send_activation(out, s, i, st.sent, st.pending, st.handover, EVAL_ACT, EVAL_HDR)
                return
            except Exception as exc:
                if isinstance(exc, GROUP_FAILURES):
                    raise
                module.stash_activations()
                st.fail(exc)
        if s < self.num_stages - 1:
            self._transport.send_placeholder(s, i, st.sent, st.pending, st.handover, EVAL_ACT, EVAL_HDR)

    # -- batches ------------------------------------------------------------
    def _batch(self, a: Any, name: str, read_here: bool, st: "_StepState") -> Optional[List[Any]]:
        """``a``'s micro-batches where this rank reads it (``read_here``) or was given an array; None if not, or if
        it is refused, the error then in ``st.problem`` (see [Note: a refused batch])."""
        if not (read_here or hasattr(a, "shape")):
            return None
        try:
            return self._split(a, name)
        except AxonError as exc:
            st.problem = st.problem or exc
            return None

    def _split(self, a: Any, name: str) -> List[Any]:
        m = self.num_microbatches
        if a is None or not hasattr(a, "shape") or len(a.shape) == 0:
            raise ShapeError(f"Pipeline: rank {self.rank} needs {name} as an array with a batch axis, "
                             f"got {type(a).__name__}")
        n = a.shape[0]
        if n % m:
            raise ShapeError(f"Pipeline: the batch size of {name} ({n}) is not a multiple of "
                             f"num_microbatches={m}")
        b = n // m
        return [a[k * b:(k + 1) * b] for k in range(m)]



@dataclass
class _StepState:
    """What one ``train_step`` (or ``forward``) carries from op to op."""

    xs: Optional[List[Any]]  # the micro-batches (rank 0), or None
    ys: Optional[List[Any]]  # the targets' micro-batches (last stage), or None
    start: float  # time.perf_counter() when the step began
    # (receiving stage, mb, message kind) -> array: inputs received or computed on this rank, and
    # outputs waiting for their send
    handover: Dict[Tuple[int, int, int], Any] = field(default_factory=dict)
    # (stage, mb) -> (module caches, (array module, shape, dtype) of the output, loss grad or None)
    stash: Dict[Tuple[int, int], Any] = field(default_factory=dict)
    stash_bytes: Dict[Tuple[int, int], int] = field(default_factory=dict)
    shapes: Dict[int, Tuple[Any, Tuple[int, ...], Any]] = field(default_factory=dict)  # stage -> its input's
    pending: List[Tuple[Any, Any]] = field(default_factory=list)  # (Work, buffer): the buffer lives until the wait
    losses: List[float] = field(default_factory=list)
    problem: Optional[BaseException] = None  # a refused batch or micro-batch, or a failed op: voted on at the end
    # this rank failed or heard a refusal: it computes nothing more this step ([Note: a stage that fails])
    failed: bool = False
    # stage -> (array module, shape, dtype) its output's header described, or None where it sent a refusal
    sent: Dict[int, Any] = field(default_factory=dict)
    timeline: List[Tuple[Action, float, float]] = field(default_factory=list)
    peak: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0

    def fail(self, exc: BaseException) -> None:
        """This rank's op raised ``exc``: keep the step's first problem, compute nothing more."""
        self.problem = self.problem or exc
        self.failed = True


def _one_array(out: Any, stage: int) -> Any:
    """``out``, or ShapeError if it is not one array: what a stage's output must be, to be sent or stashed."""
    if not all(hasattr(out, name) for name in ("shape", "dtype", "ndim")):
        raise ShapeError(f"Pipeline: a stage's output must be one array (numpy or cupy), but stage {stage} "
                         f"returned a {type(out).__name__}; return a single array from every stage's forward")
    return out


__all__ = ["Pipeline", "PipelineStage"]
