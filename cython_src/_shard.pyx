"""Shard arithmetic and the flatten / pad / slice helpers of sharded data parallelism.

[Note: padded shards]
A flat buffer of ``numel`` elements is padded with zeros to a multiple of the
world size so that every rank owns a slice of the same length,
``ceil(numel / world_size)``; equal lengths are what ``all_gather`` and
``reduce_scatter`` need. Rank r owns ``[r * chunk, (r + 1) * chunk)`` of the
padded buffer; ``pad`` counts the positions of that slice at or beyond
``numel``, so the last ranks may hold only padding. Everything here is a pure
function of its arguments (torch's ``_get_unpadded_shard`` is the model), so
it is tested without any communication.
"""
from cpython.pyport cimport PY_SSIZE_T_MAX

import numpy as np

from axonhpc._dtypes import check_array
from axonhpc._ext._pack import checked_dtype, pack
from axonhpc.errors import InvalidArgumentError, RankError, ShapeError, UnsupportedDtypeError


cdef inline void _check_world(Py_ssize_t world_size) except *:
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be at least 1, got {world_size}")


cdef inline void _check_numel(Py_ssize_t numel) except *:
    if numel < 0:
        raise InvalidArgumentError(f"numel must be non-negative, got {numel}")


cpdef Py_ssize_t shard_size(Py_ssize_t numel, Py_ssize_t world_size) except -1:
    """Length of every rank's slice: ``ceil(numel / world_size)``.

    Args:
        numel: elements of the unpadded buffer, >= 0.
        world_size: number of ranks, >= 1.

    Returns:
        The common slice length.

    Raises:
        InvalidArgumentError: ``numel`` < 0 or ``world_size`` < 1 (a ``ValueError``).
    """
    _check_numel(numel)
    _check_world(world_size)
    # not (numel + world_size - 1) // world_size, which overflows for numel near PY_SSIZE_T_MAX
    return numel // world_size + (1 if numel % world_size else 0)


cdef inline void _check_fits(Py_ssize_t count, Py_ssize_t chunk, str what) except *:
    """Raise OverflowError unless ``count * chunk`` fits in a Py_ssize_t."""
    if chunk != 0 and count > PY_SSIZE_T_MAX // chunk:
        raise OverflowError(f"{what}: {count} * {chunk} elements do not fit in a Py_ssize_t")


cpdef Py_ssize_t padded_size(Py_ssize_t numel, Py_ssize_t world_size) except -1:
    """Size of the buffer padded to a multiple of ``world_size``.

    Args:
        numel: elements of the unpadded buffer, >= 0.
        world_size: number of ranks, >= 1.

    Returns:
        ``shard_size(numel, world_size) * world_size``.

    Raises:
        InvalidArgumentError: ``numel`` < 0 or ``world_size`` < 1 (a ``ValueError``).
        OverflowError: the padded size does not fit in a Py_ssize_t.
    """
    cdef Py_ssize_t chunk = shard_size(numel, world_size)
    _check_fits(world_size, chunk, "padded_size")
    return chunk * world_size


cpdef tuple shard_bounds(Py_ssize_t numel, Py_ssize_t rank, Py_ssize_t world_size):
    """This rank's slice of the buffer padded to a multiple of ``world_size``.

    Args:
        numel: elements of the unpadded buffer, >= 0.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks, >= 1.

    Returns:
        ``(start, stop, pad)``: ``[start, stop)`` indexes the padded buffer,
        ``stop - start == ceil(numel / world_size)`` on every rank, and ``pad``
        is the number of positions of the slice at or beyond ``numel``.

    Raises:
        InvalidArgumentError: ``numel`` < 0 or ``world_size`` < 1 (a ``ValueError``).
        RankError: ``rank`` outside ``[0, world_size)``.
        OverflowError: ``stop`` does not fit in a Py_ssize_t.
    """
    cdef Py_ssize_t chunk = shard_size(numel, world_size)
    cdef Py_ssize_t start, stop
    if rank < 0 or rank >= world_size:
        raise RankError(f"rank {rank} is out of range for world_size {world_size}")
    _check_fits(rank + 1, chunk, "shard_bounds")
    start = rank * chunk
    stop = start + chunk
    return start, stop, stop - min(max(numel, start), stop)


