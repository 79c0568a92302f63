"""``axonhpc bench step``: one training step of an MLP, ours beside PyTorch's and the GEMM floor.

Columns (medians of interleaved rounds, one process): ``axonhpc`` (the plain loop, reading its loss as
a float between forward and backward); ``deferred`` (cuda: under ``ax.defer_reads()``, as PyTorch leaves
its loss on the device); ``gemm floor`` (the step's matrix products alone, so ours/floor says how much of
the step is not matrix products); ``graphed`` (cuda: ``axonhpc.graph_step``); ``torch`` (when installed).
Precisions: ``fp32``; on cuda also ``tf32``, ``bf16`` and ``fp16`` (with a dynamic loss scaler). Tests
never assert these times; docs/performance.md quotes them with their machine.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import bfloat16_dtype
from ..errors import GraphCaptureError, InvalidArgumentError
from .timing import median_times, pin_blas_threads

DEFAULT_MODELS = {"cpu": "784-256-10x128,1024-1024-1024-10x256",
                  "cuda": "784-256-10x128,1024-4096-4096-4096-10x2048"}
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
DEFAULT_PRECISIONS = {"cpu": "fp32", "cuda": "fp32,tf32,bf16,fp16"}
TARGET_SECONDS = 0.05  # one timed block runs about this long
LR, MOMENTUM = 0.01, 0.9


@dataclass(frozen=True)
class ModelSpec:
    """An MLP's widths (input, hidden..., classes) and the batch it trains on."""

    widths: Tuple[int, ...]
    batch: int

    @property
    def label(self) -> str:
        """"784-256-10 x128"."""
        return "-".join(map(str, self.widths)) + f" x{self.batch}"

    def gemm_flops(self) -> int:
        """Floating-point operations of the floor's products (two for the first layer, three for the others)."""
        return sum((2 if i == 0 else 3) * 2 * self.batch * a * b
                   for i, (a, b) in enumerate(zip(self.widths[:-1], self.widths[1:])))


def parse_models(text: str) -> List[ModelSpec]:
    """"784-256-10x128,1024-4096-10x2048" -> ModelSpecs; InvalidArgumentError for a bad spec."""
    specs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            widths_text, batch_text = part.split("x")
            widths = tuple(int(w) for w in widths_text.split("-"))
            batch = int(batch_text)
        except ValueError:
            raise InvalidArgumentError(f"--models: {part!r} is not WIDTH-WIDTH[-...]xBATCH (e.g. 784-256-10x128)") \
                from None
        if len(widths) < 2 or min(widths) < 1 or batch < 1:
            raise InvalidArgumentError(f"--models: {part!r} needs two or more positive widths and a positive batch")
        specs.append(ModelSpec(widths, batch))
    if not specs:
        raise InvalidArgumentError(f"--models: no model in {text!r}")
    return specs


def parse_precisions(text: str, device: str) -> List[str]:
    """"fp32,tf32" -> the list, checked against what ``device`` can run; InvalidArgumentError otherwise."""
    out = []
    for name in (p.strip().lower() for p in text.split(",") if p.strip()):
        if name not in PRECISIONS:
            raise InvalidArgumentError(f"--precisions: unknown {name!r}; choose from {', '.join(PRECISIONS)}")
        if name == "tf32" and device != "cuda":
            raise InvalidArgumentError("--precisions: tf32 is a mode of NVIDIA tensor cores; it needs --device cuda")
        if name == "bf16" and device != "cuda":
            raise InvalidArgumentError("--precisions: bf16 needs --device cuda: numpy has no bfloat16 GEMM (ml_dtypes "
                                       "multiplies element by element), so nn.autocast on the host models the "
                                       "device's arithmetic and is not a speed path")
        if name == "fp16" and device != "cuda":
            raise InvalidArgumentError("--precisions: fp16 needs --device cuda: numpy multiplies float16 in its own "
                                       "loops, not BLAS, so nn.autocast on the host models the device's arithmetic "
                                       "and is not a speed path")
        if name == "bf16" and bfloat16_dtype() is None:
            raise InvalidArgumentError("--precisions: bf16 needs ml_dtypes (pip install axonhpc[bf16])")
        out.append(name)
    if not out:
        raise InvalidArgumentError(f"--precisions: none given in {text!r}")
    return out


