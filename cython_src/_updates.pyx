"""The optimizers' host updates as compiled multi-tensor passes (float32, float64).

``adam_many`` and ``sgd_many`` update every parameter of a list in one call:
all arguments are checked first (``_kernels_common.checked``: numpy,
C-contiguous, one dtype, matching sizes, writable), then one loop without the
GIL runs the C update (``update_kernels_impl.h``) over each parameter in turn,
the numpy update's operations in its order, so the result is the same bits.
The callers (``axonhpc.optim``) choose when to use them; see [Note: host
updates] in ``axonhpc.optim.fused``.
"""
cimport numpy as cnp
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t

from _kernels_common cimport checked, kernel_dtype

import numpy as np

cnp.import_array()

cdef extern from "host_kernels.h" nogil:
    void ax_adam_f32(float*, const float*, float*, float*, int64_t, float, float, float, float, float, float, float,
                     float, int, int)
    void ax_adam_f64(double*, const double*, double*, double*, int64_t, double, double, double, double, double,
                     double, double, double, int, int)
    void ax_sgd_f32(float*, const float*, float*, int64_t, float, float, float, float, int, int, int, int, int)
    void ax_sgd_f64(double*, const double*, double*, int64_t, double, double, double, double, int, int, int, int,
                    int)


cdef class _Table:
    """Data pointers and sizes of ``count`` tensors in ``width`` lists, checked, in plain C arrays."""

    cdef void** ptrs
    cdef int64_t* sizes
    cdef Py_ssize_t count, width

    def __cinit__(self, Py_ssize_t count, Py_ssize_t width):
        self.count, self.width = count, width
        self.ptrs = <void**>PyMem_Malloc(max(1, count * width) * sizeof(void*))
        self.sizes = <int64_t*>PyMem_Malloc(max(1, count) * sizeof(int64_t))
        if self.ptrs == NULL or self.sizes == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.ptrs)
        PyMem_Free(self.sizes)


cdef _Table _table(tuple lists, tuple names, tuple writable):
    """Check every array of ``lists`` (equal lengths; tensor k has one size in every list) and keep the pointers."""
    cdef Py_ssize_t k, w, count = len(lists[0]), width = len(lists)
    cdef cnp.ndarray arr
    for w in range(width):
        if len(lists[w]) != count:
            from axonhpc.errors import ShapeError

            raise ShapeError(f"{names[w]}: {len(lists[w])} arrays, {names[0]}: {count}; the lists must match")
    dtype = kernel_dtype(lists[0][0], f"{names[0]}[0]") if count else np.dtype(np.float32)
    cdef _Table table = _Table(count, width)
    for k in range(count):
        arr = checked(lists[0][k], f"{names[0]}[{k}]", dtype, -1, writable[0])
        table.sizes[k] = cnp.PyArray_SIZE(arr)
        table.ptrs[k] = cnp.PyArray_DATA(arr)
        for w in range(1, width):
            arr = checked(lists[w][k], f"{names[w]}[{k}]", dtype, table.sizes[k], writable[w])
            table.ptrs[w * count + k] = cnp.PyArray_DATA(arr)
    return table


def adam_many(params, grads, exp_avgs, exp_avg_sqs, tuple scalars, bint l2, bint decoupled):
    """One Adam/AdamW step of every parameter in ``params`` (one dtype) and its moments, in place.

    ``scalars``: weight_decay, decay (1 - lr * weight_decay), 1 - beta1, beta2, 1 - beta2,
    sqrt(bias_correction2), eps and the step size lr / bias_correction1 (``optim.fused.adam_scalars``).
    """
    cdef _Table t = _table((params, grads, exp_avgs, exp_avg_sqs),
                           ("params", "grads", "exp_avgs", "exp_avg_sqs"), (True, False, True, True))
    if len(scalars) != 8:
        from axonhpc.errors import InvalidArgumentError

        raise InvalidArgumentError(f"adam_many takes 8 scalars, got {len(scalars)}")
    cdef Py_ssize_t k, n = t.count
    cdef double s0 = scalars[0], s1 = scalars[1], s2 = scalars[2], s3 = scalars[3], s4 = scalars[4]
    cdef double s5 = scalars[5], s6 = scalars[6], s7 = scalars[7]
    if n == 0:
        return
    if params[0].dtype == np.float32:
        with nogil:
            for k in range(n):
                ax_adam_f32(<float*>t.ptrs[k], <float*>t.ptrs[n + k], <float*>t.ptrs[2 * n + k],
                            <float*>t.ptrs[3 * n + k], t.sizes[k], <float>s0, <float>s1, <float>s2, <float>s3,
                            <float>s4, <float>s5, <float>s6, <float>s7, l2, decoupled)
    else:
        with nogil:
            for k in range(n):
                ax_adam_f64(<double*>t.ptrs[k], <double*>t.ptrs[n + k], <double*>t.ptrs[2 * n + k],
                            <double*>t.ptrs[3 * n + k], t.sizes[k], s0, s1, s2, s3, s4, s5, s6, s7, l2, decoupled)


def sgd_many(params, grads, bufs, tuple scalars, bint l2, bint momentum, bint first, bint dampened, bint nesterov):
    """One SGD step of every parameter in ``params`` (one dtype), and of its momentum buffer (``bufs``; None
    without momentum), in place. ``scalars``: weight_decay, momentum, 1 - dampening, lr (``optim.fused.sgd_scalars``).
    ``first``: every buffer is new and takes the gradient (torch's first momentum step)."""
    cdef _Table t
    if momentum:
        t = _table((params, grads, bufs), ("params", "grads", "bufs"), (True, False, True))
    else:
        t = _table((params, grads), ("params", "grads"), (True, False))
    if len(scalars) != 4:
        from axonhpc.errors import InvalidArgumentError

        raise InvalidArgumentError(f"sgd_many takes 4 scalars, got {len(scalars)}")
    cdef Py_ssize_t k, n = t.count
    cdef double s0 = scalars[0], s1 = scalars[1], s2 = scalars[2], s3 = scalars[3]
    if n == 0:
        return
    if params[0].dtype == np.float32:
        with nogil:
            for k in range(n):
                ax_sgd_f32(<float*>t.ptrs[k], <float*>t.ptrs[n + k],
                           <float*>t.ptrs[2 * n + k] if momentum else NULL, t.sizes[k], <float>s0, <float>s1,
                           <float>s2, <float>s3, l2, momentum, first, dampened, nesterov)
    else:
        with nogil:
            for k in range(n):
                ax_sgd_f64(<double*>t.ptrs[k], <double*>t.ptrs[n + k],
                           <double*>t.ptrs[2 * n + k] if momentum else NULL, t.sizes[k], s0, s1, s2, s3, l2,
                           momentum, first, dampened, nesterov)
