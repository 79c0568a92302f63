"""Inline argument checks shared by the host kernel modules (``_layers``, ``_updates``).

A kernel writes through raw pointers, so every array it is given is checked
first: a numpy array, C-contiguous, of the kernel's dtype, of the expected
number of elements, writable where it is written. A failed check raises the
AxonError that names the argument; nothing is read or written before all of a
call's arguments pass.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t

from _buffers cimport layout_ok


cdef inline cnp.ndarray checked(object a, str what, object dtype, Py_ssize_t size, bint writable):
    """``a`` as an ndarray once it is C-contiguous, of ``dtype``, of ``size`` elements (-1: any) and writable if asked.

    Raises ``UnsupportedDtypeError``, ``NonContiguousBufferError``, ``ReadOnlyBufferError`` or ``ShapeError``.
    """
    cdef cnp.ndarray arr
    if not layout_ok(a, writable):
        from axonhpc._dtypes import check_array
        from axonhpc.errors import UnsupportedDtypeError
        import numpy as np

        if not isinstance(a, np.ndarray):
            raise UnsupportedDtypeError(f"{what} must be a numpy array, got {type(a).__module__}.{type(a).__name__}")
        check_array(a, what, writable=writable)
        raise RuntimeError(f"{what} was rejected but passes every check; this is a bug in axonhpc")
    arr = <cnp.ndarray>a
    descr = <cnp.dtype>cnp.PyArray_DESCR(arr)
    if not (descr is dtype or cnp.PyArray_EquivTypes(descr, <cnp.dtype>dtype)):
        from axonhpc.errors import UnsupportedDtypeError

        raise UnsupportedDtypeError(f"{what} has dtype {a.dtype}, the kernel's arrays are {dtype}")
    if size >= 0 and cnp.PyArray_SIZE(arr) != size:
        from axonhpc.errors import ShapeError

        raise ShapeError(f"{what} has shape {tuple(a.shape)} ({cnp.PyArray_SIZE(arr)} elements), the kernel "
                         f"needs {size} elements")
    return arr


ctypedef void* vptr


cdef inline vptr pointer(cnp.ndarray a):
    """The data pointer of a checked array, NULL for None."""
    return NULL if a is None else cnp.PyArray_DATA(a)


cdef inline object kernel_dtype(object a, str what):
    """The dtype of ``a`` when it is float32 or float64 (the kernels' types), else UnsupportedDtypeError."""
    import numpy as np

    dtype = getattr(a, "dtype", None)
    if dtype == np.float32 or dtype == np.float64:
        return np.dtype(dtype)
    from axonhpc.errors import UnsupportedDtypeError

    raise UnsupportedDtypeError(f"{what} has dtype {dtype}; the host kernels take float32 and float64 arrays")