class Device:
    """The array library of a device and how to wait for it."""

    def __init__(self, name: str):
        self.name = name
        if name == "cuda":
            from ..backends.devices import device_facts

            facts = device_facts()
            if facts.cupy is None or facts.devices < 1:
                why = "; ".join(facts.problems) or "cupy sees no CUDA device"
                raise InvalidArgumentError(f"--device cuda: no CUDA device: {why}")
            import cupy

            self.xp = cupy
        else:
            self.xp = np

    def sync(self) -> None:
        """Wait until the device finished what was queued (nothing to wait for on the CPU)."""
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def bf16_problem(self) -> Optional[str]:
        """Why bfloat16 products cannot run on this device's array library, or None if they can."""
        try:
            a = self.xp.ones((2, 2), dtype=np.float32).astype(bfloat16_dtype())
            (a @ a).astype(np.float32)
        except Exception as exc:  # noqa: BLE001 - whatever the library raises is the reason to report
            return f"{self.xp.__name__} {getattr(self.xp, '__version__', '?')} cannot multiply bfloat16 arrays " \
                   f"({type(exc).__name__}: {exc})"
        return None

    def describe(self) -> str:
        if self.xp is np:
            return f"cpu (numpy {np.__version__}, BLAS pinned to 1 thread)"
        props = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return f"cuda: {name} (cupy {self.xp.__version__})"


def _batch(spec: ModelSpec, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec.batch, spec.widths[0])).astype(np.float32)
    y = rng.integers(0, spec.widths[-1], spec.batch)
    return x, y


_CASTS = {"bf16": "bfloat16", "fp16": "float16"}


def _step_fn(spec: ModelSpec, device: Device, precision: str, set_to_none: bool,
             deferred: bool = False) -> Tuple[Callable[..., Any], Optional[Callable[[], None]], Any, Any]:
    """Our step of the spec's MLP as ``step(x, y)``, what runs after it (fp16: the scaler's step), and the batch."""
    from ..cuda.capture import defer_reads
    from ..nn import CrossEntropyLoss, autocast
    from ..optim import SGD
    from ..parallel import GradScaler
    from .ddp import make_mlp

    model = make_mlp(spec.widths, relu_in_linear=True)
    if device.xp is not np:
        model.to("cuda")
    opt = SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = CrossEntropyLoss()
    x, y = (device.xp.asarray(a) for a in _batch(spec))

    cast = autocast(_CASTS[precision]) if precision in _CASTS else contextlib.nullcontext()
    scaler = GradScaler() if precision == "fp16" else None

    reads = defer_reads if deferred else contextlib.nullcontext

    def step(x: Any, y: Any) -> Any:
        with reads():
            opt.zero_grad(set_to_none=set_to_none)
            with cast:
                loss = loss_fn(model(x), y)
            model.backward(loss_fn.backward(1.0 if scaler is None else scaler.scale(1.0)), input_grad=False)
            if scaler is None:  # the input is data, above
                opt.step()
        return loss

    def scaler_step() -> None:
        scaler.step(opt)
        scaler.update()

    return step, None if scaler is None else scaler_step, x, y


def _then(fn: Callable[[], Any], after: Optional[Callable[[], None]]) -> Callable[[], Any]:
    """``fn`` followed by ``after`` (when there is one), returning what ``fn`` returned."""
    if after is None:
        return fn

    def both() -> Any:
        out = fn()
        after()
        return out

    return both


def axon_step(spec: ModelSpec, device: Device, precision: str = "fp32", deferred: bool = False) -> Callable[[], float]:
    """One axonhpc step of the spec's MLP as a closure returning the loss (``deferred``: under ``defer_reads``)."""
    step, after, x, y = _step_fn(spec, device, precision, set_to_none=True, deferred=deferred)
    return _then(lambda: step(x, y), after)


def graphed_step(spec: ModelSpec, device: Device, precision: str = "fp32") -> Callable[[], Any]:
    """``axon_step`` captured as a CUDA graph (fp16: the scaler's step and update run after each launch)."""
    from ..cuda.graphs import graph_step

    step, after, x, y = _step_fn(spec, device, precision, set_to_none=False)
    graphed = graph_step(step, warmup=2)
    return _then(lambda: graphed(x, y), after)


