"""Backends: the libraries that move the bytes (MPI, in-process threads, NCCL).

Optional libraries are imported inside the backend that needs them, and
``mpi4py.MPI`` (whose import initialises MPI) only when an MPI backend is
made, so ``import axonhpc`` works anywhere. The device path: ``nccl``
(NCCLBackend), ``dispatch`` (numpy to MPI, cupy to NCCL in one world),
``devices`` (facts, binding, backend choice), ``cuda_aware`` and ``staging``
(cupy arrays over MPI).
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
