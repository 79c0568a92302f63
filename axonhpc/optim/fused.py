"""Fused optimizer updates: one kernel for the parameters instead of one per operation, on a GPU and on the host.

[Note: fused updates]
On cupy each array operation is a launch and a pass over memory: Adam moves 31 arrays' worth per parameter
where one kernel needs 7. Each update here is one kernel that is the array code bit for bit ([Note: exact
fused kernels] in ``axonhpc.cuda.kernels``); parameters of one dtype and equal scalars share one multi-tensor
launch (``joins``). 16-bit floats and ``fused=False`` keep the array code.

[Note: host updates]
On numpy the kernels are the compiled ``_ext._updates``: a dtype's parameters in one call without the GIL,
each element read and written once, in the array code's order with numpy's rounding and no fused
multiply-add, so bit for bit.

[Note: updates in a CUDA graph]
In a captured step the scalars live in device memory; before every replay the optimizer advances the step
counts and recomputes them from the current hyperparameters (so schedules keep working). What a graph cannot
replay is refused at capture, as is a hyperparameter change that would select another kernel.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import array_module
from .._ext import host_modules
from ..cuda import capture, kernels as cuda_kernels
from ..errors import ConfigurationError, GraphCaptureError
from ..settings import settings


def _refusal(data: Any) -> Optional[str]:
    """Why the kernels do not serve ``data``, or None when they do."""
    if type(data) is np.ndarray:
        if host_modules()[1] is None:
            return ("is a host array and the compiled host kernels are not built (python setup.py build_ext "
                    "--inplace)")
        if not data.flags.c_contiguous:
            return "is a host array that is not C-contiguous (the host kernels take C-contiguous arrays)"
    elif not cuda_kernels.has_kernels(array_module(data)):
        return f"is a {type(data).__name__} (fused kernels are for numpy and cupy arrays)"
    if np.dtype(data.dtype) not in cuda_kernels.KERNEL_DTYPES:
        return f"has dtype {np.dtype(data.dtype).name} (fused kernels are for float32 and float64)"
    return None


def _all_contiguous(arrays: Sequence[Any]) -> bool:
    """Whether ``arrays`` (None skipped) are all C-contiguous, as host kernels and multi-tensor launches need."""
    return all(a is None or a.flags.c_contiguous for a in arrays)


def check_fused(fused: Optional[bool], params: Any, owner: str) -> Optional[bool]:
    """Validate an optimizer's ``fused`` argument against its parameters; returns it (else ConfigurationError)."""
    if fused is not None and not isinstance(fused, (bool, np.bool_)):
        raise ConfigurationError(f"{owner} fused must be None, True or False, got {fused!r}")
    if fused:
        for i, p in enumerate(params):
            reason = _refusal(p.data)
            if reason is not None:
                raise ConfigurationError(f"{owner}(fused=True): parameter {i} of shape {tuple(p.data.shape)} "
                                         f"{reason}; pass fused=None to fuse where possible, or fused=False")
    return None if fused is None else bool(fused)


def fuses(fused: Optional[bool], data: Any, grad: Any, *state: Any) -> bool:
    """Whether this step updates ``data`` with the fused kernel; ConfigurationError if ``fused=True`` and it cannot."""
    if fused is False or (fused is None and not settings.fused_kernels):
        return False
    reason = _refusal(data)
    if reason is None and (type(grad) is not type(data) or grad.dtype != data.dtype or grad.shape != data.shape):
        reason = (f"has a gradient of another kind ({type(grad).__name__} of {np.dtype(grad.dtype).name}, "
                  f"shape {tuple(grad.shape)})")
    if reason is None and type(data) is np.ndarray and not _all_contiguous((grad,) + state):
        reason = "has a gradient or optimizer state that is not C-contiguous (the host kernels need C-contiguous)"
    if reason is not None and fused:
        raise ConfigurationError(f"fused=True: a parameter of shape {tuple(data.shape)} {reason}")
    return reason is None


