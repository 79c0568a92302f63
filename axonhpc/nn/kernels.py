"""The layers' element-wise work as one kernel each: activations, the cross-entropy loss and its gradient, bias+activation.

[Note: fused layer kernels]
On cupy every array operation is a launch and a pass over memory (the exact
GELU forward is about a hundred). Each function here does the same
operations in the same order and dtype in one ``ElementwiseKernel``, bit for
bit ([Note: exact fused kernels] in ``axonhpc.cuda.kernels``), with the same
saved state, so a backward may follow a forward taken either way.

[Note: the fused cross-entropy]
Per row the loss needs the max ``m``, ``s = sum(exp(x - m))`` and ``log(s)``.
Fused it is three launches, none writing N x C values (the array code: ten):
the row maxima, ``sum_exp`` (a reduction that never writes the terms) and
``cross_entropy_rows``. The one difference from the array code is the order
``s`` is summed in; only a GPU can say whether cupy folds both alike, so on
the tests' stand-in ``s`` is checked to a few ulp and the rest bit for bit.

[Note: host kernels]
On numpy the layers run the compiled kernels of ``axonhpc._ext._layers``: one
pass over memory, without the GIL, computing the array code's operations in
its order and type (constants rounded as numpy rounds them), so they agree
bit for bit wherever numpy's result depends only on that order. Two things
differ, by amounts the tests state: float32 ``exp`` and ``tanh`` are the
kernels' own vectorisable ones, and row sums use eight partial sums where
numpy sums pairwise. 16-bit floats, integers and non-contiguous arrays keep
the array code; ``takes_kernels(x)`` decides without device work, and
``settings.fused_kernels`` switches host and device kernels alike.
"""
from __future__ import annotations

import math
from typing import Any, List, Tuple

import numpy as np

from .._dtypes import array_module
from .._ext import host_modules
from ..cuda import kernels as cuda_kernels
from ..settings import settings
from .matmul import column_sums

INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_COEF = 0.044715


_HOST, _ = host_modules()


def takes_host_kernels(x: Any, *others: Any) -> bool:
    """Whether ``x`` and ``others`` take the compiled host kernels: numpy float32 or float64 arrays of one dtype,
    C-contiguous, while ``settings.fused_kernels`` is on (see [Note: host kernels])."""
    if type(x) is not np.ndarray or _HOST is None or not settings.fused_kernels:
        return False
    char = x.dtype.char
    if (char != "f" and char != "d") or not x.flags.c_contiguous:
        return False
    return all(type(o) is np.ndarray and o.dtype.char == char and o.flags.c_contiguous for o in others)


def takes_kernels(x: Any, *others: Any) -> bool:
    """Whether the layers' work on ``x`` (and ``others``, arrays of its type and dtype) runs as fused kernels:
    compiled host kernels for numpy arrays, device kernels for cupy arrays."""
    if type(x) is np.ndarray:
        return takes_host_kernels(x, *others)
    if not settings.fused_kernels or not cuda_kernels.serves(x):
        return False
    return all(type(o) is type(x) and o.dtype == x.dtype for o in others)


def _t(value: float) -> str:
    """A Python float as a C literal of type T: the double that round-trips, then rounded to T."""
    return f"((T){float(value)!r})"


def _rational(var: str, lead: float, num: Tuple[float, ...], den: Tuple[float, ...], steps: int) -> List[str]:
    """``num`` and ``den`` of one of the erf's rational functions of ``var``, as ``functional.erf`` runs them."""
    lines = [f"num = {_t(lead)} * {var};", f"den = {var};"]
    for i in range(steps):
        lines += [f"num = (num + {_t(num[i])}) * {var};", f"den = (den + {_t(den[i])}) * {var};"]
    return lines


