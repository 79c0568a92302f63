"""The ``nn`` layers' element-wise and row-wise work on the host as compiled kernels (float32, float64).

Each function checks every array it is given (``_kernels_common.checked``)
before any is read or written, then runs its C kernel (``host_kernels.h``)
without the GIL. The callers (``axonhpc.nn.kernels``) choose when to use
them and allocate the outputs; see [Note: host kernels] there.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t

from _kernels_common cimport checked, kernel_dtype, pointer, vptr

import numpy as np

cnp.import_array()

cdef extern from "host_kernels.h" nogil:
    void ax_gelu_forward_f32(const float*, const float*, float*, float*, float*, int64_t, int64_t, int)
    void ax_gelu_forward_f64(const double*, const double*, double*, double*, double*, int64_t, int64_t, int)
    void ax_gelu_backward_f32(const float*, const float*, const float*, float*, int64_t, int)
    void ax_gelu_backward_f64(const double*, const double*, const double*, double*, int64_t, int)
    void ax_relu_forward_f32(const float*, const float*, float*, uint8_t*, int64_t, int64_t)
    void ax_relu_forward_f64(const double*, const double*, double*, uint8_t*, int64_t, int64_t)
    void ax_tanh_backward_f32(const float*, const float*, float*, int64_t)
    void ax_tanh_backward_f64(const double*, const double*, double*, int64_t)
    void ax_softmax_forward_f32(float*, int64_t, int64_t, float, int)
    void ax_softmax_forward_f64(double*, int64_t, int64_t, double, int)
    void ax_softmax_backward_f32(const float*, const float*, float*, int64_t, int64_t, float)
    void ax_softmax_backward_f64(const double*, const double*, double*, int64_t, int64_t, double)
    void ax_layernorm_forward_f32(const float*, const float*, const float*, float*, float*, float*, int64_t,
                                  int64_t, float)
    void ax_layernorm_forward_f64(const double*, const double*, const double*, double*, double*, double*, int64_t,
                                  int64_t, double)
    void ax_layernorm_backward_f32(const float*, const float*, const float*, const float*, float*, float*, float*,
                                   int64_t, int64_t)
    void ax_layernorm_backward_f64(const double*, const double*, const double*, const double*, double*, double*,
                                   double*, int64_t, int64_t)
    void ax_cross_entropy_forward_f32(const float*, const int64_t*, float*, float*, float*, int64_t, int64_t)
    void ax_cross_entropy_forward_f64(const double*, const int64_t*, double*, double*, double*, int64_t, int64_t)
    void ax_cross_entropy_backward_f32(const float*, const float*, const float*, const int64_t*, float*, int64_t,
                                       int64_t, float)
    void ax_cross_entropy_backward_f64(const double*, const double*, const double*, const int64_t*, double*,
                                       int64_t, int64_t, double)
    void ax_scatter_add_rows_f32(const int64_t*, const float*, float*, int64_t, int64_t)
    void ax_scatter_add_rows_f64(const int64_t*, const double*, double*, int64_t, int64_t)

cdef object _INT64 = np.dtype(np.int64)
cdef object _BOOL = np.dtype(np.bool_)


cdef inline Py_ssize_t last_axis(object a, str what) except -1:
    """The length of ``a``'s last axis (the kernels' rows), refusing a 0-d array."""
    if a.ndim == 0:
        from axonhpc.errors import ShapeError

        raise ShapeError(f"{what} is 0-d; the kernel works on rows along the last axis")
    return a.shape[a.ndim - 1]


def gelu_forward(pre, bias, x, y, aux, bint tanh_form):
    """GELU of ``pre`` (plus ``bias`` along the last axis, the sum written to ``x``) into ``y``, and ``aux``.

    ``aux`` is the normal cdf of x (exact form) or the tanh of the tanh form, what the backward reads.
    Without ``bias``, pass ``x=pre``: it is not written.
    """
    dtype = kernel_dtype(pre, "GELU input")
    cdef Py_ssize_t size = pre.size, cols = last_axis(pre, "GELU input")
    cdef int64_t rows = size // cols if cols else 0
    cdef cnp.ndarray p = checked(pre, "GELU input", dtype, -1, False)
    cdef cnp.ndarray b = None if bias is None else checked(bias, "bias", dtype, cols, False)
    cdef cnp.ndarray xo = checked(x, "GELU input out", dtype, size, bias is not None)
    cdef cnp.ndarray yo = checked(y, "GELU output", dtype, size, True)
    cdef cnp.ndarray ao = checked(aux, "GELU saved", dtype, size, True)
    if bias is None and xo is not p:
        from axonhpc.errors import InvalidArgumentError

        raise InvalidArgumentError("gelu_forward without a bias takes x=pre (the input is not rewritten)")
    cdef vptr p_p = pointer(p), p_b = pointer(b), p_xo = pointer(xo), p_yo = pointer(yo), p_ao = pointer(ao)
    if dtype == np.float32:
        with nogil:
            ax_gelu_forward_f32(<float*>p_p, <float*>p_b, <float*>p_xo, <float*>p_yo,
                                <float*>p_ao, rows, cols, tanh_form)
    else:
        with nogil:
            ax_gelu_forward_f64(<double*>p_p, <double*>p_b, <double*>p_xo, <double*>p_yo,
                                <double*>p_ao, rows, cols, tanh_form)


def gelu_backward(g, x, aux, dx, bint tanh_form):
    """d loss / d x of GELU into ``dx`` from ``g`` and the forward's ``x`` and ``aux`` (all of one size)."""
    dtype = kernel_dtype(x, "GELU saved input")
    cdef Py_ssize_t size = x.size
    cdef cnp.ndarray gg = checked(g, "GELU gradient", dtype, size, False)
    cdef cnp.ndarray xx = checked(x, "GELU saved input", dtype, size, False)
    cdef cnp.ndarray aa = checked(aux, "GELU saved", dtype, size, False)
    cdef cnp.ndarray out = checked(dx, "GELU input gradient", dtype, size, True)
    cdef vptr p_gg = pointer(gg), p_xx = pointer(xx), p_aa = pointer(aa), p_out = pointer(out)
    if dtype == np.float32:
        with nogil:
            ax_gelu_backward_f32(<float*>p_gg, <float*>p_xx, <float*>p_aa, <float*>p_out, size,
                                 tanh_form)
    else:
        with nogil:
            ax_gelu_backward_f64(<double*>p_gg, <double*>p_xx, <double*>p_aa, <double*>p_out, size,
                                 tanh_form)