def joins(fused: Optional[bool], data: Any, grad: Any, *state: Any) -> bool:
    """Whether ``data`` is updated with the others in one multi-tensor launch: ``fuses``, and every array C-contiguous."""
    return (fuses(fused, data, grad, *state) and data.flags.c_contiguous and grad.flags.c_contiguous
            and _all_contiguous(state))


def _host_updates() -> Any:
    """``axonhpc._ext._updates`` (``fuses`` has refused host arrays where it is not built)."""
    return host_modules()[1]


def _adam_source(l2: bool, decoupled: bool) -> cuda_kernels.Source:
    """Adam's update in the order of ``Adam._update`` (torch's): lerp, second moment, denominator, step."""
    lines = []
    if l2:
        lines.append("T g = grad + weight_decay * param;")
    else:
        lines.append("T g = grad;")
    if decoupled:
        lines.append("param = param * decay;")
    lines += [
        "T d = g - exp_avg;",  # torch's lerp, two-sided (exact where 1 - beta1 is 1)
        "exp_avg = one_minus_beta1 < (T)0.5 ? exp_avg + d * one_minus_beta1 : g - d * ((T)1 - one_minus_beta1);",
        "exp_avg_sq = exp_avg_sq * beta2;",
        "exp_avg_sq = exp_avg_sq + (g * one_minus_beta2) * g;",  # torch's addcmul_: value * g first
        "T denom = sqrt(exp_avg_sq) / sqrt_bias_correction2;",
        "denom = denom + eps;",
        "T update = exp_avg * step_size;",  # torch's addcdiv_: value * m, then / denom
        "update = update / denom;",
        "param = param - update;",
    ]
    return ("T grad, T weight_decay, T decay, T one_minus_beta1, T beta2, T one_minus_beta2, "
            "T sqrt_bias_correction2, T eps, T step_size",
            "T param, T exp_avg, T exp_avg_sq", "\n".join(lines), "")


def adam_scalars(t: Any, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: int) -> tuple:
    """Adam's kernel scalars at ``step``, in the kernel's order, of the parameters' scalar type ``t``."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    return (t(weight_decay), t(1 - lr * weight_decay), t(1 - beta1), t(beta2), t(1 - beta2),
            t(math.sqrt(bias_correction2)), t(eps), t(lr / bias_correction1))


def adam_variant(weight_decay: float, decoupled: bool) -> Tuple[bool, bool]:
    """The flags that select Adam's kernel: L2 added to the gradient, decoupled decay."""
    return (weight_decay != 0 and not decoupled, weight_decay != 0 and decoupled)


def adam(xp: Any, data: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, *, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, decoupled: bool, step: int) -> None:
    """One Adam/AdamW update of ``data`` and its moments in place, in one kernel (see the module note)."""
    variant = adam_variant(weight_decay, decoupled)
    if xp is np:
        _host_updates().adam_many([data], [grad], [exp_avg], [exp_avg_sq],
                                  adam_scalars(data.dtype.type, lr, beta1, beta2, eps, weight_decay, step), *variant)
        return
    kernel = cuda_kernels.elementwise(xp, "adam", variant, _adam_source)
    kernel(grad, *adam_scalars(data.dtype.type, lr, beta1, beta2, eps, weight_decay, step), data, exp_avg,
           exp_avg_sq)


def adam_many(xp: Any, tables: cuda_kernels.TensorTables, datas: Sequence[Any], grads: Sequence[Any],
              exp_avgs: Sequence[Any], exp_avg_sqs: Sequence[Any], *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, decoupled: bool, step: int) -> None:
    """``adam`` for many parameters of one dtype and step count, one launch for all (``tables``: the optimizer's)."""
    variant = adam_variant(weight_decay, decoupled)
    lists = (grads, datas, exp_avgs, exp_avg_sqs)
    scalars = adam_scalars(datas[0].dtype.type, lr, beta1, beta2, eps, weight_decay, step)
    if xp is np:
        _host_updates().adam_many(datas, grads, exp_avgs, exp_avg_sqs, scalars, *variant)
        return
    _many(xp, tables, "adam", variant, _adam_source, lists, scalars,
          lambda k: adam(xp, datas[k], grads[k], exp_avgs[k], exp_avg_sqs[k], lr=lr, beta1=beta1, beta2=beta2,
                         eps=eps, weight_decay=weight_decay, decoupled=decoupled, step=step))


