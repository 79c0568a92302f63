"""Inline pieces shared by the compiled buffer modules: byte-copy kernels and a fast array check.

A ``.pxd`` is not a module of its own (setup.py compiles ``*.pyx`` only); each
``.pyx`` that cimports it gets these inline functions compiled in.
"""
cimport numpy as cnp
from libc.string cimport memmove

# Copies smaller than this keep the GIL: releasing and re-taking it costs more
# than it frees, and under run_local's threads a re-take can wait a whole
# switch interval behind another thread.
cdef enum:
    NOGIL_MIN_BYTES = 65536


cdef inline void gather_bytes(char* dst, char** srcs, const Py_ssize_t* nbytes,
                              Py_ssize_t n) noexcept nogil:
    """Copy ``srcs[i]`` (``nbytes[i]`` bytes each) one after another into ``dst``."""
    cdef Py_ssize_t i
    for i in range(n):
        # A source that already sits at its place in dst (a gradient that is a
        # bucket view) needs no copy.
        if nbytes[i] != 0 and srcs[i] != dst:
            memmove(dst, srcs[i], <size_t>nbytes[i])
        dst += nbytes[i]


cdef inline void scatter_bytes(const char* src, char** dsts, const Py_ssize_t* nbytes,
                               Py_ssize_t n) noexcept nogil:
    """Copy consecutive runs of ``src`` (``nbytes[i]`` bytes each) into ``dsts[i]``."""
    cdef Py_ssize_t i
    for i in range(n):
        if nbytes[i] != 0 and dsts[i] != src:
            memmove(dsts[i], src, <size_t>nbytes[i])
        src += nbytes[i]


cdef inline void gather(char* dst, char** srcs, const Py_ssize_t* nbytes, Py_ssize_t n,
                        Py_ssize_t total) noexcept:
    """``gather_bytes``, without the GIL when ``total`` bytes make it worth it."""
    if total >= NOGIL_MIN_BYTES:
        with nogil:
            gather_bytes(dst, srcs, nbytes, n)
    else:
        gather_bytes(dst, srcs, nbytes, n)


cdef inline void scatter(const char* src, char** dsts, const Py_ssize_t* nbytes, Py_ssize_t n,
                         Py_ssize_t total) noexcept:
    """``scatter_bytes``, without the GIL when ``total`` bytes make it worth it."""
    if total >= NOGIL_MIN_BYTES:
        with nogil:
            scatter_bytes(src, dsts, nbytes, n)
    else:
        scatter_bytes(src, dsts, nbytes, n)


cdef inline bint layout_ok(object a, bint writable):
    """True if ``a`` is a C-contiguous numpy array (and writable if asked).

    Reads only the ndarray's C struct, so it costs a few nanoseconds; callers
    build the precise error message on the slow path when this is False.
    """
    cdef int flags
    if not cnp.PyArray_Check(a):
        return False
    flags = cnp.PyArray_FLAGS(<cnp.ndarray>a)
    return (flags & cnp.NPY_ARRAY_C_CONTIGUOUS) and not (writable and not (flags & cnp.NPY_ARRAY_WRITEABLE))


cdef inline bint usable(object a, cnp.dtype dtype, bint writable):
    """``layout_ok`` and ``a`` has exactly ``dtype``."""
    cdef cnp.dtype descr
    if not layout_ok(a, writable):
        return False
    descr = <cnp.dtype>cnp.PyArray_DESCR(<cnp.ndarray>a)
    return descr is dtype or cnp.PyArray_EquivTypes(descr, dtype)