def relu_forward(pre, bias, y, mask):
    """ReLU of ``pre`` (plus ``bias`` along the last axis) into ``y``, and the bool ``mask`` of positive inputs."""
    dtype = kernel_dtype(pre, "ReLU input")
    cdef Py_ssize_t size = pre.size, cols = last_axis(pre, "ReLU input")
    cdef int64_t rows = size // cols if cols else 0
    cdef cnp.ndarray p = checked(pre, "ReLU input", dtype, -1, False)
    cdef cnp.ndarray b = None if bias is None else checked(bias, "bias", dtype, cols, False)
    cdef cnp.ndarray yo = checked(y, "ReLU output", dtype, size, True)
    cdef cnp.ndarray mo = checked(mask, "ReLU mask", _BOOL, size, True)
    cdef vptr p_p = pointer(p), p_b = pointer(b), p_yo = pointer(yo), p_mo = pointer(mo)
    if dtype == np.float32:
        with nogil:
            ax_relu_forward_f32(<float*>p_p, <float*>p_b, <float*>p_yo, <uint8_t*>p_mo, rows, cols)
    else:
        with nogil:
            ax_relu_forward_f64(<double*>p_p, <double*>p_b, <double*>p_yo, <uint8_t*>p_mo, rows,
                                cols)


def tanh_backward(g, y, dx):
    """``dx = g * (1 - y * y)`` (``y`` is tanh's output)."""
    dtype = kernel_dtype(y, "Tanh output")
    cdef Py_ssize_t size = y.size
    cdef cnp.ndarray gg = checked(g, "Tanh gradient", dtype, size, False)
    cdef cnp.ndarray yy = checked(y, "Tanh output", dtype, size, False)
    cdef cnp.ndarray out = checked(dx, "Tanh input gradient", dtype, size, True)
    cdef vptr p_gg = pointer(gg), p_yy = pointer(yy), p_out = pointer(out)
    if dtype == np.float32:
        with nogil:
            ax_tanh_backward_f32(<float*>p_gg, <float*>p_yy, <float*>p_out, size)
    else:
        with nogil:
            ax_tanh_backward_f64(<double*>p_gg, <double*>p_yy, <double*>p_out, size)


