"""A GPT over a dp x tp x pp mesh: tensor-parallel blocks, pipeline stages, data-parallel replicas.

[Note: the layout]
pp: P contiguous stages (``stage_blocks``), embeddings on the first, head on the last. tp: every block is a
``TensorParallelBlock``; embeddings, LayerNorms and head are replicated, and since their inputs and output
gradients are identical on the tp ranks so are their gradients: nothing reduces them. dp: with P = 1, DDP (or
FSDP) over ``mesh.dp``; with P > 1 the ``Pipeline`` averages stage gradients over ``mesh.dp`` after the step.

Every part uses the seed derivation of the whole ``nn.GPT``, so the union of the ranks' parameters is
exactly ``nn.GPT(seed=seed)``, under the whole model's names. Dropout masks are keyed by ``step`` and each
sample's global index, so tp ranks draw the same masks, parity with ``nn.GPT`` holds with dropout, and a run
resumed at step s draws what the uninterrupted run draws.

[Note: the loss of a step]
Each replica's gradient is that of its share's mean loss, and the shares are equal in size, so the dp average
is the gradient of the global mean: every layout computes one process's loss and gradients, up to the order
of floating-point sums.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends import ReduceOp
from ..collectives import all_reduce, broadcast
from ..errors import ConfigurationError, ShapeError
from ..groups import resolve_group
from ..nn import (GELU, CrossEntropyLoss, cached_nbytes, Dropout, LayerNorm, Module, Sequential, checkpoint,
                  key_dropout_by_sample)
from ..nn import initializers
from ..nn.transformer import GPT, TransformerBlock
from .ddp import DDP
from .fsdp import FSDP
from .pipeline import Pipeline, PipelineSchedule, PipelineStage
from .boxes import dense_names, fsdp_boxes, parameter_boxes, replicated_boxes
from .same_model import agreed
from .tensor import ColumnParallelLinear, RowParallelLinear, TensorParallelAttention, partition_range
from .tensor.partition import same_geometry


class TensorParallelBlock(TransformerBlock):
    """``nn.TransformerBlock`` with its attention heads and MLP hidden features split over a tensor-parallel group.

    Names and initial values are those of ``TransformerBlock(...)`` with the same seed (each rank holding its
    slice); ``seed`` may not be None.

    Raises:
        ConfigurationError: a size the group does not divide, a non-positive size, or seed None.
        ModelMismatchError: the ranks of the group build different blocks (on every rank).
    """

    def __init__(self, width: int, heads: int, group: Any = None, mlp_ratio: int = 4, dropout: float = 0.0,
                 causal: bool = True, dtype: Any = np.float32, seed: initializers.SeedLike = None) -> None:
        Module.__init__(self)
        pg = resolve_group(group).require_member("TensorParallelBlock")
        # One exchange for the whole block, before any other message.
        with same_geometry(pg, "TensorParallelBlock", width=width, heads=heads, mlp_ratio=mlp_ratio,
                           dropout=float(dropout), causal=bool(causal), dtype=dtype):
            if width <= 0 or heads <= 0 or mlp_ratio <= 0 or width % heads:
                raise ConfigurationError(f"TensorParallelBlock needs positive width, heads and mlp_ratio with heads "
                                         f"dividing width; got width={width}, heads={heads}, mlp_ratio={mlp_ratio}")
            if seed is None:
                raise ConfigurationError("TensorParallelBlock needs a seed, the same on every rank of the group")
            partition_range(int(heads), pg.rank, pg.size, "TensorParallelBlock heads")
            partition_range(int(mlp_ratio * width), pg.rank, pg.size, "TensorParallelBlock mlp_ratio * width")
        self.width = int(width)
        self.heads = int(heads)
        self.mlp_ratio = int(mlp_ratio)
        seeds = initializers.child_seeds(seed, 5)  # as TransformerBlock
        hidden = self.mlp_ratio * self.width
        with agreed():
            self.ln1 = LayerNorm(width, dtype=dtype)
            self.attn = TensorParallelAttention(width, heads, group=pg, causal=causal, dtype=dtype, seed=seeds[0])
            self.attn_dropout = Dropout(dropout, seed=seeds[1])
            self.ln2 = LayerNorm(width, dtype=dtype)
            self.mlp = Sequential(
                ColumnParallelLinear(width, hidden, group=pg, gather_output=False, dtype=dtype, seed=seeds[2]), GELU(),
                RowParallelLinear(hidden, width, group=pg, input_is_parallel=True, dtype=dtype, seed=seeds[3]),
                Dropout(dropout, seed=seeds[4]))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_size={self.attn.group.size}"


def stage_blocks(layers: int, num_stages: int) -> List[Tuple[int, int]]:
    """Each stage's blocks ``[start, stop)``, contiguous, as even as can be (ConfigurationError if impossible)."""
    if num_stages < 1 or layers < num_stages:
        raise ConfigurationError(f"a GPT of {layers} blocks cannot be split into {num_stages} pipeline stages of at "
                                 f"least one block each")
    return [(s * layers // num_stages, (s + 1) * layers // num_stages) for s in range(num_stages)]


def gpt_part(vocab_size: int, context: int, width: int, heads: int, layers: int, *, stage: int = 0,
             num_stages: int = 1, tp_group: Any = None, dropout: float = 0.0, tie_weights: bool = False,
             mlp_ratio: int = 4, dtype: Any = np.float32, seed: initializers.SeedLike = None,
             checkpoint_blocks: bool = False) -> GPT:
    """Stage ``stage`` of ``num_stages`` of ``nn.GPT(..., seed=seed)`` (whole-model arguments and names), tp over ``tp_group``."""
    if seed is None:
        raise ConfigurationError("a parallel GPT needs a seed, the same on every rank, so that its parts make one model")
    if not 0 <= stage < num_stages:
        raise ConfigurationError(f"stage {stage} is not one of the {num_stages} stages")
    tp = resolve_group(tp_group) if tp_group is not None else None

    def make_block(index: int, block_seed: Any) -> Module:
        if tp is None or tp.size == 1:
            block: Module = TransformerBlock(width, heads, mlp_ratio=mlp_ratio, dropout=dropout, causal=True,
                                             dtype=dtype, seed=block_seed)
        else:
            block = TensorParallelBlock(width, heads, group=tp, mlp_ratio=mlp_ratio, dropout=dropout, causal=True,
                                        dtype=dtype, seed=block_seed)
        return checkpoint(block) if checkpoint_blocks else block

    return GPT(vocab_size, context, width, heads, layers, dropout=dropout, tie_weights=tie_weights,
               mlp_ratio=mlp_ratio, dtype=dtype, seed=seed, block_range=stage_blocks(layers, num_stages)[stage],
               with_embedding=stage == 0, with_head=stage == num_stages - 1, make_block=make_block)


class ParallelGPT:
    """One ``nn.GPT`` trained over a dp x tp x pp mesh (see the module notes).

    Args:
        mesh: ``world.mesh(dp=D, tp=T, pp=P)``.
        vocab_size, context, width, heads, layers, dropout, tie_weights, mlp_ratio, dtype, seed:
            the whole model, as ``nn.GPT`` (seed required, the same on every rank).
        fsdp: shard the replicas over ``mesh.dp`` (one unit per block); only with P = 1.
        num_microbatches: micro-batches per step (with P = 1, gradient accumulation).
        stages_per_rank: model chunks per pipeline rank (v > 1 needs the interleaved schedule).

    Attributes:
        module: this rank's stage, or with v > 1 its first chunk.
        parts: this rank's stages, in stage order.
        stage_indices: their indices among the P * v stages.
        step: the training steps taken; a resumed run sets ``step = s``.

    Raises:
        ConfigurationError: seed None, a size the mesh does not divide, too few blocks for the stages,
            ``fsdp`` with P > 1 (and the wrappers' own checks).
    """

    def __init__(self, mesh: Any, vocab_size: int, context: int, width: int, heads: int, layers: int, *,
                 dropout: float = 0.0, tie_weights: bool = False, mlp_ratio: int = 4, dtype: Any = np.float32,
                 seed: initializers.SeedLike = None, fsdp: bool = False, num_microbatches: int = 1,
                 schedule: Any = PipelineSchedule.ONE_F_ONE_B, stages_per_rank: int = 1,
                 checkpoint_activations: bool = False, device: Optional[str] = None) -> None:
        self.mesh = mesh
        self.world = resolve_group(None)
        self.dp, self.tp, self.pp = mesh.dp, mesh.tp, mesh.pp
        num_stages = self.pp.size * stages_per_rank
        if fsdp and num_stages > 1:
            raise ConfigurationError(f"ParallelGPT: fsdp=True inside pipeline stages (pp={self.pp.size}, "
                                     f"stages_per_rank={stages_per_rank}) is not supported; the pipeline averages "
                                     "its stages' gradients over dp itself, use fsdp with pp=1")
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise ConfigurationError(f"ParallelGPT num_microbatches must be a positive int, got {num_microbatches!r}")
        self.num_microbatches = num_microbatches
        self.step = 0
        self.fsdp = bool(fsdp)
        self.stage_indices = list(range(self.pp.rank, num_stages, self.pp.size))
        self.parts = [gpt_part(vocab_size, context, width, heads, layers, stage=s, num_stages=num_stages,
                               tp_group=self.tp, dropout=dropout, tie_weights=tie_weights, mlp_ratio=mlp_ratio,
                               dtype=dtype, seed=seed, checkpoint_blocks=checkpoint_activations)
                      for s in self.stage_indices]
        if device not in (None, "cpu"):
            for part in self.parts:
                part.to(device)  # before any wrapper sees the parameters
        self.module = self.parts[0]
        self.loss_fn = CrossEntropyLoss()
        self.pipeline: Optional[Pipeline] = None
        self._peak_bytes = 0
        self.engine: Any = None
        if num_stages > 1:
            stages = [PipelineStage(part, s, num_stages) for part, s in zip(self.parts, self.stage_indices)]
            self.pipeline = Pipeline.from_stages(stages, group=self.pp, num_microbatches=num_microbatches,
                                                 schedule=schedule, loss_fn=self.loss_fn, dp_group=self.dp)
        elif self.fsdp:
            self.engine = FSDP(self.module, group=self.dp, units=list(self.module.blocks))
        else:
            self.engine = DDP(self.module, group=self.dp)
        # The world rank that holds the global loss after a pipeline step: last stage, dp 0, tp 0.
        last = self.pp.size - 1
        self._loss_root = (last * self.dp.size + 0) * self.tp.size + 0

    # -- what the optimizer and checkpoints see -------------------------------------------------
    def parameters(self) -> List[Any]:
        """The Parameters this rank's optimizer updates (FSDP: this rank's flat shards)."""
        if self.engine is not None:
            return self.engine.parameters()
        return [p for part in self.parts for p in part.parameters()]

    def named_parameters(self) -> List[Tuple[str, Any]]:
        """``(whole-model name, Parameter)`` of every parameter of this rank's stages (not FSDP's shards)."""
        out = []
        for part in self.parts:
            names = dense_names(part)
            out += [(names[n], p) for n, p in part.named_parameters()]
        return out

    def parameter_boxes(self, shard_rank: Optional[int] = None, shards: Optional[Sequence[Any]] = None
                        ) -> Dict[str, Tuple[Any, ...]]:
        """Whole-model name -> where the values this rank's optimizer updates lie (``checkpoint.model_slices``).

        ``shard_rank`` and ``shards`` (FSDP only) describe dp rank ``shard_rank``'s shards, held in ``shards``, instead.
        """
        if self.fsdp:
            return fsdp_boxes(self.module, self.engine.units, shard_rank, shards)
        out: Dict[str, Tuple[Any, ...]] = {}
        for part in self.parts:
            out.update(replicated_boxes(part))
        return out

    # -- steps ------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "ParallelGPT":
        """Training mode (dropout on) for every stage of this rank, or eval mode with ``mode=False``; returns self."""
        for part in self.parts:
            part.train(mode)
        return self

    def eval(self) -> "ParallelGPT":
        """Eval mode (dropout off); returns self."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Drop every gradient of this rank's stages (before each step)."""
        if self.engine is not None:
            self.engine.zero_grad()
        for part in self.parts:
            part.zero_grad(set_to_none=True)

    def _split(self, a: Any, name: str) -> List[Any]:
        m = self.num_microbatches
        if a.shape[0] % m:
            raise ShapeError(f"ParallelGPT: the local batch of {name} ({a.shape[0]} rows) is not a multiple of "
                             f"num_microbatches={m}")
        b = a.shape[0] // m
        return [a[k * b:(k + 1) * b] for k in range(m)]

    def train_step(self, x: Any, y: Any) -> float:
        """Forward and backward of this dp rank's share of ``(x, y)``; returns the global batch's mean loss on every rank.

        ShapeError if the batch is not a multiple of ``num_microbatches``.
        """
        for part in self.parts:  # the masks of this step's samples (see the module notes)
            key_dropout_by_sample(part, self.step, self.dp.rank * int(x.shape[0]))
        self.step += 1
        if self.pipeline is not None:
            loss = self.pipeline.train_step(x, y)
            return self._from_last_stage(loss)
        xs, ys = self._split(x, "x"), self._split(y, "y")
        m = len(xs)
        total, peak = 0.0, 0
        for k in range(m):
            with self.engine.no_sync() if k < m - 1 else contextlib.nullcontext():
                logits = self.engine(xs[k])
                total += self.loss_fn(logits, ys[k])
                peak = max(peak, cached_nbytes(self.module))
                self.engine.backward(self.loss_fn.backward(1.0 / m))
        self._peak_bytes = peak
        return self._dp_mean(total / m)

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes of forward caches this rank held at once in the last step (parameters and gradients not counted)."""
        if self.pipeline is not None:
            return int(self.pipeline.last_step_stats.get("peak_activation_bytes", 0))
        return self._peak_bytes

    def loss(self, x: Any, y: Any) -> float:
        """The mean loss over every dp rank's share (``x, y`` as ``train_step``), on every rank; no gradients."""
        if self.pipeline is not None:
            logits = self.pipeline.forward(x)
            loss = float(self.loss_fn(logits, y)) if logits is not None else None
            if loss is not None:
                self.loss_fn._pop_cache()
                loss = self._dp_mean(loss)
            return self._from_last_stage(loss)
        total = 0.0
        for xk, yk in zip(self._split(x, "x"), self._split(y, "y")):
            total += self.loss_fn(self.engine(xk), yk)
            self.loss_fn._pop_cache()
            for part in self.parts:
                part.stash_activations()  # no backward follows: drop the caches
        return self._dp_mean(total / self.num_microbatches)

    def _dp_mean(self, value: float) -> float:
        if self.dp.size == 1:
            return value
        box = np.array([value], dtype=np.float64)
        all_reduce(box, ReduceOp.AVG, self.dp)
        return float(box[0])

    def _from_last_stage(self, value: Optional[float]) -> float:
        """The last stage's global loss on every rank (one 8-byte broadcast over the world)."""
        box = np.array([0.0 if value is None else value], dtype=np.float64)
        broadcast(box, src=self._loss_root, group=self.world)
        return float(box[0])


__all__ = ["ParallelGPT", "TensorParallelBlock", "dense_names", "gpt_part", "parameter_boxes", "stage_blocks"]
