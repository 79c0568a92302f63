"""Preemption: a signal asks the run to stop; every rank stops after the same step.

[Note: stopping together]
SLURM sends SIGTERM when it preempts or cancels a job, and the signal the
batch script asks for (``sbatch --signal=B:USR1@120``) some time before the
limit; either may reach only some ranks, and at different moments. The
handler only sets a flag. After every optimizer step the ranks all-reduce
their flags (MAX), so they all see the request after the same step, write
one checkpoint together and leave with ``PREEMPTED_EXIT_CODE`` (75, "try
again later" in sysexits.h), which a requeued job's next run answers by
resuming from that checkpoint. Signals reach only a process's main thread,
so thread-rank runs (``run_local``) call ``request()`` instead.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Dict, Optional, Sequence

import numpy as np

from ..backends import ReduceOp
from ..collectives import all_reduce

PREEMPTED_EXIT_CODE = 75
SIGNALS = ("SIGTERM", "SIGUSR1")


class PreemptedExit(SystemExit):
    """``SystemExit(75)``, raised by every rank together after the preemption checkpoint.

    ``every_rank`` tells ``axonhpc/launched.py`` that no rank is left waiting for this one, so the job ends as
    usual instead of being aborted ([Note: a rank that exits with an error]): under ``srun`` an abort would
    replace the 75, which a requeue rule such as ``RequeueExit=75`` looks for, with the step's 137.
    """

    every_rank = True

    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


class Preemption:
    """A stop request from a signal or from code, agreed on by every rank of a group.

    Args:
        group: the ranks that stop together.
        signals: names of the signals that request a stop (installed only
            in the main thread; the previous handlers come back on ``close``).
    """

    def __init__(self, group: Any, signals: Sequence[str] = SIGNALS):
        self.group = group
        self.requested = False
        self.signal_name: Optional[str] = None
        self._previous: Dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for name in signals:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(number).name
        previous = self._previous.get(number)
        if callable(previous):  # e.g. the flight recorder's dump on SIGUSR1
            previous(number, frame)

    def request(self) -> None:
        """Ask for a stop after the current step (what the signal handler does)."""
        self.requested = True

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank has a stop request."""
        flag = np.array([1.0 if self.requested else 0.0])
        all_reduce(flag, ReduceOp.MAX, self.group)
        return bool(flag[0])

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


__all__ = ["Preemption", "PreemptedExit", "PREEMPTED_EXIT_CODE", "SIGNALS"]