def _many(xp: Any, tables: cuda_kernels.TensorTables, name: str, variant: tuple, build: Any,
          lists: Sequence[Sequence[Any]], scalars: tuple, alone: Any = None, device_scalars: bool = False) -> None:
    """One multi-tensor launch per batch of ``lists``' arrays (``alone(k)``, if given, updates a batch of one)."""
    dtype = lists[0][0].dtype
    for batch in cuda_kernels.batches([int(a.size) for a in lists[0]]):
        chosen = [[arrays[k] for k in batch] for arrays in lists]
        key = (name, len(lists), dtype, tuple(batch))
        if alone is not None and len(batch) == 1:
            alone(batch[0])
            if capture.in_graphed_step():  # a graphed step's warm-up: its capture updates this one through the
                tables.tables(xp, key, chosen)  # tables, which it cannot copy to the device itself
            continue
        kernel = cuda_kernels.multi_tensor(xp, name, variant, build, ("grad",), dtype, device_scalars=device_scalars)
        cuda_kernels.launch_multi(xp, kernel, tables, key, chosen, scalars)


def captured_groups(fused: Optional[bool], pending: Sequence[Tuple[Any, Dict[str, Any]]], owner: str,
                    state_arrays: Callable[[Dict[str, Any]], Tuple[Any, ...]],
                    has_state: Callable[[Dict[str, Any]], bool],
                    key: Callable[[Dict[str, Any]], Any]) -> Dict[Tuple[Any, Any], List[Tuple[Any, Dict[str, Any]]]]:
    """The ``(parameter, state)`` pairs of a captured step by ``(dtype, key(state))``; GraphCaptureError if not capturable."""
    groups: Dict[Tuple[Any, Any], List[Tuple[Any, Dict[str, Any]]]] = {}
    for index, (p, state) in enumerate(pending):
        where = f"{owner}: parameter {index} of shape {tuple(p.data.shape)}"
        if not joins(fused, p.data, p.grad, *state_arrays(state)):
            reason = (_refusal(p.data) or ("is updated by the array code (fused=False, or settings.fused_kernels off)"
                                           if not fuses(fused, p.data, p.grad) else "is not C-contiguous"))
            raise GraphCaptureError(f"{where} {reason}; a captured step updates parameters with the fused "
                                    "multi-tensor kernel only (cupy float32/float64 arrays, C-contiguous)")
        if not has_state(state):
            raise GraphCaptureError(f"{where} has no optimizer state yet; the first step creates it, and a graph "
                                    "would create it again at every replay: run a step before the capture (the "
                                    "graphed step's warmup)")
        groups.setdefault((p.data.dtype, key(state)), []).append((p, state))
    return groups


def captured_launch(xp: Any, tables: cuda_kernels.TensorTables, name: str, variant: tuple, build: Any,
                    lists: Sequence[Sequence[Any]], count: int) -> Any:
    """Capture the multi-tensor update of ``lists``; returns the device array of its ``count`` scalars.

    The scalars are written (``cuda_kernels.fill``) before each replay.
    """
    # written before each launch, outside the graph: not from the graph's pool (see [Note: capturing a step])
    scalars = capture.host_written(xp, count, lists[0][0].dtype)
    _many(xp, tables, name, variant, build, lists, (scalars,), device_scalars=True)
    return scalars


def check_variant(owner: str, captured: tuple, now: tuple, hyperparameters: Dict[str, Any]) -> None:
    """Refuse (GraphCaptureError) a replay whose hyperparameters select another kernel than the captured one."""
    if captured != now:
        raise GraphCaptureError(f"{owner}: the hyperparameters now ({hyperparameters}) select another update kernel "
                                "than the one captured in the graph (weight decay, momentum, dampening or nesterov "
                                "turned on or off); capture the step again")


def _unscale_source() -> cuda_kernels.Source:
    # found_at: the flag's device address (an input array is const in a cupy kernel)
    return "T inverse, uint64 found_at", "T grad", ("grad = grad * inverse;\n"
                                                   "if (!isfinite(grad)) *(int*)found_at = 1;"), ""