def softmax_forward(scores, double scale, bint causal):
    """In place: ``scores * scale``, the future masked when ``causal``, then softmax along the last axis.

    ``causal`` needs scores (..., n, n): row i of each n x n block keeps columns 0..i.
    """
    dtype = kernel_dtype(scores, "attention scores")
    cdef Py_ssize_t size = scores.size, n = last_axis(scores, "attention scores")
    cdef int64_t rows = size // n if n else 0
    if causal and (scores.ndim < 2 or scores.shape[scores.ndim - 2] != n):
        from axonhpc.errors import ShapeError

        raise ShapeError(f"causal attention scores must be (..., n, n), got shape {tuple(scores.shape)}")
    cdef cnp.ndarray s = checked(scores, "attention scores", dtype, -1, True)
    cdef vptr p_s = pointer(s)
    if dtype == np.float32:
        with nogil:
            ax_softmax_forward_f32(<float*>p_s, rows, n, <float>scale, causal)
    else:
        with nogil:
            ax_softmax_forward_f64(<double*>p_s, rows, n, scale, causal)


def softmax_backward(attn, dattn, out, double scale):
    """``out = attn * (dattn - sum(dattn * attn)) * scale`` along the last axis (``out`` may be ``dattn``)."""
    dtype = kernel_dtype(attn, "attention weights")
    cdef Py_ssize_t size = attn.size, n = last_axis(attn, "attention weights")
    cdef int64_t rows = size // n if n else 0
    cdef cnp.ndarray a = checked(attn, "attention weights", dtype, -1, False)
    cdef cnp.ndarray d = checked(dattn, "attention weights' gradient", dtype, size, False)
    cdef cnp.ndarray o = checked(out, "attention scores' gradient", dtype, size, True)
    cdef vptr p_a = pointer(a), p_d = pointer(d), p_o = pointer(o)
    if dtype == np.float32:
        with nogil:
            ax_softmax_backward_f32(<float*>p_a, <float*>p_d, <float*>p_o, rows, n, <float>scale)
    else:
        with nogil:
            ax_softmax_backward_f64(<double*>p_a, <double*>p_d, <double*>p_o, rows, n, scale)


