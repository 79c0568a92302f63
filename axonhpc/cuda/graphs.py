"""A whole training step captured once as a CUDA graph and replayed: ``graph_step``.

[Note: graphed steps]
A small model's GPU step is mostly launch overhead. ``graph_step(fn)`` runs ``warmup`` calls eagerly (kernels
compile, optimizer state is made), then captures ``fn`` on a side stream with a memory pool of its own (the
addresses the graph writes stay reserved), and from then on copies the inputs into static arrays, runs the
before-replay work and launches the graph, returning the same, overwritten device arrays. Checks that read
the device are read at the next call or ``check()``, so a step with bad targets has run when the call after
it raises. NCCL collectives are replayed too, compared across ranks before each launch
([Note: collectives in a graph]); what a graph cannot replay is refused at capture with ``GraphCaptureError``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from .._dtypes import array_module, is_cupy_array
from ..collectives import graphed
from ..errors import ArgumentTypeError, ConfigurationError, GraphCaptureError
from . import capture

# Words of cupy's and CUDA's errors for work a capture cannot hold.
_CAPTURE_WORDS = ("captur", "cudaErrorStreamCapture")


def _leaves(value: Any) -> List[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def _describe(arrays: List[Any]) -> str:
    return ", ".join(f"{tuple(a.shape)} {a.dtype}" for a in arrays)


class GraphedStep:
    """A step function run eagerly ``warmup`` times, then captured as a CUDA graph and replayed.

    See [Note: graphed steps]. Made by ``graph_step``.
    """

    def __init__(self, fn: Callable[..., Any], warmup: int = 2) -> None:
        if not callable(fn):
            raise ArgumentTypeError(f"graph_step needs a callable step function, got {type(fn).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ConfigurationError(f"graph_step warmup must be an int >= 1 (the optimizer creates its state in "
                                     f"the first step, which a graph cannot replay), got {warmup!r}")
        self.fn = fn
        self.warmup = warmup
        self.calls = 0
        self._graph: Any = None
        self._pool: Any = None
        self._static: List[Any] = []
        self._outputs: Any = None
        self._record: Optional[capture.Recording] = None
        self._replay_checks: List[Any] = []
        self._unchecked = False

    @property
    def captured(self) -> bool:
        """Whether the graph has been captured (calls from now on replay it)."""
        return self._graph is not None

    def __call__(self, *inputs: Any) -> Any:
        """Run one step on ``inputs`` (device arrays); returns what ``fn`` returns.

        Raises:
            ArgumentTypeError: an input that is not a cupy array.
            GraphCaptureError: the step cannot be captured, or inputs differ in shape or dtype from the capture's.
            CollectiveMismatchError: on every rank of a group, when they do not all replay the same graph here.
        """
        xp = self._module(inputs)
        if self._graph is not None:
            return self._replay(xp, inputs)
        if self.calls < self.warmup:
            record = capture.Recording(capturing=False, xp=xp)
            with capture.recording(record):
                out = self.fn(*inputs)
            capture.read_checks(record.checks)
            self.calls += 1
            return out
        self._capture(xp, inputs)
        return self._replay(xp, inputs)

    def check(self) -> None:
        """Read the checks of the last replay now (waits for it); raises what they raise."""
        if self._unchecked:
            self._unchecked = False
            capture.read_checks(self._record.checks)

    def _module(self, inputs: Any) -> Any:
        for i, x in enumerate(inputs):
            if not is_cupy_array(x):
                raise ArgumentTypeError(f"graph_step inputs must be cupy arrays (a graph reads device memory), "
                                        f"input {i} is a {type(x).__name__}")
        if not inputs:
            raise ArgumentTypeError("graph_step needs at least one input array (the batch)")
        return array_module(inputs[0])

    def _capture(self, xp: Any, inputs: Any) -> None:
        """Capture ``fn`` on copies of ``inputs`` (see the note's step 2)."""
        self._static = [x.copy() for x in inputs]
        current = xp.cuda.get_current_stream()
        stream = xp.cuda.Stream(non_blocking=True)
        stream.wait_event(current.record())  # the copies and all earlier work come first
        pool = xp.cuda.MemoryPool()
        record = capture.Recording(capturing=True, xp=xp, host_allocator=_allocator_in_force(xp))
        with xp.cuda.using_allocator(pool.malloc), stream, capture.recording(record):
            stream.begin_capture()
            try:
                outputs = self.fn(*self._static)
            except BaseException as exc:
                try:
                    stream.end_capture()  # the partial graph is dropped
                except Exception:  # noqa: BLE001 - an invalidated capture may refuse to end; exc is the error to report
                    pass
                if isinstance(exc, GraphCaptureError) or not any(w in str(exc) for w in _CAPTURE_WORDS):
                    raise
                if "cuBLAS" in str(exc):
                    raise GraphCaptureError(
                        f"the step multiplied through cupy, which refuses cuBLAS in a graph capture "
                        f"({type(exc).__name__}: {exc}); axonhpc's layers route their 2-D products around it "
                        "(nn.gemm), but not batched products (attention's) nor '@' in your own code: use "
                        "axonhpc.nn.matmul.product_2d for a 2-D product, or leave that part out of the graph") from exc
                raise GraphCaptureError(f"the step did work a CUDA graph cannot hold ({type(exc).__name__}: {exc}); "
                                        "typically a read of a device value (float(), .get(), .item(), a "
                                        "Python if on an array), a copy from host memory, or a stream "
                                        "synchronisation inside the step") from exc
            graph = stream.end_capture()
        bad = [type(v).__name__ for v in _leaves(outputs) if v is not None and not is_cupy_array(v)]
        if bad:
            raise GraphCaptureError(f"the step returned {', '.join(bad)}: a graphed step's outputs must be device "
                                    "arrays (or None), which each replay overwrites; return the loss array, not a "
                                    "number read from it")
        self._graph, self._pool, self._outputs, self._record = graph, pool, outputs, record
        self._replay_checks = graphed.replay_checks(record)

    def _replay(self, xp: Any, inputs: Any) -> Any:
        """Copy ``inputs`` in, run the work before a replay, launch (see the note's step 3)."""
        if len(inputs) != len(self._static) or any(
                tuple(x.shape) != tuple(s.shape) or x.dtype != s.dtype for x, s in zip(inputs, self._static)):
            raise GraphCaptureError(f"graph_step was captured for inputs ({_describe(self._static)}), got "
                                    f"({_describe(list(inputs))}); a CUDA graph replays fixed shapes: make one "
                                    "graphed step per input shape")
        self.check()
        graphed.check_replay(self._replay_checks)  # collective, before anything changes: all ranks replay it
        for static, x in zip(self._static, inputs):
            if x is not static:
                xp.copyto(static, x)
        for prepare in self._record.before_replay:
            prepare()
        self._graph.launch(xp.cuda.get_current_stream())
        self._unchecked = bool(self._record.checks)
        self.calls += 1
        return self._outputs


def _allocator_in_force(xp: Any) -> Any:
    """The allocator this thread's cupy allocates with now (cupy's default pool's where none was set)."""
    get = getattr(xp.cuda, "get_allocator", None)
    return get() if get is not None else xp.get_default_memory_pool().malloc


def graph_step(fn: Callable[..., Any], warmup: int = 2) -> GraphedStep:
    """Capture the step ``fn(*inputs)`` as a CUDA graph after ``warmup`` eager calls (see [Note: graphed steps]).

    Args:
        fn: the whole step, zeroing gradients with ``set_to_none=False``; returns device arrays.
        warmup: eager calls before the capture (at least 1: the optimizer's first step creates its state).

    Raises:
        ArgumentTypeError: ``fn`` is not callable.
        ConfigurationError: ``warmup`` is not an int >= 1.
    """
    return GraphedStep(fn, warmup)


__all__ = ["graph_step", "GraphedStep"]