cdef class FlatLayout:
    """Where each array of a flattened group sits in the padded flat buffer.

    Built by ``flatten_into_padded``; pure data (shapes, offsets, sizes).

    Attributes:
        shapes: shape of each array, in order.
        offsets: element offset of each array in the flat buffer.
        sizes: element count of each array.
        dtype: the common dtype.
        numel: elements of all arrays together (the unpadded length).
        world_size: the world size the buffer is padded for.
        padded_numel: ``padded_size(numel, world_size)``.
    """

    cdef readonly tuple shapes
    cdef readonly tuple offsets
    cdef readonly tuple sizes
    cdef readonly object dtype
    cdef readonly Py_ssize_t numel
    cdef readonly Py_ssize_t world_size
    cdef readonly Py_ssize_t padded_numel

    def __init__(self, shapes, dtype, Py_ssize_t world_size):
        """Describe arrays of these shapes and dtype, padded for ``world_size`` ranks.

        Args:
            shapes: shape of each array, in order.
            dtype: their common dtype.
            world_size: number of ranks, >= 1.

        Raises:
            InvalidArgumentError: ``world_size`` < 1.
            ShapeError: a negative dimension (both are ``ValueError``s).
            OverflowError: the arrays hold more elements than a Py_ssize_t counts.
        """
        cdef list offsets = []
        cdef list sizes = []
        total = 0  # Python ints: a crafted shape cannot overflow the sums silently
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        for i, shape in enumerate(self.shapes):
            n = 1
            for d in shape:
                if d < 0:
                    raise ShapeError(f"FlatLayout: shape {shape} of array {i} has a negative dimension ({d})")
                n *= d
            offsets.append(total)
            sizes.append(n)
            total += n
        self.offsets = tuple(offsets)
        self.sizes = tuple(sizes)
        self.dtype = np.dtype(dtype)
        self.numel = total
        self.world_size = world_size
        self.padded_numel = padded_size(total, world_size)

    def shard_bounds(self, Py_ssize_t rank):
        """``shard_bounds(self.numel, rank, self.world_size)``."""
        return shard_bounds(self.numel, rank, self.world_size)

    def __eq__(self, other):
        if not isinstance(other, FlatLayout):
            return NotImplemented
        return (self.shapes, self.dtype, self.world_size) == (other.shapes, other.dtype, other.world_size)

    def __hash__(self):
        return hash((self.shapes, self.dtype, self.world_size))

    def __repr__(self):
        return (f"FlatLayout(shapes={self.shapes}, dtype={self.dtype}, world_size={self.world_size}, "
                f"numel={self.numel}, padded_numel={self.padded_numel})")


def flatten_into_padded(arrays, Py_ssize_t world_size):
    """Copy arrays into a new flat buffer zero-padded to a multiple of ``world_size``.

    Args:
        arrays: C-contiguous numpy arrays of one supported dtype (at least one).
        world_size: number of ranks, >= 1.

    Returns:
        ``(flat_padded, layout)``: the 1-D buffer of ``layout.padded_numel``
        elements (the arrays, then zeros) and its ``FlatLayout``.

    Raises:
        InvalidArgumentError: ``world_size`` < 1 (a ``ValueError``).
        ShapeError: no arrays.
        UnsupportedDtypeError, NonContiguousBufferError: as for ``pack``.
    """
    arrays = list(arrays)
    if not arrays:
        raise ShapeError("flatten_into_padded: got no arrays")
    dtype = checked_dtype(arrays[0], "flatten_into_padded: arrays[0]")
    layout = FlatLayout([a.shape for a in arrays], dtype, world_size)
    flat = np.empty(layout.padded_numel, dtype=dtype)
    pack(arrays, out=flat[:layout.numel])
    flat[layout.numel:] = 0
    return flat, layout


cdef void _check_flat(flat, str what) except *:
    # Slicing works on cupy arrays too, so these helpers accept either kind.
    check_array(flat, what)
    if flat.ndim != 1:
        raise ShapeError(f"{what} must be 1-D, got shape {flat.shape}")


def shard_view(flat_padded, Py_ssize_t rank, Py_ssize_t world_size):
    """Zero-copy view of this rank's slice of a padded flat buffer.

    Args:
        flat_padded: 1-D C-contiguous numpy or cupy array whose size is a
            multiple of ``world_size``.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks, >= 1.

    Returns:
        ``flat_padded[start:stop]`` with ``(start, stop, _) = shard_bounds(size, rank, world_size)``.

    Raises:
        InvalidArgumentError: ``world_size`` < 1 (a ``ValueError``).
        RankError: ``rank`` outside ``[0, world_size)``.
        ShapeError: ``flat_padded`` is not 1-D or its size is not a multiple of ``world_size``.
        UnsupportedDtypeError: not a numpy or cupy array of a supported dtype.
        NonContiguousBufferError: ``flat_padded`` is not C-contiguous.
    """
    _check_world(world_size)
    _check_flat(flat_padded, "shard_view: flat_padded")
    if flat_padded.size % world_size:
        raise ShapeError(f"shard_view: flat_padded has {flat_padded.size} elements, not a multiple of "
                         f"world_size {world_size}; pad it with flatten_into_padded or padded_size")
    start, stop, _ = shard_bounds(flat_padded.size, rank, world_size)
    return flat_padded[start:stop]


def unflatten(flat, FlatLayout layout):
    """Zero-copy views of ``flat`` shaped like the arrays ``layout`` describes.

    To copy into existing arrays instead, use ``unpack(flat[:layout.numel], arrays)``.

    Args:
        flat: 1-D C-contiguous numpy or cupy array of ``layout.dtype`` with at least
            ``layout.numel`` elements (padded or not).
        layout: the ``FlatLayout`` from ``flatten_into_padded``.

    Returns:
        A list of views, one per array of the layout.

    Raises:
        UnsupportedDtypeError: ``flat`` is not an array, or its dtype is not ``layout.dtype``.
        ShapeError: ``flat`` is not 1-D or shorter than ``layout.numel``.
        NonContiguousBufferError: ``flat`` is not C-contiguous.
    """
    _check_flat(flat, "unflatten: flat")
    if flat.dtype != layout.dtype:
        raise UnsupportedDtypeError(f"unflatten: flat has dtype {flat.dtype} but the layout is {layout.dtype}")
    if flat.size < layout.numel:
        raise ShapeError(f"unflatten: flat has {flat.size} elements but the layout needs {layout.numel}")
    return [flat[o:o + n].reshape(s) for o, n, s in zip(layout.offsets, layout.sizes, layout.shapes)]
