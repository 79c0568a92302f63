"""Collectives on arrays (also importable as ``axonhpc.comm``).

The all-reduce users call (``algorithm=``) comes from ``allreduce``, above
``algorithms``; every other collective from ``core``, below both.
"""
from ..backends.base import ReduceOp, Work
from .allreduce import (
    all_reduce,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_product,
    all_reduce_sum,
    sync_gradient,
    sync_gradients,
)
from .compressed import compressed_all_reduce, compressed_reduce_scatter
from .shm_path import shared_memory_array
from .p2p import irecv, isend, recv, send
from .core import (
    all_gather,
    barrier,
    broadcast,
    gather,
    get_rank,
    get_world_size,
    is_main_process,
    reduce_scatter,
    reduce_scatter_mean,
    reduce_scatter_sum,
    scatter,
)

__all__ = [
    "ReduceOp",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "shared_memory_array",
    "Work",
    "all_reduce",
    "all_reduce_sum",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_max",
    "all_reduce_product",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce_scatter_sum",
    "reduce_scatter_mean",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "sync_gradient",
    "sync_gradients",
    "get_rank",
    "get_world_size",
    "is_main_process",
]
