"""The parameter server's messages: tags, request kinds, reply statuses, the header (see the package notes)."""
from __future__ import annotations

import enum

import numpy as np

NAME = "ParameterServer"


class Mode(enum.Enum):
    """sync: every worker's gradient of a step is applied together; async: each as it arrives."""

    SYNC = "sync"
    ASYNC = "async"


MODES = tuple(m.value for m in Mode)

TAG_REQUEST, TAG_GRAD, TAG_REASON, TAG_REPLY, TAG_PARAMS, TAG_FINAL, TAG_VERDICT = 1, 2, 3, 4, 5, 6, 7
PUSH, PULL, DONE, FAILED = 1, 2, 3, 4  # request kinds
OK, ABORT = 0, 1  # reply statuses (and the servers' verdicts at the end)
# A reply header's flag: CLOSED marks an ABORT after which this server answers that worker nothing more (it gave
# the worker up, or it is leaving: its last word), so the worker sends it nothing more; BARE marks an OK without
# parameters (the answer to a DONE that wants none).
CLOSED, BARE = 1, 2
HEADER = 4  # int64 words of a request header (kind, version, reason bytes, flag) or reply (status, version,
# reason bytes, CLOSED or BARE)
REASON_BYTES = 2000  # a failure's text is cut to this many bytes
POLL_MIN, POLL_MAX = 1e-5, 1e-3  # seconds a server sleeps between idle sweeps


def encode_reason(text: str) -> np.ndarray:
    """A failure's text as the uint8 message that carries it (UTF-8, cut to ``REASON_BYTES``)."""
    return np.frombuffer(text.encode("utf-8", "replace")[:REASON_BYTES], dtype=np.uint8).copy()