def _erf_preamble() -> str:
    """``axonhpc_erf``: ``nn.functional.erf`` (Cody's rational erf) step for step, in T."""
    from .functional import ERF_A, ERF_B, ERF_C, ERF_D, ERF_P, ERF_Q, ERF_SQRPI, ERF_THRESH, ERF_XBIG

    lines = [
        "static __device__ T axonhpc_erf(T x) {",
        "T num, den;",
        "T y = fabs(x);",
        f"T z = y > {_t(ERF_THRESH)} ? {_t(ERF_THRESH)} : y;",
        "T zsq = z * z;",
        *_rational("zsq", ERF_A[4], ERF_A, ERF_B, 3),
        f"T small = z * (num + {_t(ERF_A[3])}) / (den + {_t(ERF_B[3])});",
        f"T w = y < {_t(ERF_THRESH)} ? {_t(ERF_THRESH)} : (y > {_t(4.0)} ? {_t(4.0)} : y);",
        *_rational("w", ERF_C[8], ERF_C, ERF_D, 7),
        f"T mid = (num + {_t(ERF_C[7])}) / (den + {_t(ERF_D[7])});",
        f"T v = y < {_t(4.0)} ? {_t(4.0)} : (y > {_t(ERF_XBIG)} ? {_t(ERF_XBIG)} : y);",
        f"T vsq = {_t(1.0)} / (v * v);",
        *_rational("vsq", ERF_P[5], ERF_P, ERF_Q, 4),
        f"T tail = ({_t(ERF_SQRPI)} - vsq * (num + {_t(ERF_P[4])}) / (den + {_t(ERF_Q[4])})) / v;",
        f"T u = y > {_t(4.0)} ? v : w;",
        f"T r = trunc(u * {_t(16.0)}) / {_t(16.0)};",
        f"T erfc = exp(-r * r) * exp(-(u - r) * (u + r)) * (y > {_t(4.0)} ? tail : mid);",
        f"T result = y <= {_t(ERF_THRESH)} ? small : {_t(1.0)} - erfc;",
        "return copysign(result, x);",
        "}",
    ]
    return "\n".join(lines)


def _relu_source() -> cuda_kernels.Source:
    # selects, as ReLU's array code: -inf * 0 would be NaN (and NaN passes, with its gradient, as in PyTorch)
    return "T x", "T y, bool mask", "mask = !(x <= (T)0);\ny = x < (T)0 ? (T)0 : x;", ""


def relu_forward(x: Any) -> Tuple[Any, Any]:
    """``(where(x < 0, +0, x), ~(x <= 0))`` in one kernel: ReLU's output and the mask its backward keeps."""
    if type(x) is np.ndarray:
        y, mask = np.empty_like(x), np.empty(x.shape, dtype=np.bool_)
        _HOST.relu_forward(x, None, y, mask)
        return y, mask
    return cuda_kernels.elementwise(array_module(x), "relu", (), _relu_source)(x)


def _gelu_forward_source(tanh_form: bool) -> cuda_kernels.Source:
    if tanh_form:  # t = tanh(sqrt(2/pi) (x + c x^3)); y = 0.5 x (1 + t)
        body = (f"aux = tanh({_t(SQRT_2_OVER_PI)} * (x + {_t(TANH_COEF)} * x * x * x));\n"
                f"y = {_t(0.5)} * x * ({_t(1.0)} + aux);")
        return "T x", "T y, T aux", body, ""
    body = (f"aux = {_t(0.5)} * ({_t(1.0)} + axonhpc_erf(x * {_t(INV_SQRT2)}));\n"  # the normal cdf
            "y = x * aux;")
    return "T x", "T y, T aux", body, _erf_preamble()


def gelu_forward(x: Any, tanh_form: bool) -> Tuple[Any, Any]:
    """GELU's output and what its backward keeps (the cdf, or the tanh of the tanh form), in one kernel."""
    if type(x) is np.ndarray:
        y, aux = np.empty_like(x), np.empty_like(x)
        _HOST.gelu_forward(x, None, x, y, aux, bool(tanh_form))
        return y, aux
    return cuda_kernels.elementwise(array_module(x), "gelu_forward", (bool(tanh_form),), _gelu_forward_source)(x)