def gemm_floor(spec: ModelSpec, device: Device, precision: str = "fp32") -> Callable[[], None]:
    """The products of a step of the spec's MLP, into preallocated outputs, as a closure.

    bf16, fp16: the operands and outputs are bfloat16 or float16 arrays.
    """
    xp = device.xp
    dtype = {"bf16": bfloat16_dtype(), "fp16": np.dtype(np.float16)}.get(precision, np.dtype(np.float32))
    rng = np.random.default_rng(1)
    layers = []
    for i, (a, b) in enumerate(zip(spec.widths[:-1], spec.widths[1:])):
        def host(*shape):
            return xp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

        layers.append((host(spec.batch, a), host(b, a), host(spec.batch, b),
                       xp.empty((spec.batch, b), dtype), xp.empty((b, a), dtype),
                       xp.empty((spec.batch, a), dtype) if i else None))

    def products() -> None:
        for x, w, g, y, dw, dx in layers:
            xp.matmul(x, w.T, out=y)
            xp.matmul(g.T, x, out=dw)
            if dx is not None:
                xp.matmul(g, w, out=dx)

    return products


def torch_step(spec: ModelSpec, device: Device, precision: str) -> Tuple[Optional[Callable[[], Any]], str]:
    """PyTorch's step of the same model on the same device (returning the loss tensor), or (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    dev = "cuda" if device.xp is not np else "cpu"
    if dev == "cpu":
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    layers: List[Any] = []
    with torch.random.fork_rng(devices=[]):  # the same initial weights every run; the caller's RNG untouched
        torch.manual_seed(0)
        for i, (a, b) in enumerate(zip(spec.widths[:-1], spec.widths[1:])):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(a, b))
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.CrossEntropyLoss()
    x_host, y_host = _batch(spec)
    x, y = torch.from_numpy(x_host).to(dev), torch.from_numpy(y_host).to(dev)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(dev, enabled=precision == "fp16")

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=cast or torch.bfloat16, enabled=cast is not None):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()  # disabled: the loss itself
        scaler.step(opt)  # disabled: opt.step()
        scaler.update()
        return loss  # a tensor: reading it would wait for the device

    return step, f"torch {torch.__version__}"


def _timed(fn: Callable[[], Any], device: Device, warmup: int) -> Tuple[Callable[[], None], int]:
    """``fn`` repeated enough times to run about TARGET_SECONDS, synchronised at the end; and the count."""
    for _ in range(warmup):
        fn()
    device.sync()
    start = time.perf_counter()
    fn()
    device.sync()
    once = max(time.perf_counter() - start, 1e-7)
    count = max(1, min(1000, int(TARGET_SECONDS / once)))

    def block() -> None:
        for _ in range(count):
            fn()
        device.sync()

    return block, count


def measure(spec: ModelSpec, precision: str, device: Device, rounds: int, warmup: int = 3,
            fused: bool = True) -> dict:
    """Median seconds per step of each candidate (None where it did not run); ``fused``: ``settings.fused_kernels``."""
    from ..nn import apply_matmul_precision
    from ..settings import settings

    saved, saved_fused = settings.allow_tf32, settings.fused_kernels
    settings.allow_tf32 = precision == "tf32"
    settings.fused_kernels = bool(fused)
    try:
        apply_matmul_precision()  # the floor's products are not module calls
        fns: Dict[str, Callable[[], Any]] = {"axonhpc": axon_step(spec, device, precision),
                                             "floor": gemm_floor(spec, device, precision)}
        if device.xp is not np:
            fns["deferred"] = axon_step(spec, device, precision, deferred=True)
            fns["graphed"] = graphed_step(spec, device, precision)
        torch_fn, torch_note = torch_step(spec, device, precision)
        if torch_fn is not None:
            fns["torch"] = torch_fn
        blocks, counts, graph_problem = {}, {}, None
        for name, fn in fns.items():
            try:
                blocks[name], counts[name] = _timed(fn, device, warmup)
            except GraphCaptureError as exc:  # the other columns still stand; the reason goes under the table
                if name != "graphed":
                    raise
                graph_problem = str(exc)
        medians = median_times(blocks, iters=1, rounds=rounds)
    finally:
        settings.allow_tf32, settings.fused_kernels = saved, saved_fused
        apply_matmul_precision()
    seconds = {name: medians[name] / counts[name] for name in medians}
    row = {"model": spec.label, "precision": precision, "axonhpc_s": seconds["axonhpc"],
           "floor_s": seconds["floor"], "deferred_s": seconds.get("deferred"), "graphed_s": seconds.get("graphed"),
           "torch_s": seconds.get("torch"),
           "torch": torch_note, "floor_tflops": spec.gemm_flops() / seconds["floor"] / 1e12,
           "graphed_problem": graph_problem}
    row["ours_over_floor"] = row["axonhpc_s"] / row["floor_s"]
    row["ours_over_torch"] = None if row["torch_s"] is None else row["axonhpc_s"] / row["torch_s"]
    for name in ("deferred", "graphed"):
        row[f"{name}_over_torch"] = (None if row["torch_s"] is None or row[f"{name}_s"] is None
                                     else row[f"{name}_s"] / row["torch_s"])
    return row


def format_table(rows: Sequence[dict]) -> str:
    """The table ``main`` prints (n/a where torch did not run)."""
    def ms(v: Optional[float]) -> str:
        return "n/a" if v is None else f"{v * 1e3:.3f}"

    def ratio(v: Optional[float]) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    lines = [f"{'model':>28} {'prec':>5} {'axonhpc ms':>11} {'floor ms':>9} {'deferred ms':>11} "
             f"{'graphed ms':>10} {'torch ms':>9} {'ours/floor':>10} {'ours/torch':>10} {'deferred/torch':>14} "
             f"{'graphed/torch':>13} {'floor TFLOP/s':>13}"]
    for r in rows:
        lines.append(f"{r['model']:>28} {r['precision']:>5} {ms(r['axonhpc_s']):>11} {ms(r['floor_s']):>9} "
                     f"{ms(r.get('deferred_s')):>11} {ms(r.get('graphed_s')):>10} {ms(r['torch_s']):>9} "
                     f"{ratio(r['ours_over_floor']):>10} {ratio(r['ours_over_torch']):>10} "
                     f"{ratio(r.get('deferred_over_torch')):>14} {ratio(r.get('graphed_over_torch')):>13} "
                     f"{r['floor_tflops']:>13.3f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the step table (``axonhpc bench step``); 2 with a message for bad options or no CUDA device."""
    parser = argparse.ArgumentParser(prog="axonhpc bench step", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default=None,
                        help="comma-separated WIDTH-...-WIDTHxBATCH (default: "
                             + "; ".join(f"{k}: {v}" for k, v in DEFAULT_MODELS.items()) + ")")
    parser.add_argument("--precisions", default=None,
                        help="fp32 and, on cuda, tf32, bf16 and fp16 (default: all the device runs)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    parser.add_argument("--no-fused", action="store_true",
                        help="our step with settings.fused_kernels off: the layers' element-wise work and the "
                             "SGD update as array operations instead of the compiled host kernels (cpu) or fused "
                             "kernels (cuda)")
    args = parser.parse_args([] if argv is None else list(argv))
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        specs = parse_models(args.models or DEFAULT_MODELS[args.device])
        precisions = parse_precisions(args.precisions or DEFAULT_PRECISIONS[args.device], args.device)
        device = Device(args.device)
    except InvalidArgumentError as exc:
        print(f"axonhpc bench step: {exc}", file=sys.stderr)
        return 2
    skipped = device.bf16_problem() if "bf16" in precisions else None
    if skipped is not None:
        precisions = [p for p in precisions if p != "bf16"]
    limiter = pin_blas_threads(1)  # noqa: F841 - keeps the limit in force
    rows = [measure(spec, precision, device, args.rounds, fused=not args.no_fused)
            for spec in specs for precision in precisions]
    torch_note = rows[0]["torch"] if rows else "nothing measured"
    update = ("array operations" if args.no_fused
              else "compiled host kernels (bias and ReLU, cross-entropy, SGD update)" if device.xp is np
              else "fused kernels (bias and ReLU, cross-entropy gradient, SGD update)")
    print(f"device: {device.describe()}; {torch_note}; our element-wise work: {update}; "
          f"medians of {args.rounds} interleaved rounds")
    if rows:
        print(format_table(rows))
    for problem in sorted({r["graphed_problem"] for r in rows if r.get("graphed_problem")}):
        print(f"graphed n/a: {problem}")
    if skipped is not None:
        print(f"bf16 rows skipped: {skipped}")
    sys.stdout.flush()
    return 0


__all__ = ["main", "measure", "axon_step", "graphed_step", "gemm_floor", "torch_step", "parse_models",
           "parse_precisions",
           "format_table", "ModelSpec", "Device", "DEFAULT_MODELS", "DEFAULT_PRECISIONS"]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
