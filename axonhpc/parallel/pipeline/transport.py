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
A header may say "refused" instead (ndim -1): the sending stage has no output this step (rank 0 refused
its batch, or the stage or one before it failed: [Note: a stage that fails] in ``executor``). That stage
boundary then carries nothing else this step, neither activations nor gradients back, and its receiver,
having nothing to compute, passes the refusal on. A stage whose header had already gone out when it
failed sends zeros of that header's shape instead (``send_placeholder``), and the rank above it sends
zeros back for gradients (``send_zero_gradient``): every message the schedule names is sent and received
either way, so none is left on the wire to pair with the next step's (the tags repeat every step).
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
_REFUSED = -1  # a header's ndim when the sending stage has no output ([Note: a refused header])
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

    def send_activation(self, out: Any, stage: int, microbatch: int, sent: dict, pending: list, local: dict,
                        kind: int, header_kind: int) -> None:
        """Send stage ``stage``'s output to stage + 1, after a shape header with micro-batch 0's; ``sent`` keeps,
        per stage, the (array module, shape, dtype) its header described.

        ShapeError, before anything is sent, if ``out`` has a dtype or more dimensions than a header can describe,
        or another shape or dtype than the header said (which the receiver's buffer would not fit).
        """
        nxt = stage + 1
        if microbatch > 0 and sent.get(stage) is not None:
            _, shape, dtype = sent[stage]
            if tuple(out.shape) != shape or out.dtype != dtype:
                raise ShapeError(f"Pipeline: stage {stage} produced a {out.dtype} array of shape {tuple(out.shape)} "
                                 f"for micro-batch {microbatch}, but {dtype} of {shape} for micro-batch 0; every "
                                 f"micro-batch of a step must give the same")
        if microbatch == 0 and self.owner(nxt) != self.rank:
            dtypes = list(supported_dtypes())
            if out.dtype not in dtypes or out.ndim > _MAX_DIMS:
                raise ShapeError(f"Pipeline: stage {stage} produced a {out.dtype} array of {out.ndim} "
                                 f"dimensions; messages carry at most {_MAX_DIMS} dimensions of {dtypes}")
            header = np.zeros(_HEADER, dtype=np.int64)
            header[0], header[1], header[2] = dtypes.index(out.dtype), out.ndim, int(is_cupy_array(out))
            header[3:3 + out.ndim] = out.shape
            self.send(header, nxt, 0, header_kind, pending, local)
            sent[stage] = (array_module(out), tuple(out.shape), out.dtype)
        self.send(out, nxt, microbatch, kind, pending, local)

    def receive_activation(self, stage: int, microbatch: int, shapes: dict, local: dict,
                           kind: int, header_kind: int) -> Any:
        """Stage ``stage``'s input from stage - 1; ``shapes`` keeps, per stage, the header received this step.

        None if the header said the step was refused ([Note: a refused header]), or nothing was handed over
        locally (the stage before, on this rank, failed).
        """
        src = self.owner(stage - 1)
        if src == self.rank:
            return local.pop((stage, microbatch, kind), None)
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

    def send_placeholder(self, stage: int, microbatch: int, sent: dict, pending: list, local: dict,
                         kind: int, header_kind: int) -> None:
        """What stage ``stage`` sends in place of an output it does not have ([Note: a refused header]): a
        refused header if its own header has not gone out (``sent``), zeros of that header's shape if it has,
        nothing if it already refused."""
        nxt = stage + 1
        if self.owner(nxt) == self.rank:
            return
        if stage not in sent:
            header = np.zeros(_HEADER, dtype=np.int64)
            header[1] = _REFUSED
            self.send(header, nxt, 0, header_kind, pending, local)
            sent[stage] = None
        elif sent[stage] is not None:
            xp, shape, dtype = sent[stage]
            self.send(xp.zeros(shape, dtype=dtype), nxt, microbatch, kind, pending, local)

    def send_zero_gradient(self, stage: int, microbatch: int, shapes: dict, pending: list, local: dict) -> None:
        """Zeros in place of the gradient for stage ``stage``'s input, unless that input was refused."""
        if self.owner(stage - 1) == self.rank or shapes.get(stage) is None:
            return
        dtype, shape, xp = shapes[stage]
        self.send(xp.zeros(shape, dtype=dtype), stage - 1, microbatch, GRAD, pending, local)

    def drain_gradient(self, stage: int, microbatch: int, sent: dict) -> None:
        """Take (and drop) the gradient for stage ``stage``'s output, unless that output was refused."""
        if sent.get(stage) is not None:
            self.receive_gradient(stage, microbatch, sent[stage])

    def receive_gradient(self, stage: int, microbatch: int, out_meta: Tuple[Any, Any, Any]) -> Any:
        """The gradient for stage ``stage``'s output, from stage + 1; ``out_meta`` is that output's (xp, shape, dtype)."""
        # The gradient for stage's output has that output's shape and dtype: no header needed.
        xp, shape, dtype = out_meta
        buf = xp.empty(shape, dtype=dtype)
        return recv(buf, self.owner(stage + 1), tag=self._tag(microbatch, stage, GRAD), group=self.group)


__all__ = ["Transport", "message_tag", "ACT", "GRAD", "HDR", "EVAL_ACT", "EVAL_HDR", "NUM_KINDS"]
