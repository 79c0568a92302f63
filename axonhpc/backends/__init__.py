"""Backends: the libraries that move the bytes (MPI, in-process threads, NCCL).

Optional libraries, and ``mpi4py.MPI`` (whose import initialises MPI), are imported only when a
backend needs them, so ``import axonhpc`` works anywhere.
"""
from .base import Backend, CompletedWork, ReduceOp, Work
from .local import LocalAbort, LocalBackend


_LAZY = {"MPIBackend": "mpi", "MPIWork": "mpi", "NCCLBackend": "nccl", "NCCLWork": "nccl",
         "DeviceDispatchBackend": "dispatch"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Backend", "Work", "CompletedWork", "ReduceOp", "LocalBackend", "LocalAbort", "MPIBackend", "MPIWork",
           "NCCLBackend", "NCCLWork", "DeviceDispatchBackend"]