def _bias_relu_source() -> cuda_kernels.Source:
    _, outputs, body, preamble = _relu_source()
    return "T pre, T bias", outputs, f"const T x = pre + bias;\n{body}", preamble


def bias_relu(pre: Any, bias: Any) -> Tuple[Any, Any]:
    """``relu_forward(pre + bias)`` in one kernel, bit for bit; the output is written over ``pre`` (a fresh product)."""
    xp = array_module(pre)
    mask = xp.empty(pre.shape, dtype=np.bool_)
    if xp is np:
        _HOST.relu_forward(pre, bias, pre, mask)
        return pre, mask
    return cuda_kernels.elementwise(xp, "bias_relu", (), _bias_relu_source)(pre, bias, pre, mask)


def _bias_gelu_source(tanh_form: bool) -> cuda_kernels.Source:
    _, outputs, body, preamble = _gelu_forward_source(tanh_form)
    return "T pre, T bias", f"{outputs}, T x", f"x = pre + bias;\n{body}", preamble


def bias_gelu(pre: Any, bias: Any, tanh_form: bool) -> Tuple[Any, Any, Any]:
    """``gelu_forward(pre + bias)`` in one kernel: output, saved state, and ``pre + bias`` (written over ``pre``)."""
    xp = array_module(pre)
    y, aux = xp.empty_like(pre), xp.empty_like(pre)
    if xp is np:
        _HOST.gelu_forward(pre, bias, pre, y, aux, bool(tanh_form))
        return y, aux, pre
    kernel = cuda_kernels.elementwise(xp, "bias_gelu", (bool(tanh_form),), _bias_gelu_source)
    return kernel(pre, bias, y, aux, pre)


def _gelu_backward_source(tanh_form: bool) -> cuda_kernels.Source:
    if tanh_form:
        body = (f"T inner = {_t(SQRT_2_OVER_PI)} * ({_t(1.0)} + {_t(3 * TANH_COEF)} * x * x);\n"
                f"dx = g * ({_t(0.5)} * ({_t(1.0)} + aux) + {_t(0.5)} * x * ({_t(1.0)} - aux * aux) * inner);")
    else:
        body = (f"T pdf = {_t(INV_SQRT_2PI)} * exp({_t(-0.5)} * x * x);\n"
                "dx = g * (aux + x * pdf);")
    return "T g, T x, T aux", "T dx", body, ""


def gelu_backward(grad_out: Any, x: Any, aux: Any, tanh_form: bool) -> Any:
    """d loss / d x of GELU from the forward's saved ``x`` and ``aux``, in one kernel."""
    if type(x) is np.ndarray:
        dx = np.empty_like(x)
        _HOST.gelu_backward(grad_out, x, aux, dx, bool(tanh_form))
        return dx
    kernel = cuda_kernels.elementwise(array_module(x), "gelu_backward", (bool(tanh_form),), _gelu_backward_source)
    return kernel(grad_out, x, aux)


def _tanh_backward_source() -> cuda_kernels.Source:
    return "T g, T y", "T dx", f"dx = g * ({_t(1.0)} - y * y);", ""


def tanh_backward(grad_out: Any, y: Any) -> Any:
    """``grad_out * (1 - y * y)`` in one kernel (``y`` is tanh's output)."""
    if type(y) is np.ndarray:
        dx = np.empty_like(y)
        _HOST.tanh_backward(grad_out, y, dx)
        return dx
    return cuda_kernels.elementwise(array_module(y), "tanh_backward", (), _tanh_backward_source)(grad_out, y)


def _sum_exp_source() -> cuda_kernels.ReductionSource:
    return "T x, T m", "T s", "exp(x - m)", "a + b", "s = a", "0", "T"


def sum_exp(x: Any, m: Any) -> Any:
    """``sum(exp(x - m), axis=-1, keepdims=True)`` in one reduction that never writes the terms."""
    kernel = cuda_kernels.reduction(array_module(x), "sum_exp", (), _sum_exp_source)
    return kernel(x, m, axis=-1, keepdims=True)