def layernorm_forward(x, weight, bias, y, xhat, rstd, double eps):
    """LayerNorm over the last axis: ``xhat``, ``rstd`` (one per row) and, with ``weight`` and ``bias``, ``y``."""
    dtype = kernel_dtype(x, "LayerNorm input")
    cdef Py_ssize_t size = x.size, n = last_axis(x, "LayerNorm input")
    cdef int64_t rows = size // n if n else 0
    cdef cnp.ndarray xx = checked(x, "LayerNorm input", dtype, -1, False)
    cdef cnp.ndarray w = None if weight is None else checked(weight, "LayerNorm weight", dtype, n, False)
    cdef cnp.ndarray b = None if weight is None else checked(bias, "LayerNorm bias", dtype, n, False)
    cdef cnp.ndarray yo = None if weight is None else checked(y, "LayerNorm output", dtype, size, True)
    cdef cnp.ndarray h = checked(xhat, "LayerNorm saved", dtype, size, True)
    cdef cnp.ndarray r = checked(rstd, "LayerNorm saved rstd", dtype, rows, True)
    cdef vptr p_xx = pointer(xx), p_w = pointer(w), p_b = pointer(b), p_yo = pointer(yo), p_h = pointer(h)
    cdef vptr p_r = pointer(r)
    if dtype == np.float32:
        with nogil:
            ax_layernorm_forward_f32(<float*>p_xx, <float*>p_w, <float*>p_b, <float*>p_yo,
                                     <float*>p_h, <float*>p_r, rows, n, <float>eps)
    else:
        with nogil:
            ax_layernorm_forward_f64(<double*>p_xx, <double*>p_w, <double*>p_b, <double*>p_yo,
                                     <double*>p_h, <double*>p_r, rows, n, eps)


def layernorm_backward(g, xhat, rstd, weight, dx, dweight, dbias):
    """LayerNorm's input gradient into ``dx``; with ``weight``, the parameter gradients summed into the zeroed
    ``dweight`` and ``dbias``."""
    dtype = kernel_dtype(xhat, "LayerNorm saved")
    cdef Py_ssize_t size = xhat.size, n = last_axis(xhat, "LayerNorm saved")
    cdef int64_t rows = size // n if n else 0
    cdef cnp.ndarray gg = checked(g, "LayerNorm gradient", dtype, size, False)
    cdef cnp.ndarray h = checked(xhat, "LayerNorm saved", dtype, -1, False)
    cdef cnp.ndarray r = checked(rstd, "LayerNorm saved rstd", dtype, rows, False)
    cdef cnp.ndarray w = None if weight is None else checked(weight, "LayerNorm weight", dtype, n, False)
    cdef cnp.ndarray out = checked(dx, "LayerNorm input gradient", dtype, size, True)
    cdef cnp.ndarray dw = None if weight is None else checked(dweight, "LayerNorm weight gradient", dtype, n, True)
    cdef cnp.ndarray db = None if weight is None else checked(dbias, "LayerNorm bias gradient", dtype, n, True)
    cdef vptr p_gg = pointer(gg), p_h = pointer(h), p_r = pointer(r), p_w = pointer(w), p_out = pointer(out)
    cdef vptr p_dw = pointer(dw), p_db = pointer(db)
    if dtype == np.float32:
        with nogil:
            ax_layernorm_backward_f32(<float*>p_gg, <float*>p_h, <float*>p_r, <float*>p_w,
                                      <float*>p_out, <float*>p_dw, <float*>p_db, rows, n)
    else:
        with nogil:
            ax_layernorm_backward_f64(<double*>p_gg, <double*>p_h, <double*>p_r, <double*>p_w,
                                      <double*>p_out, <double*>p_dw, <double*>p_db, rows, n)


cdef void _check_targets(cnp.ndarray t, Py_ssize_t c, str what="cross-entropy targets") except *:
    cdef const int64_t* p = <const int64_t*>cnp.PyArray_DATA(t)
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(t)
    cdef int64_t lo = 0, hi = 0
    for i in range(n):
        if p[i] < lo or i == 0:
            lo = p[i]
        if p[i] > hi or i == 0:
            hi = p[i]
    if n and (lo < 0 or hi >= c):
        from axonhpc.errors import ShapeError

        raise ShapeError(f"{what} must be in [0, {c}), got values in [{lo}, {hi}]")


