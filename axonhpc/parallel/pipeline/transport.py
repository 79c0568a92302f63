"""The pipeline's point-to-point transport: activations and gradients between stages, with tags and shape headers.

[Note: messages, tags and deadlock freedom]
Sends are non-blocking and waited at the end of the step, so a rank only ever blocks in a receive. Every
schedule ``pipeline_schedule`` produces is deadlock-free under exactly this model (``simulate_pipeline``
checks it), so the executor cannot deadlock either. Each tag encodes (micro-batch, stage, kind) uniquely within
a step, so a receive never matches another message whatever the delivery order; the largest tag must stay
within the group's ``collectives.p2p.largest_tag`` (on MPI ``(MPI_TAG_UB - 7) // 8``: 67,108,863 with the MPICH
wheel, but 4095 where MPI_TAG_UB is the standard's minimum, 32767, which limits ``num_microbatches * num_stages``
to 819 there).

[Note: shapes]
Only rank 0 sees the batch, so receivers do not know activation shapes. Once per step and stage boundary the
sender sends a small int64 header (dtype, ndim, device or host, dimensions) with micro-batch 0's activation;
all micro-batches of a step share the shape, and headers are not cached across steps, so the batch size may
change. Gradients need none: the output of stage s has the shape its receiver produced itself.

[Note: a refused header]
A header may say "refused" instead (ndim -1): rank 0 refused the step's batch before computing anything.
Every rank that hears it sends one in place of each header of its own (``pass_on_refusal``) and takes every
header still due to it, so the refusal reaches the last stage, every message sent is received, and nothing
but headers was sent (each rank hears it in its first receive, before it has computed anything).
"""
from __future__ import annotations

import importlib
from typing import Any, Tuple

import numpy as np

from ..._dtypes import array_module, is_cupy_array, supported_dtypes
from ...collectives import isend, recv
from ...errors import ShapeError

_MAX_DIMS = 16
_HEADER = 3 + _MAX_DIMS  # dtype index, ndim, on a device (0/1), dimensions
_REFUSED = -1  # a header's ndim when the step was refused ([Note: a refused header])
# Message kinds, the last component of a tag: a step's activations and gradients, the shape headers of its
# activations, and forward()'s (inference) activations and headers.
ACT, GRAD, HDR, EVAL_ACT, EVAL_HDR = range(5)
NUM_KINDS = 5


def message_tag(microbatch: int, stage: int, kind: int, num_stages: int) -> int:
    """The tag of a message: unique per (micro-batch, receiving stage, kind) within a step."""
    return (microbatch * num_stages + stage) * NUM_KINDS + kind