def _cross_entropy_rows_source() -> cuda_kernels.Source:
    body = ("ls = log(s);\n"
            "const long long t = target < 0 ? 0 : (target >= classes ? classes - 1 : (long long)target);\n"
            "picked = (x[i * classes + t] - m) - ls;")
    return "raw T x, T m, T s, L target, int64 classes", "T ls, T picked", body, ""


def cross_entropy_rows(x: Any, m: Any, s: Any, targets: Any) -> Tuple[Any, Any]:
    """``(log(s), log_softmax(x)[row, target])`` per row, in one kernel (targets read clipped; the caller checks them)."""
    kernel = cuda_kernels.elementwise(array_module(x), "cross_entropy_rows", (), _cross_entropy_rows_source)
    n, c = x.shape
    return kernel(x, m.reshape(n), s.reshape(n), targets, int(c))


def _cross_entropy_source(device_scale: bool) -> cuda_kernels.Source:
    scale = "scale[0]" if device_scale else "scale"
    body = ("T e = exp((x - m) - ls);\n"
            "if (i % classes == target) e = e - (T)1;\n"
            f"grad = e * {scale};")
    return (f"T x, T m, T ls, L target, int64 classes, {'raw T' if device_scale else 'T'} scale", "T grad", body,
            "")


def cross_entropy_grad(x: Any, m: Any, ls: Any, targets: Any, scale: Any) -> Any:
    """``(exp((x - m) - ls) - one_hot(targets)) * scale`` in one kernel.

    ``scale``: a float, or a one-element device array read by the kernel (a graph replays its current value).
    """
    xp = array_module(x)
    device_scale = not isinstance(scale, (int, float))
    kernel = cuda_kernels.elementwise(xp, "cross_entropy_grad", (device_scale,), _cross_entropy_source)
    scale = scale.reshape(1) if device_scale else x.dtype.type(scale)
    return kernel(x, m, ls, targets.reshape(-1, 1), int(x.shape[-1]), scale)


# [Note: fused LayerNorm and softmax on the device]
# The array code of a LayerNorm is ten launches forward and eleven backward, of an attention's softmax about
# ten forward and five backward, most over the whole activation. Fused, as the cross-entropy is:
# - LayerNorm forward, 3: the row means (cupy's ``mean``, the array code's own), ``rstd`` from a reduction of
#   the squared deviations that never writes them, and one kernel for ``xhat`` and the affine output;
# - LayerNorm backward, 5 with the affine parameters (3 without): the bias gradient (the array code's sum),
#   the weight gradient and the two row means of the formula as reductions of products, and one kernel for dx;
# - softmax forward, 4: the scores scaled and masked, the row maxima (cupy's ``max``), ``sum_exp``, and one
#   kernel for ``exp(x - m) / s``; backward, 2: the row sums of ``dattn * attn`` and one kernel.
# Every element-wise kernel is the array code's operations in its order and dtype, bit for bit; a reduction
# folds in its own order, so what follows a row sum may differ from the array code in the last bits.


def _scale_mask_source(causal: bool) -> cuda_kernels.Source:
    if not causal:
        return "T x, T scale, T neg_inf, int64 cols", "T y", "y = x * scale;", ""
    body = ("const long long col = i % cols;\n"
            "const long long row = (i / cols) % cols;\n"
            "y = col > row ? neg_inf : x * scale;")
    return "T x, T scale, T neg_inf, int64 cols", "T y", body, ""


def _softmax_rows_source() -> cuda_kernels.Source:
    return "T x, T m, T s", "T y", "y = exp(x - m) / s;", ""


def _softmax_grad_source() -> cuda_kernels.Source:
    return "T p, T d, T r, T scale", "T g", "g = (p * (d - r)) * scale;", ""


def _sum_product_source() -> cuda_kernels.ReductionSource:
    return "T u, T v", "T s", "u * v", "a + b", "s = a", "0", "T"


