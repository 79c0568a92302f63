"""Every error axonhpc raises on purpose.

[Note: one hierarchy, with the built-in type as a second base]
Every class derives from ``AxonError``, so ``except ax.errors.AxonError``
catches whatever the library raised on purpose; where a built-in exception
says the same thing the class derives from it too, so ``except ValueError``
keeps working. Local mistakes are found before any message is sent, so no
other rank is left waiting. ``tests/test_errors.py`` fails on any ``raise``
of something else (bar a short, reasoned list).
"""
from typing import Sequence, Tuple


class AxonError(Exception):
    """Base class of every error axonhpc raises on purpose."""


# -- arguments -----------------------------------------------------------------------------------
class InvalidArgumentError(AxonError, ValueError):
    """An argument has a value the call cannot take (an unknown reduce op, a negative tag, a bad name)."""


class ArgumentTypeError(AxonError, TypeError):
    """An argument has a type the call cannot take (a float where a rank goes, a non-Module in Sequential)."""


class InvalidGroupError(ArgumentTypeError):
    """``group`` is neither a ``ProcessGroup`` nor None."""


class InvalidKeyError(AxonError, KeyError):
    """A name the object does not have or cannot take (a mesh dimension, a buffer name)."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ConfigurationError(AxonError, ValueError):
    """Arguments or settings that cannot work together (a mesh not multiplying to the world size, a bad ``AXONHPC_*``)."""


class UnknownChoiceError(InvalidArgumentError, ConfigurationError):
    """A string names no member of an option enum; both an ``InvalidArgumentError`` and a ``ConfigurationError``."""


class MissingDependencyError(AxonError, ImportError):
    """An optional package that this call needs is not installed; the message says what to install."""


class NotFoundError(AxonError, FileNotFoundError):
    """A file or folder the call needs is missing (no flight-recorder dumps, no timelines in a folder)."""


class UsageError(AxonError, RuntimeError):
    """A call made out of order, or in a state that does not allow it (the message says what comes first)."""


class ModuleNotInitializedError(AxonError, AttributeError):
    """A ``Module`` subclass assigned attributes before calling ``super().__init__()``."""


# -- ranks, groups and buffers ------------------------------------------------------------------
class RankError(AxonError, ValueError):
    """A rank is out of range, duplicated, not in the parent group, or one the call cannot use."""


class NotAMemberError(AxonError):
    """This process called an operation on a group it does not belong to."""


class GroupDestroyedError(UsageError):
    """An operation on a process group after its ``destroy()`` (the message names the group)."""


class InvalidBufferError(AxonError, ValueError):
    """Base of local buffer problems found before communication."""


class NonContiguousBufferError(InvalidBufferError):
    """The array is not C-contiguous, so MPI cannot use it in place."""


class ReadOnlyBufferError(InvalidBufferError):
    """The array is read-only but the operation writes into it (a broadcast buffer, on every rank)."""


class ShapeError(InvalidBufferError):
    """Shapes or sizes do not fit the operation (an indivisible reduce_scatter, a too-small receive buffer)."""


class UnsupportedDtypeError(AxonError, TypeError):
    """The array's dtype is not one the collectives support."""


class SharedMemoryError(AxonError, MemoryError):
    """The node's shared memory (``/dev/shm``) cannot hold what was asked for; found before anything is written."""


# -- across ranks -------------------------------------------------------------------------------
class CollectiveMismatchError(AxonError):
    """Ranks called different collectives, or passed arguments that must agree and do not; raised on every rank.

    Attributes:
        ranks: the world ranks raising it alike; an uncaught one prints its traceback on the lowest only.
    """

    ranks: Tuple[int, ...] = ()


class CollectiveRefusedError(CollectiveMismatchError):
    """Another rank refused its part of this collective before anything was sent; raised on the other ranks.

    Attributes:
        rank: the world rank of the (first) refusing rank.
        reason: its error, ``"ShapeError: ..."``.
    """

    def __init__(self, message: str, rank: int = -1, reason: str = "") -> None:
        super().__init__(message)
        self.rank, self.reason = rank, reason


class GroupMismatchError(CollectiveMismatchError, ValueError):
    """Ranks passed different arguments to ``new_group``, or ones ``split`` cannot take; raised on every rank."""


class ModelMismatchError(CollectiveMismatchError, ValueError):
    """The ranks of a parallel wrapper's group hold different models; raised on every rank, naming the first difference."""


class CollectiveTimeoutError(AxonError, TimeoutError):
    """A blocking operation did not complete within its timeout."""


class CollectiveStallError(CollectiveTimeoutError):
    """A collective waited ``settings.stall_timeout`` seconds for the group; the message is the watchdog's report."""


