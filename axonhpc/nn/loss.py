"""Losses: CrossEntropyLoss and MSELoss, means over the batch as in PyTorch.

A loss returns a Python float and keeps what it needs, so ``loss_fn.backward()``
returns d loss / d prediction to feed into ``model.backward``.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from .._dtypes import array_module, is_cupy_array, is_floating, is_low_precision_float
from ..cuda import capture
from ..errors import ShapeError, UnsupportedDtypeError
from . import kernels
from .module import Module


def _working_dtype(x: Any):
    """float16 and bfloat16 are widened to float32 for the reduction; other floats are kept."""
    return "float32" if is_low_precision_float(x.dtype) else x.dtype


def _check_grad_output(grad_output: Any) -> None:
    """ShapeError for an array ``grad_output`` (host or device) of other than one element, which would broadcast
    against the gradient's last axis instead of scaling it; checked before the backward takes the cache."""
    if hasattr(grad_output, "shape") and grad_output.size != 1:
        where = "device" if is_cupy_array(grad_output) else "host"
        raise ShapeError(f"a loss's grad_output must be a number or a one-element {where} array, got shape "
                         f"{tuple(grad_output.shape)}")


def _grad_factor(grad_output: Any, numerator: float, count: int, dtype: Any) -> Any:
    """``numerator * grad_output / count``, the factor of a loss gradient.

    A device ``grad_output`` (a one-element cupy array: a graphed step's loss scale) gives a 0-d device array
    computed in float64 as the host computes it and rounded once, so both give the same gradient bit for bit.
    ``grad_output`` has passed ``_check_grad_output``.
    """
    if not is_cupy_array(grad_output):
        if hasattr(grad_output, "shape"):
            grad_output = grad_output.reshape(())  # (1,) or (1, 1) would change the gradient's shape
        return numerator * grad_output / count
    return ((grad_output.reshape(()).astype(np.float64, copy=False) * numerator) / count).astype(dtype)


