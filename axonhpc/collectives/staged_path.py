"""Large blocking all-reduces of staged device arrays, as a pipeline of chunks.

[Note: pipelined staging]
Where MPI is not CUDA-aware a cupy array goes through pinned host twins, and whole, the copy down,
the host all-reduce and the copy up run one after another. Above ``settings.staging_chunk_bytes`` the
array is cut into chunks, all copies down are queued at once, and chunk by chunk the host reduces
what has arrived and queues it back, so neighbouring chunks' copies run under each all-reduce.

Each chunk's host all-reduce is the one a numpy array gets (the engine on one node, else MPI; AVG
and 16-bit floats as ``widen``). Elementwise reductions ignore the cut, so the result is the
unchunked one bit for bit. The whole call is compared first, so every rank cuts the same chunks.
Not pipelined: ``async_op=True`` (DDP overlaps the unchunked MPI request with its backward), a blocking
call whose check finds another rank's call asynchronous (it meets that one unchunked request: [Note:
blocking and nonblocking twins]), calls under a timeout (a chunk's MPI call could not be interrupted),
one-chunk arrays, and ``staging_chunk_bytes = 0``.
"""
from __future__ import annotations

from typing import Any

from .._dtypes import is_cupy_array
from ..backends.base import CompletedWork, ReduceOp, Work
from ..settings import settings
from . import agreement, shm_path
from .widen import reduce_widened


def takes(pg: Any, x: Any, op: ReduceOp, async_op: bool) -> bool:
    """Whether this all-reduce runs pipelined (see the module note); the same answer on every rank of a correct program."""
    if not is_cupy_array(x) or async_op:
        return False
    chunk = settings.staging_chunk_bytes
    if chunk <= 0 or x.nbytes <= chunk or pg.effective_timeout() is not None or not pg.backend.stages(x):
        return False
    return not shm_path.fixed_order(x, op) or agreement.node_engine(pg) is not None


def all_reduce(pg: Any, x: Any, op: ReduceOp) -> Work:
    """Reduce the device array ``x`` in place over ``pg``, chunk by chunk through pinned host memory.

    Raises:
        BackendUnavailableError: no pinned staging area can be made.
    """
    from ..backends.mpi import pinned_staging
    from ..backends.staging import run_pipelined

    fixed = shm_path.fixed_order(x, op)

    def reduce_chunk(chunk: Any) -> None:
        node = shm_path.path(pg, chunk, "all_reduce", reduction=True, any_size=fixed)
        if node is not None and node.fuses(op, chunk):
            node.all_reduce(chunk, chunk, op, agreement.describe("all_reduce", chunk, op.name))
            return

        def body(work: Any, base: ReduceOp) -> None:
            if node is not None:
                node.all_reduce(work, work, base, agreement.describe("all_reduce", work, base.name))
            else:
                pg.backend.all_reduce(work, base, False).wait()

        reduce_widened(chunk, op, pg.size, body)

    staging = pinned_staging()
    run_pipelined(x, reduce_chunk, staging, max(1, settings.staging_chunk_bytes // x.dtype.itemsize))
    return CompletedWork()


__all__ = ["takes", "all_reduce"]