class DeadlockError(CollectiveStallError):
    """The ranks' waits form a cycle (groups entered in different orders); raised on every rank of the cycle."""


class LocalAbort(AxonError):
    """Another rank of a local (``run_local``) world aborted or died."""


class BackendUnavailableError(AxonError):
    """A requested backend (NCCL, cupy, CUDA-aware MPI) cannot work here."""


# -- models, strategies and checkpoints ------------------------------------------------------------
class StateDictError(AxonError, ValueError):
    """A state dict does not fit its module or optimizer (missing or unexpected keys, other shapes)."""


class BackwardBeforeForwardError(AxonError, RuntimeError):
    """``backward`` was called on a module with no forward activations cached for it."""


class UnusedParameterError(AxonError, RuntimeError):
    """A parameter got no gradient in a backward and ``find_unused_parameters`` is off (DDP)."""


class GradientAfterReductionError(AxonError, RuntimeError):
    """A gradient arrived for a DDP bucket whose all-reduce had already started."""


class ParameterServerError(AxonError, RuntimeError):
    """A ParameterServer method was used out of turn on this rank (found before anything is sent)."""


class PeerFailedError(AxonError, RuntimeError):
    """Another rank failed, so this call stopped; ``lost``: their job ranks, when known."""

    def __init__(self, message: str, lost: Sequence[int] = ()):
        super().__init__(message)
        self.lost = list(lost)


class RecoveryError(PeerFailedError):
    """Ranks failed and the survivors cannot go on without them (state lost, or layout impossible); ``lost`` as above."""


class CheckpointError(AxonError):
    """A checkpoint cannot be written or read (unsupported value, corrupt or foreign file, failed write)."""


class CheckpointEntryError(CheckpointError):
    """One entry of a checkpoint archive cannot be read safely; the message names the entry and the values."""


# -- tools ----------------------------------------------------------------------------------------
class TemplateError(ConfigurationError):
    """A SLURM template cannot be rendered: bad syntax, an unknown option, a failed ``#@ require``."""


class MissingValueError(TemplateError):
    """A SLURM template uses an option that was not given; ``.name`` is the option."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class TemplateNotFoundError(ConfigurationError):
    """No SLURM template of that name in ``slurm/`` and no file at that path."""


class BenchError(AxonError, RuntimeError):
    """A benchmark's worker job could not be started, failed, or timed out."""


class GraphCaptureError(AxonError, RuntimeError):
    """A step cannot be captured as a CUDA graph, or a captured graph no longer fits its step (why in the message)."""


# What a collective raises once the group already knows: every rank raised it alike, a rank did not come in
# time, or a peer died. A rank whose step fails with one of these has nothing to tell the others.
GROUP_FAILURES = (CollectiveMismatchError, CollectiveTimeoutError, PeerFailedError)


def everywhere(error: CollectiveMismatchError, ranks: Sequence[int]) -> CollectiveMismatchError:
    """``error``, marked as raised alike on every one of ``ranks`` (world ranks)."""
    error.ranks = tuple(int(r) for r in ranks)
    return error


def replacing(error: BaseException, cause: BaseException, keep_cause: bool = False) -> BaseException:
    """``error`` with ``cause`` suppressed from the traceback (``keep_cause``, in debug mode, keeps it as the cause)."""
    error.__cause__ = cause if keep_cause else None
    error.__suppress_context__ = True
    return error


__all__ = [
    "AxonError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "InvalidGroupError",
    "InvalidKeyError",
    "ConfigurationError",
    "UnknownChoiceError",
    "MissingDependencyError",
    "NotFoundError",
    "UsageError",
    "ModuleNotInitializedError",
    "RankError",
    "NotAMemberError",
    "GroupDestroyedError",
    "InvalidBufferError",
    "NonContiguousBufferError",
    "ReadOnlyBufferError",
    "ShapeError",
    "UnsupportedDtypeError",
    "SharedMemoryError",
    "CollectiveMismatchError",
    "CollectiveRefusedError",
    "GroupMismatchError",
    "ModelMismatchError",
    "CollectiveTimeoutError",
    "CollectiveStallError",
    "DeadlockError",
    "LocalAbort",
    "BackendUnavailableError",
    "StateDictError",
    "BackwardBeforeForwardError",
    "UnusedParameterError",
    "GradientAfterReductionError",
    "ParameterServerError",
    "PeerFailedError",
    "RecoveryError",
    "CheckpointError",
    "CheckpointEntryError",
    "TemplateError",
    "MissingValueError",
    "TemplateNotFoundError",
    "BenchError",
    "GraphCaptureError",
]
