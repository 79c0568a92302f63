"""Every error axonhpc raises on purpose.

Local mistakes (a bad rank, a non-member, a buffer MPI cannot use) are found
before any message is sent, so no other rank is left waiting, and their
messages carry the offending values. Cross-rank disagreements and hangs have
their own types so that a job script can tell them apart.
"""


class AxonError(Exception):
    """Base class of every error axonhpc raises on purpose."""


class RankError(AxonError, ValueError):
    """A rank is out of range, duplicated, or not part of the parent group."""


class NotAMemberError(AxonError):
    """This process called an operation on a group it does not belong to."""


class InvalidBufferError(AxonError, ValueError):
    """Base of local buffer problems found before communication."""


class NonContiguousBufferError(InvalidBufferError):
    """The array is not C-contiguous, so MPI cannot use it in place."""


class ReadOnlyBufferError(InvalidBufferError):
    """The array is read-only but the operation writes into it."""


class ShapeError(InvalidBufferError):
    """Shapes do not fit the operation (for example an indivisible reduce_scatter)."""


class UnsupportedDtypeError(AxonError, TypeError):
    """The array's dtype is not one the collectives support."""


class ConfigurationError(AxonError, ValueError):
    """Arguments that cannot work together (a mesh whose sizes do not multiply to the world size)."""


class CollectiveMismatchError(AxonError):
    """Ranks called different collectives (debug mode); raised on every rank."""


class CollectiveTimeoutError(AxonError, TimeoutError):
    """A blocking operation did not complete within its timeout."""


class BackendUnavailableError(AxonError):
    """A requested backend (NCCL, cupy, CUDA-aware MPI) cannot work here."""


class StateDictError(AxonError, ValueError):
    """A state dict does not fit its module or optimizer (missing or unexpected keys, other shapes)."""


class BackwardBeforeForwardError(AxonError, RuntimeError):
    """``backward`` was called on a module with no forward activations cached for it."""


class CheckpointError(AxonError):
    """A checkpoint cannot be written or read (unsupported value, corrupt or foreign file, failed write)."""


__all__ = [
    "AxonError",
    "RankError",
    "NotAMemberError",
    "InvalidBufferError",
    "NonContiguousBufferError",
    "ReadOnlyBufferError",
    "ShapeError",
    "UnsupportedDtypeError",
    "ConfigurationError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "BackendUnavailableError",
    "StateDictError",
    "BackwardBeforeForwardError",
    "CheckpointError",
]
