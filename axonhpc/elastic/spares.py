"""Spare ranks: started with the job, idle until a rank is lost, then one takes its place.

[Note: how a spare waits]
The working ranks and the spares share one communicator of the job (a
duplicate of the one the run shrinks), on which the spares wait in a
non-blocking barrier, looking every 10 ms whether it completed. The working
ranks enter it only at the end of the run (``ElasticTraining.close``): the
barrier completes and the spares leave. When a rank dies, the barrier can
never complete: a working rank that sees the failure revokes the
communicator, and ULFM fails the spares' barrier anyway, so every spare joins
the recovery (``MPI_Comm_shrink`` of the run's communicator) with the
working ranks. A spare that dies is seen by the other spares at once and by
the working ranks at the end of the run, whose barrier then fails: the
survivors shrink together once more, agree that the run is ending, and leave.
"""
from __future__ import annotations

import time
from typing import Any

from ..backends.failures import failure_classes, revoke

POLL = 0.01  # seconds between a spare's looks at its barrier


class Rendezvous:
    """The working ranks' and the spares' meeting point on ``comm`` (collective: a ``Dup`` of it)."""

    def __init__(self, MPI: Any, comm: Any):
        self._MPI = MPI
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)

    def wait(self) -> bool:
        """Block until the working ranks end the run (True) or a rank of the job failed (False)."""
        try:
            request = self.comm.Ibarrier()
            while not request.Test():
                time.sleep(POLL)
            return True
        except self._MPI.Exception as exc:
            if exc.Get_error_class() not in failure_classes(self._MPI):
                raise
            return False

    def revoke(self) -> None:
        """Wake the spares' wait: a rank failed (local; revoking twice is harmless)."""
        revoke(self._MPI, self.comm)


__all__ = ["Rendezvous", "POLL"]
