"""Backends: the libraries that move the bytes (MPI, in-process threads, NCCL).

Optional libraries are imported inside the backend that needs them, and
``mpi4py.MPI`` (whose import initialises MPI) only when an MPI backend is
made, so ``import axonhpc`` works anywhere.
"""
from .base import Backend, CompletedWork, ReduceOp, Work
from .local import LocalAbort, LocalBackend


def __getattr__(name):
    if name in ("MPIBackend", "MPIWork"):
        from . import mpi

        return getattr(mpi, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Backend", "Work", "CompletedWork", "ReduceOp", "LocalBackend", "LocalAbort", "MPIBackend", "MPIWork"]
