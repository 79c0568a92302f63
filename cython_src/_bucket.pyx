"""GradientBucket: a fixed-capacity flat buffer that gradients are copied into one by one.

[Note: bucket memory]
The buffer is allocated once (at construction, or at the first ``add`` when
the dtype comes from that array) and reused after ``clear()``, so a training
loop that refills one bucket per step allocates nothing per step. ``data`` and
``views()`` are views of that buffer: they see whatever is added after a
``clear()``, and an all-reduce on ``data`` changes what ``views()`` show.
"""
cimport numpy as cnp
from libc.string cimport memmove

from _buffers cimport NOGIL_MIN_BYTES, usable

import operator

import numpy as np

from axonhpc._ext._pack import checked_dtype, raise_unusable
from axonhpc.errors import ArgumentTypeError, InvalidArgumentError

cnp.import_array()


cdef class GradientBucket:
    """A flat buffer of ``capacity`` elements of one dtype, filled array by array.

    Args:
        capacity: number of elements the bucket holds (not bytes), at least 1.
        dtype: a supported dtype; if None it is taken from the first array added.

    Raises:
        ArgumentTypeError: ``capacity`` is not an integer (a ``TypeError``).
        InvalidArgumentError: ``capacity`` is below 1 (a ``ValueError``).
        UnsupportedDtypeError: ``dtype`` is not supported.
    """

    cdef Py_ssize_t _capacity
    cdef Py_ssize_t _size
    cdef object _dtype      # numpy dtype, or None until the first add
    cdef object _buffer     # 1-D ndarray of _capacity elements, or None until the dtype is known
    cdef list _offsets      # element offset of each added array
    cdef list _shapes       # shape of each added array

    def __init__(self, capacity, dtype=None):
        try:
            capacity = operator.index(capacity)
        except TypeError:
            raise ArgumentTypeError(f"GradientBucket capacity must be an int (a number of elements), got "
                                    f"{type(capacity).__name__} {capacity!r}") from None
        if capacity < 1:
            raise InvalidArgumentError(f"GradientBucket capacity must be at least 1 element, got {capacity}")
        self._capacity = capacity
        self._size = 0
        self._offsets = []
        self._shapes = []
        self._dtype = None
        self._buffer = None
        if dtype is not None:
            self._allocate(checked_dtype(np.empty(0, dtype=dtype), "GradientBucket: the requested buffer"))

    cdef _allocate(self, dtype):
        self._dtype = dtype
        self._buffer = np.empty(self._capacity, dtype=dtype)

    @property
    def capacity(self):
        """Number of elements the bucket can hold."""
        return self._capacity

    @property
    def size(self):
        """Number of elements used by the arrays added so far."""
        return self._size

    @property
    def dtype(self):
        """The bucket's dtype, or None while it is still to be taken from the first array."""
        return self._dtype

    @property
    def data(self):
        """Flat, writable view of the used part of the buffer (``size`` elements).

        This is the part to all-reduce; the unused tail is never exposed. Before
        the dtype is known it is an empty float64 array.
        """
        if self._buffer is None:
            return np.empty(0)
        return self._buffer[:self._size]

    def __len__(self):
        """Number of arrays added since construction or the last ``clear()``."""
        return len(self._shapes)

    def __repr__(self):
        return (f"GradientBucket(capacity={self._capacity}, dtype={self._dtype}, "
                f"size={self._size}, arrays={len(self._shapes)})")

    def add(self, arr):
        """Copy ``arr`` behind the arrays already in the bucket.

        Args:
            arr: C-contiguous numpy array of the bucket's dtype, any shape.

        Returns:
            True if it was copied; False (and nothing copied) if it does not fit
            in the remaining capacity.

        Raises:
            UnsupportedDtypeError: ``arr`` is not numpy, has an unsupported dtype,
                or a dtype other than the bucket's.
            NonContiguousBufferError: ``arr`` is not C-contiguous.
        """
        cdef Py_ssize_t n, nbytes
        cdef char* src
        cdef char* dst
        dtype = self._dtype if self._dtype is not None else checked_dtype(arr, "GradientBucket.add: arr")
        if not usable(arr, dtype, False):
            raise_unusable(arr, "GradientBucket.add: arr", dtype, False)
        n = cnp.PyArray_SIZE(<cnp.ndarray>arr)
        if n > self._capacity - self._size:
            return False
        if self._buffer is None:
            self._allocate(dtype)
        nbytes = cnp.PyArray_NBYTES(<cnp.ndarray>arr)
        src = cnp.PyArray_BYTES(<cnp.ndarray>arr)
        dst = cnp.PyArray_BYTES(<cnp.ndarray>self._buffer) + self._size * (<cnp.dtype>dtype).itemsize
        # memmove, not memcpy: arr may be a view of this very buffer.
        if src != dst and nbytes != 0:
            if nbytes >= NOGIL_MIN_BYTES:
                with nogil:
                    memmove(dst, src, <size_t>nbytes)
            else:
                memmove(dst, src, <size_t>nbytes)
        self._offsets.append(self._size)
        self._shapes.append(arr.shape)
        self._size += n
        return True

    def is_full(self):
        """True if every element of the capacity is used."""
        return self._size == self._capacity

    def is_empty(self):
        """True if no array was added since construction or the last ``clear()``."""
        return not self._shapes

    def views(self):
        """Zero-copy views of the buffer, shaped like the added arrays, in order of adding.

        Returns:
            A list of writable arrays; they stay views of the buffer, so they
            change with it (after an all-reduce, or a ``clear()`` and new adds).
        """
        cdef Py_ssize_t i, k = len(self._shapes)
        cdef list result = []
        for i in range(k):
            start = self._offsets[i]
            stop = self._offsets[i + 1] if i + 1 < k else self._size
            result.append(self._buffer[start:stop].reshape(self._shapes[i]))
        return result

    def extract(self):
        """Copies of the added arrays, in order of adding.

        Returns:
            A list of new arrays shaped like the added ones, independent of the buffer.
        """
        return [view.copy() for view in self.views()]

    def clear(self):
        """Forget the added arrays; the buffer and the dtype are kept for reuse."""
        self._size = 0
        self._offsets.clear()
        self._shapes.clear()