def _mean_product_source(factors: int) -> cuda_kernels.ReductionSource:
    params, product = (("T u, T v, T count", "u * v") if factors == 2 else
                       ("T u, T v, T w, T count", "(u * v) * w"))
    return params, "T m", product, "a + b", "m = a / count", "0", "T"


def _rstd_source() -> cuda_kernels.ReductionSource:
    return ("T x, T mean, T count, T eps", "T rstd", "(x - mean) * (x - mean)", "a + b",
            "rstd = (T)1 / sqrt(a / count + eps)", "0", "T")


def _normalize_source(affine: bool) -> cuda_kernels.Source:
    if not affine:
        return "T x, T mean, T rstd", "T xhat", "xhat = (x - mean) * rstd;", ""
    return "T x, T mean, T rstd, T w, T b", "T xhat, T y", "xhat = (x - mean) * rstd;\ny = xhat * w + b;", ""


def _layer_norm_dx_source(affine: bool) -> cuda_kernels.Source:
    if not affine:
        return "T g, T xhat, T rstd, T m1, T m2", "T dx", "dx = rstd * ((g - m1) - xhat * m2);", ""
    return "T g, T w, T xhat, T rstd, T m1, T m2", "T dx", "dx = rstd * ((g * w - m1) - xhat * m2);", ""


def _rows(xp: Any, name: str, variant: Tuple[Any, ...], build: Any, *args: Any) -> Any:
    """The reduction ``name`` of ``args`` along their last axis, kept as a column (..., 1)."""
    return cuda_kernels.reduction(xp, name, variant, build)(*args, axis=-1, keepdims=True)


def softmax_forward(scores: Any, scale: float, causal: bool) -> Any:
    """``softmax(scores * scale)`` along the last axis of ``scores`` (..., T, T), each query's future masked out
    when ``causal`` (``takes_kernels(scores)`` holds). Host arrays: in place, one pass; device arrays: four
    launches ([Note: fused LayerNorm and softmax on the device])."""
    if type(scores) is np.ndarray:
        _HOST.softmax_forward(scores, float(scale), bool(causal))
        return scores
    xp, dtype = array_module(scores), scores.dtype.type
    masked = cuda_kernels.elementwise(xp, "scale_mask", (bool(causal),), _scale_mask_source)(
        scores, dtype(scale), dtype(-np.inf), int(scores.shape[-1]))
    m = masked.max(axis=-1, keepdims=True)
    s = sum_exp(masked, m)
    return cuda_kernels.elementwise(xp, "softmax_rows", (), _softmax_rows_source)(masked, m, s)


def softmax_backward(attn: Any, dattn: Any, scale: float) -> Any:
    """``attn * (dattn - sum(dattn * attn)) * scale`` along the last axis: host arrays written over ``dattn``,
    device arrays in two launches."""
    if type(attn) is np.ndarray:
        _HOST.softmax_backward(attn, dattn, dattn, float(scale))
        return dattn
    xp = array_module(attn)
    r = _rows(xp, "sum_product", (), _sum_product_source, dattn, attn)
    return cuda_kernels.elementwise(xp, "softmax_grad", (), _softmax_grad_source)(attn, dattn, r,
                                                                                   attn.dtype.type(scale))


def layer_norm_forward(x: Any, weight: Any, bias: Any, eps: float) -> Tuple[Any, Any, Any]:
    """LayerNorm of ``x`` over its last axis: ``(y, xhat, rstd)``, ``rstd`` shaped (..., 1), ``y`` None without
    ``weight``. Host arrays: one pass a row; device arrays: three launches."""
    if type(x) is not np.ndarray:
        xp, dtype = array_module(x), x.dtype.type
        mean = x.mean(axis=-1, keepdims=True)
        rstd = _rows(xp, "layer_norm_rstd", (), _rstd_source, x, mean, dtype(x.shape[-1]), dtype(eps))
        kernel = cuda_kernels.elementwise(xp, "layer_norm", (weight is not None,), _normalize_source)
        if weight is None:
            return None, kernel(x, mean, rstd), rstd
        xhat, y = kernel(x, mean, rstd, weight, bias)
        return y, xhat, rstd
    xhat = np.empty_like(x)
    rstd = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    y = None if weight is None else np.empty_like(x)
    _HOST.layernorm_forward(x, weight, bias, y, xhat, rstd, float(eps))
    return y, xhat, rstd