def unscale_many(xp: Any, tables: cuda_kernels.TensorTables, grads: Sequence[Any], inverse: float, found: Any) -> None:
    """``grad *= inverse`` for many gradients of one dtype in one launch; ``found[0] = 1`` on inf/NaN."""
    scalars = (grads[0].dtype.type(inverse), np.uint64(found.data.ptr))
    _many(xp, tables, "unscale", (), _unscale_source, (grads,), scalars)


def _sgd_source(l2: bool, momentum: bool, first: bool, dampened: bool, nesterov: bool) -> cuda_kernels.Source:
    """SGD's update in the order of ``SGD._update`` (torch's)."""
    lines = ["T g = grad + weight_decay * param;" if l2 else "T g = grad;"]
    if momentum:
        if first:
            lines.append("buf = g;")
        else:
            lines.append("buf = buf * momentum;")
            lines.append("buf = buf + one_minus_dampening * g;" if dampened else "buf = buf + g;")
        lines.append("T d = g + momentum * buf;" if nesterov else "T d = buf;")
    else:
        lines.append("T d = g;")
    lines.append("param = param - lr * d;")
    return ("T grad, T weight_decay, T momentum, T one_minus_dampening, T lr",
            "T param, T buf" if momentum else "T param", "\n".join(lines), "")


def sgd_variant(momentum: float, dampening: float, weight_decay: float, nesterov: bool, first: bool) -> tuple:
    """The flags that select SGD's kernel: L2, momentum, its first step, dampening, nesterov."""
    return (weight_decay != 0, momentum != 0, bool(first), dampening != 0, bool(nesterov))


def sgd_scalars(t: Any, lr: float, momentum: float, dampening: float, weight_decay: float) -> tuple:
    """SGD's kernel scalars, in the kernel's order, of the parameters' scalar type ``t``."""
    return (t(weight_decay), t(momentum), t(1 - dampening), t(lr))


def sgd(xp: Any, data: Any, grad: Any, buf: Any, *, lr: float, momentum: float, dampening: float,
        weight_decay: float, nesterov: bool, first: bool) -> None:
    """One SGD update of ``data`` (and momentum buffer ``buf``, None without momentum; ``first``: ``buf`` is new)."""
    t = data.dtype.type
    flags = sgd_variant(momentum, dampening, weight_decay, nesterov, first)
    if xp is np:
        _host_updates().sgd_many([data], [grad], [buf], sgd_scalars(t, lr, momentum, dampening, weight_decay), *flags)
        return
    kernel = cuda_kernels.elementwise(xp, "sgd", flags, _sgd_source)
    outputs = (data, buf) if momentum != 0 else (data,)
    kernel(grad, *sgd_scalars(t, lr, momentum, dampening, weight_decay), *outputs)


def sgd_many(xp: Any, tables: cuda_kernels.TensorTables, datas: Sequence[Any], grads: Sequence[Any],
             bufs: Sequence[Any], *, lr: float, momentum: float, dampening: float, weight_decay: float,
             nesterov: bool, first: bool) -> None:
    """``sgd`` for many parameters of one dtype (all on their first momentum step, or none), one launch for all."""
    t = datas[0].dtype.type
    flags = sgd_variant(momentum, dampening, weight_decay, nesterov, first)
    if xp is np:
        _host_updates().sgd_many(datas, grads, bufs, sgd_scalars(t, lr, momentum, dampening, weight_decay), *flags)
        return
    lists = (grads, datas, bufs) if momentum != 0 else (grads, datas)
    _many(xp, tables, "sgd", flags, _sgd_source, lists, sgd_scalars(t, lr, momentum, dampening, weight_decay),
          lambda k: sgd(xp, datas[k], grads[k], bufs[k], lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, first=first))


__all__ = ["check_fused", "fuses", "joins", "adam_variant", "adam_scalars", "adam", "adam_many", "sgd_variant",
           "sgd_scalars", "sgd", "sgd_many", "captured_groups", "captured_launch", "check_variant", "unscale_many"]