class CrossEntropyLoss(Module):
    """Mean over the batch of -log softmax(logits)[target].

    ``loss_fn(logits, targets)`` takes logits (N, C), or (..., C) such as a language model's (B, T, V), and
    integer class indices of the logits' shape without C, and returns the mean over every position as a float;
    ``loss_fn.backward()`` returns (softmax(logits) - one_hot(targets)) / N in the logits' dtype and shape.

    It keeps the logits themselves (a float32 copy of 16-bit ones), the row maxima and the log row sums until
    ``backward``, not the log-probabilities, so logits changed in place in between change the gradient.
    """

    takes_arrays = True

    def forward(self, logits: Any, targets: Any) -> float:
        """The mean loss as a Python float (inside a graphed step, a 0-d float64 device array).

        Inside a graphed step the targets' range is checked once the step has run. Raises ShapeError for targets not
        of the logits' shape without the last axis, no position, or a target outside [0, C); UnsupportedDtypeError
        for non-integer targets or non-floating logits.
        """
        xp = array_module(logits)
        targets = xp.asarray(targets)
        if logits.ndim < 2 or tuple(targets.shape) != tuple(logits.shape[:-1]) or targets.size == 0:
            raise ShapeError(f"CrossEntropyLoss expects logits (N, C) or (..., C) and targets of the logits' shape "
                             f"without C, with at least one position; got {tuple(logits.shape)} and "
                             f"{tuple(targets.shape)}")
        if targets.dtype.kind not in "iu":
            raise UnsupportedDtypeError(f"CrossEntropyLoss targets must be integer class indices, got dtype {targets.dtype}")
        if not is_floating(logits.dtype):
            raise UnsupportedDtypeError(f"CrossEntropyLoss logits must be floating point, got dtype {logits.dtype} "
                                        f"(cast them, e.g. logits.astype(numpy.float32))")
        c, shape = logits.shape[-1], logits.shape
        flat = logits.reshape(-1, c)
        fused = kernels.takes_kernels(flat) and targets.dtype.kind == "i" and flat.flags.c_contiguous
        x = flat.astype(_working_dtype(logits), copy=False)
        if kernels.takes_host_kernels(x):
            return self._host_forward(x, targets.reshape(-1), logits.dtype, shape)
        targets = targets.reshape(-1)
        m = x.max(axis=-1, keepdims=True)
        if fused:  # [Note: the fused cross-entropy] in nn.kernels
            ls, picked = kernels.cross_entropy_rows(x, m, kernels.sum_exp(x, m), targets)
            ls = ls.reshape(-1, 1)
        else:
            terms = x - m
            ls = xp.log(xp.sum(xp.exp(terms, out=terms), axis=-1, keepdims=True))
        cache = (x, m, ls, targets, logits.dtype, shape)
        if is_cupy_array(x):
            # One read for the loss and the targets' range (each read waits for the device): the
            # gather takes clipped targets, and the range is checked once it is read.
            if not fused:
                rows = xp.arange(x.shape[0])
                picked = (x[rows, xp.clip(targets, 0, c - 1)] - m[:, 0]) - ls[:, 0]
            values = xp.stack([(-picked.mean()).astype(np.float64), targets.min().astype(np.float64),
                               targets.max().astype(np.float64)])
            if capture.defers_reads():
                capture.defer_check(values, lambda v: self._check_range(v[1], v[2], c))
                self._save_cache(cache)
                return values[0]
            loss, lo, hi = values.get().tolist()
        else:  # host reads cost nothing: check before the gather, skip the clip
            lo, hi = int(targets.min()), int(targets.max())
            rows = np.arange(x.shape[0])
            loss = None if lo < 0 or hi >= c else float(-((x[rows, targets] - m[:, 0]) - ls[:, 0]).mean())
        self._check_range(lo, hi, c)
        self._save_cache(cache)
        return loss

    def _host_forward(self, x: Any, targets: Any, dtype: Any, shape: Tuple[int, ...]) -> float:
        """The loss of host logits ``x`` (N, C) in one pass a row ([Note: host kernels] in ``nn.kernels``)."""
        lo, hi = int(targets.min()), int(targets.max())
        self._check_range(lo, hi, x.shape[1])
        targets = np.ascontiguousarray(targets, dtype=np.int64)
        m, ls, picked = kernels.cross_entropy_host(x, targets)
        self._save_cache((x, m, ls, targets, dtype, shape))
        return float(-picked.mean())

    @staticmethod
    def _check_range(lo: float, hi: float, c: int) -> None:
        if lo < 0 or hi >= c:
            raise ShapeError(f"CrossEntropyLoss targets must be in [0, {c}), got values in [{int(lo)}, {int(hi)}]")

    def backward(self, grad_output: Any = 1.0) -> Any:
        """d loss / d logits (the logits' shape), times ``grad_output``.

        ``grad_output``: a number (1/M for M accumulated micro-batches, or the loss scale), or a one-element array
        (``GradScaler.scale(1.0)`` inside a graphed step is a device one); ShapeError for an array of another size.
        """
        _check_grad_output(grad_output)
        x, m, ls, targets, dtype, shape = self._pop_cache()
        factor = _grad_factor(grad_output, 1.0, x.shape[0], x.dtype)
        if kernels.takes_host_kernels(x, m, ls) and targets.dtype == np.int64 and isinstance(factor, float):
            return kernels.cross_entropy_grad_host(x, m, ls, targets, factor).astype(dtype, copy=False).reshape(shape)
        if (kernels.takes_kernels(x, m, ls) and x.dtype == dtype and targets.dtype.kind == "i"
                and (isinstance(grad_output, (int, float)) or is_cupy_array(factor))):
            return kernels.cross_entropy_grad(x, m, ls, targets, factor).reshape(shape)
        xp = array_module(x)
        grad = x - m
        grad -= ls
        xp.exp(grad, out=grad)
        grad[xp.arange(x.shape[0]), targets] -= 1
        grad *= factor
        return grad.astype(dtype, copy=False).reshape(shape)


class MSELoss(Module):
    """Mean over all elements of (prediction - target)^2."""

    takes_arrays = True

    def forward(self, prediction: Any, target: Any) -> float:
        """The mean squared error as a Python float (inside a graphed step, a 0-d device array).

        ShapeError if the shapes differ (no broadcasting, which hides bugs) or are empty.
        """
        xp = array_module(prediction)
        target = xp.asarray(target)
        if tuple(prediction.shape) != tuple(target.shape) or prediction.size == 0:
            raise ShapeError(f"MSELoss needs non-empty prediction and target of one shape, got "
                             f"{tuple(prediction.shape)} and {tuple(target.shape)}")
        diff = prediction.astype(_working_dtype(prediction), copy=False) - target
        self._save_cache((diff, prediction.dtype))
        loss = (diff * diff).mean()
        return loss if capture.defers_reads() and is_cupy_array(loss) else float(loss)

    def backward(self, grad_output: Any = 1.0) -> Any:
        """d loss / d prediction = 2 (prediction - target) / numel, times ``grad_output`` (as for cross-entropy:
        a number or a one-element array, else ShapeError)."""
        _check_grad_output(grad_output)
        diff, dtype = self._pop_cache()
        return (diff * _grad_factor(grad_output, 2.0, diff.size, diff.dtype)).astype(dtype, copy=False)


__all__ = ["CrossEntropyLoss", "MSELoss"]