def layer_norm_backward(grad_out: Any, xhat: Any, rstd: Any, weight: Any) -> Tuple[Any, Any, Any]:
    """LayerNorm's ``(dx, dweight, dbias)`` (the last two None without ``weight``). Host arrays: one pass;
    device arrays: four launches and two column-sum GEMMs with ``weight``, three launches without."""
    if type(grad_out) is not np.ndarray:
        return _layer_norm_backward_device(grad_out, xhat, rstd, weight)
    dx = np.empty_like(grad_out)
    dweight = dbias = None
    if weight is not None:
        dweight, dbias = np.zeros_like(weight), np.zeros_like(weight)
    _HOST.layernorm_backward(grad_out, xhat, rstd, weight, dx, dweight, dbias)
    return dx, dweight, dbias


def _layer_norm_backward_device(g: Any, xhat: Any, rstd: Any, weight: Any) -> Tuple[Any, Any, Any]:
    xp, n = array_module(g), g.dtype.type(g.shape[-1])
    affine = weight is not None
    dweight = dbias = None
    if affine:
        # Column sums by GEMM ([Note: column sums by GEMM]): cupy's reductions over the leading axes read each
        # column down its stride; the product g * xhat is one element-wise pass.
        width = g.shape[-1]
        dbias = column_sums(g.reshape(-1, width))
        dweight = column_sums((g * xhat).reshape(-1, width))
        m1 = _rows(xp, "mean_product", (2,), _mean_product_source, g, weight, n)
        m2 = _rows(xp, "mean_product", (3,), _mean_product_source, g, weight, xhat, n)
        args = (g, weight, xhat, rstd, m1, m2)
    else:
        m1 = g.mean(axis=-1, keepdims=True)
        m2 = _rows(xp, "mean_product", (2,), _mean_product_source, g, xhat, n)
        args = (g, xhat, rstd, m1, m2)
    dx = cuda_kernels.elementwise(xp, "layer_norm_dx", (affine,), _layer_norm_dx_source)(*args)
    return dx, dweight, dbias


def cross_entropy_host(x: Any, targets: Any) -> Tuple[Any, Any, Any]:
    """Per row of host logits ``x`` (N, C) and int64 ``targets`` (N,): the maxima, the log-sums of
    ``exp(x - m)`` (both (N, 1)) and the targets' log-probabilities (N,)."""
    n = x.shape[0]
    m, ls, picked = np.empty((n, 1), x.dtype), np.empty((n, 1), x.dtype), np.empty(n, x.dtype)
    _HOST.cross_entropy_forward(x, targets, m, ls, picked)
    return m, ls, picked


def cross_entropy_grad_host(x: Any, m: Any, ls: Any, targets: Any, scale: float) -> Any:
    """``(exp((x - m) - ls) - one_hot(targets)) * scale`` for host arrays, as ``cross_entropy_grad``."""
    grad = np.empty_like(x)
    _HOST.cross_entropy_backward(x, m, ls, targets, grad, float(scale))
    return grad


def scatter_add_rows(out: Any, index: Any, rows: Any) -> None:
    """``out[index[i]] += rows[i]`` in order, as numpy's ``add.at`` (host arrays; any integer ``index``)."""
    _HOST.scatter_add_rows(np.ascontiguousarray(index, dtype=np.int64), rows, out)


__all__ = ["takes_kernels", "takes_host_kernels", "softmax_forward", "softmax_backward", "layer_norm_forward",
           "layer_norm_backward", "cross_entropy_host", "cross_entropy_grad_host",
           "scatter_add_rows", "relu_forward", "bias_relu", "gelu_forward", "bias_gelu", "gelu_backward", "tanh_backward",
           "sum_exp", "cross_entropy_rows", "cross_entropy_grad"]
