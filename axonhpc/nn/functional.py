"""Stateless array math shared by the layers: erf, softmax, log_softmax.

Everything dispatches on the input's array module, so the same code runs on
numpy and cupy arrays.

[Note: erf without scipy]
numpy has no erf, and ``math.erf`` applied element by element is slow and
host-only. ``erf`` below is W. J. Cody's rational Chebyshev approximation
(Math. Comp. 23, 1969; the SPECFUN ``CALERF`` routine, also behind many C
libraries): three rational functions on |x| <= 0.46875, (0.46875, 4] and
(4, inf), with exp(-x^2) evaluated in two factors to keep its relative
accuracy. In float64 it agrees with ``math.erf`` to about 1e-16 (a few ulp);
in float32 it is as accurate as float32 allows (~1e-7). All three branches
are evaluated on the whole array and selected with ``where``, which keeps
the code free of boolean indexing (and of device synchronisation on GPUs).
"""
from __future__ import annotations

from typing import Any

from .._dtypes import array_module, is_floating, is_low_precision_float

# Cody's constants, shared with ``nn.kernels``' device erf.
ERF_THRESH = 0.46875
ERF_SQRPI = 5.6418958354775628695e-1  # 1 / sqrt(pi)
# erfc(x) < 1e-300 beyond this, so larger |x| can be clamped without changing erf.
ERF_XBIG = 27.0

ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
         3.20937758913846947e03, 1.85777706184603153e-1)
ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
         2.84423683343917062e03)
ERF_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
         2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
         2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
ERF_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
         1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
         3.43936767414372164e03, 1.23033935480374942e03)
ERF_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
         1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
ERF_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
         6.05183413124413191e-2, 2.33520497626869185e-3)


def _compute_dtype(x: Any):
    """float64 for integers, float32 for float16 and bfloat16 (too coarse for the polynomials)."""
    if is_low_precision_float(x.dtype):
        return "float32"
    if x.dtype.kind != "f":
        return "float64"
    return x.dtype


def erf(x: Any) -> Any:
    """The error function, element-wise, for numpy or cupy arrays.

    Args:
        x: array (integers are computed in float64, float16 and bfloat16 in float32).

    Returns:
        erf(x) with the floating dtype of ``x`` (float64 for integer input).
        Accuracy: about 1e-16 relative in float64, about 1e-7 in float32.
    """
    xp = array_module(x)
    x = xp.asarray(x)
    out_dtype = x.dtype if is_floating(x.dtype) else "float64"
    x = x.astype(_compute_dtype(x), copy=False)
    y = xp.abs(x)

    # |x| <= 0.46875: erf(y) = y * A(y^2) / B(y^2).
    z = xp.minimum(y, ERF_THRESH)
    zsq = z * z
    num = ERF_A[4] * zsq
    den = zsq
    for i in range(3):
        num = (num + ERF_A[i]) * zsq
        den = (den + ERF_B[i]) * zsq
    small = z * (num + ERF_A[3]) / (den + ERF_B[3])

    # 0.46875 < |x| <= 4: erfc(y) = exp(-y^2) * C(y) / D(y).
    w = xp.clip(y, ERF_THRESH, 4.0)
    num = ERF_C[8] * w
    den = w
    for i in range(7):
        num = (num + ERF_C[i]) * w
        den = (den + ERF_D[i]) * w
    mid = (num + ERF_C[7]) / (den + ERF_D[7])

    # |x| > 4: erfc(y) = exp(-y^2) / y * (1/sqrt(pi) + P(1/y^2) / (y^2 Q(1/y^2))).
    v = xp.clip(y, 4.0, ERF_XBIG)
    vsq = 1.0 / (v * v)
    num = ERF_P[5] * vsq
    den = vsq
    for i in range(4):
        num = (num + ERF_P[i]) * vsq
        den = (den + ERF_Q[i]) * vsq
    tail = (ERF_SQRPI - vsq * (num + ERF_P[4]) / (den + ERF_Q[4])) / v

    # exp(-u^2) as exp(-r^2) * exp(-(u - r)(u + r)) with r = u rounded down to 1/16:
    # r^2 is exact, so the large exponent loses no bits.
    u = xp.where(y > 4.0, v, w)
    r = xp.trunc(u * 16.0) / 16.0
    erfc = xp.exp(-r * r) * xp.exp(-(u - r) * (u + r)) * xp.where(y > 4.0, tail, mid)
    result = xp.where(y <= ERF_THRESH, small, 1.0 - erfc)
    return xp.copysign(result, x).astype(out_dtype, copy=False)


def softmax(x: Any, axis: int = -1) -> Any:
    """Softmax along ``axis``, shifted by the maximum so exp cannot overflow.

    Args:
        x: floating array.
        axis: the axis that sums to one.

    Returns:
        Array of the shape and dtype of ``x``.
    """
    xp = array_module(x)
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    e /= xp.sum(e, axis=axis, keepdims=True)
    return e


def log_softmax(x: Any, axis: int = -1) -> Any:
    """log(softmax(x)) along ``axis``, computed stably as x - max - log(sum(exp(x - max))).

    Args:
        x: floating array.
        axis: the normalised axis.

    Returns:
        Array of the shape and dtype of ``x``.
    """
    xp = array_module(x)
    z = x - xp.max(x, axis=axis, keepdims=True)
    return z - xp.log(xp.sum(xp.exp(z), axis=axis, keepdims=True))


__all__ = ["erf", "softmax", "log_softmax"]