def cross_entropy_forward(x, targets, m, ls, picked):
    """Per row of logits ``x`` (rows, C): the maximum ``m``, ``ls = log(sum(exp(x - m)))`` and the target's
    log-probability ``picked = (x[target] - m) - ls``. ``targets``: int64, one per row, in [0, C)."""
    dtype = kernel_dtype(x, "logits")
    cdef Py_ssize_t size = x.size, c = last_axis(x, "logits")
    cdef int64_t rows = size // c if c else 0
    cdef cnp.ndarray xx = checked(x, "logits", dtype, -1, False)
    cdef cnp.ndarray t = checked(targets, "targets", _INT64, rows, False)
    cdef cnp.ndarray mo = checked(m, "row maxima", dtype, rows, True)
    cdef cnp.ndarray lo = checked(ls, "row log-sums", dtype, rows, True)
    cdef cnp.ndarray po = checked(picked, "targets' log-probabilities", dtype, rows, True)
    _check_targets(t, c)
    cdef vptr p_xx = pointer(xx), p_t = pointer(t), p_mo = pointer(mo), p_lo = pointer(lo), p_po = pointer(po)
    if dtype == np.float32:
        with nogil:
            ax_cross_entropy_forward_f32(<float*>p_xx, <int64_t*>p_t, <float*>p_mo, <float*>p_lo,
                                         <float*>p_po, rows, c)
    else:
        with nogil:
            ax_cross_entropy_forward_f64(<double*>p_xx, <int64_t*>p_t, <double*>p_mo,
                                         <double*>p_lo, <double*>p_po, rows, c)


def cross_entropy_backward(x, m, ls, targets, grad, double factor):
    """``grad = (exp((x - m) - ls) - one_hot(targets)) * factor`` per row of ``x`` (rows, C)."""
    dtype = kernel_dtype(x, "logits")
    cdef Py_ssize_t size = x.size, c = last_axis(x, "logits")
    cdef int64_t rows = size // c if c else 0
    cdef cnp.ndarray xx = checked(x, "logits", dtype, -1, False)
    cdef cnp.ndarray mo = checked(m, "row maxima", dtype, rows, False)
    cdef cnp.ndarray lo = checked(ls, "row log-sums", dtype, rows, False)
    cdef cnp.ndarray t = checked(targets, "targets", _INT64, rows, False)
    cdef cnp.ndarray go = checked(grad, "logits' gradient", dtype, size, True)
    _check_targets(t, c)
    cdef vptr p_xx = pointer(xx), p_mo = pointer(mo), p_lo = pointer(lo), p_t = pointer(t), p_go = pointer(go)
    if dtype == np.float32:
        with nogil:
            ax_cross_entropy_backward_f32(<float*>p_xx, <float*>p_mo, <float*>p_lo, <int64_t*>p_t,
                                          <float*>p_go, rows, c, <float>factor)
    else:
        with nogil:
            ax_cross_entropy_backward_f64(<double*>p_xx, <double*>p_mo, <double*>p_lo,
                                          <int64_t*>p_t, <double*>p_go, rows, c, factor)


def scatter_add_rows(index, rows, out):
    """``out[index[i]] += rows[i]`` in order (numpy's ``add.at``): ``index`` int64 (n,), ``rows`` (n, W), ``out``
    (R, W), every index in [0, R)."""
    dtype = kernel_dtype(out, "scatter-add destination")
    cdef Py_ssize_t width = last_axis(out, "scatter-add destination")
    cdef Py_ssize_t n = index.size
    cdef cnp.ndarray o = checked(out, "scatter-add destination", dtype, -1, True)
    cdef cnp.ndarray i = checked(index, "scatter-add indices", _INT64, n, False)
    cdef cnp.ndarray r = checked(rows, "scatter-add rows", dtype, n * width, False)
    _check_targets(i, out.size // width if width else 0, "scatter-add indices")
    cdef vptr p_i = pointer(i), p_r = pointer(r), p_o = pointer(o)
    if dtype == np.float32:
        with nogil:
            ax_scatter_add_rows_f32(<int64_t*>p_i, <float*>p_r, <float*>p_o, n, width)
    else:
        with nogil:
            ax_scatter_add_rows_f64(<int64_t*>p_i, <double*>p_r, <double*>p_o, n, width)