class Transport:
    """Messages between the stages of one pipeline, as seen from one rank (stage s on group rank s % size).

    Every method takes the receiving stage; ``local`` is the step's hand-over dictionary, keyed by (receiving
    stage, micro-batch, kind), for messages to a stage on this same rank, and ``pending`` the step's list of
    ``(Work, buffer)`` of sends in flight.
    """

    def __init__(self, group: Any, num_stages: int):
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.num_stages = num_stages

    def owner(self, stage: int) -> int:
        """The group rank that holds ``stage``."""
        return stage % self.size

    def _tag(self, microbatch: int, stage: int, kind: int) -> int:
        return message_tag(microbatch, stage, kind, self.num_stages)

    def send(self, array: Any, stage: int, microbatch: int, kind: int, pending: list, local: dict) -> None:
        """Send ``array`` to the rank of ``stage`` (the receiving stage), or hand it over locally."""
        dst = self.owner(stage)
        if dst == self.rank:
            local[(stage, microbatch, kind)] = array
            return
        buf = array_module(array).ascontiguousarray(array)
        pending.append((isend(buf, dst, tag=self._tag(microbatch, stage, kind), group=self.group), buf))

    def send_activation(self, out: Any, stage: int, microbatch: int, pending: list, local: dict,
                        kind: int, header_kind: int) -> None:
        """Send stage ``stage``'s output to stage + 1, after a shape header with micro-batch 0's.

        ShapeError if ``out`` has a dtype or more dimensions than a header can describe.
        """
        nxt = stage + 1
        if microbatch == 0 and self.owner(nxt) != self.rank:
            dtypes = list(supported_dtypes())
            if out.dtype not in dtypes or out.ndim > _MAX_DIMS:
                raise ShapeError(f"Pipeline: stage {stage} produced a {out.dtype} array of {out.ndim} "
                                 f"dimensions; messages carry at most {_MAX_DIMS} dimensions of {dtypes}")
            header = np.zeros(_HEADER, dtype=np.int64)
            header[0], header[1], header[2] = dtypes.index(out.dtype), out.ndim, int(is_cupy_array(out))
            header[3:3 + out.ndim] = out.shape
            self.send(header, nxt, 0, header_kind, pending, local)
        self.send(out, nxt, microbatch, kind, pending, local)

    def receive_activation(self, stage: int, microbatch: int, shapes: dict, local: dict,
                           kind: int, header_kind: int) -> Any:
        """Stage ``stage``'s input from stage - 1; ``shapes`` keeps, per stage, the header received this step.

        None if the header said the step was refused ([Note: a refused header]).
        """
        src = self.owner(stage - 1)
        if src == self.rank:
            return local.pop((stage, microbatch, kind))
        if stage not in shapes:
            # The header always travels with micro-batch 0, whichever micro-batch comes first here.
            self._receive_header(stage, shapes, header_kind)
        if shapes[stage] is None:
            return None
        dtype, shape, xp = shapes[stage]
        buf = xp.empty(shape, dtype=dtype)
        return recv(buf, src, tag=self._tag(microbatch, stage, kind), group=self.group)

    def _receive_header(self, stage: int, shapes: dict, header_kind: int) -> None:
        """Stage ``stage``'s input header into ``shapes[stage]``: (dtype, shape, array module), or None if refused."""
        header = np.empty(_HEADER, dtype=np.int64)
        recv(header, self.owner(stage - 1), tag=self._tag(0, stage, header_kind), group=self.group)
        ndim = int(header[1])
        if ndim == _REFUSED:
            shapes[stage] = None
            return
        # activations arrive where the sender computed them: host memory or the device
        xp = importlib.import_module("cupy") if header[2] else np
        shapes[stage] = (supported_dtypes()[int(header[0])], tuple(int(d) for d in header[3:3 + ndim]), xp)

    def pass_on_refusal(self, stages: Any, shapes: dict, sent: set, pending: list, local: dict,
                        header_kind: int) -> None:
        """The step was refused: a refused header wherever one of ``stages`` has not sent its own (``sent``),
        then every header still due to them (see [Note: a refused header])."""
        for s in stages:
            if s + 1 < self.num_stages and s not in sent and self.owner(s + 1) != self.rank:
                header = np.zeros(_HEADER, dtype=np.int64)
                header[1] = _REFUSED
                self.send(header, s + 1, 0, header_kind, pending, local)
        for s in stages:
            if s > 0 and s not in shapes and self.owner(s - 1) != self.rank:
                self._receive_header(s, shapes, header_kind)

    def receive_gradient(self, stage: int, microbatch: int, out_meta: Tuple[Any, Any, Any]) -> Any:
        """The gradient for stage ``stage``'s output, from stage + 1; ``out_meta`` is that output's (xp, shape, dtype)."""
        # The gradient for stage's output has that output's shape and dtype: no header needed.
        xp, shape, dtype = out_meta
        buf = xp.empty(shape, dtype=dtype)
        return recv(buf, self.owner(stage + 1), tag=self._tag(microbatch, stage, GRAD), group=self.group)


__all__ = ["Transport", "message_tag", "ACT", "GRAD", "HDR", "EVAL_ACT", "EVAL_HDR", "NUM_KINDS"]
