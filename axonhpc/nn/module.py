"""Module: the base of every layer, with registration, state dicts and explicit backward.

[Note: explicit backward and cached activations]
There is no autograd tape: ``forward`` stores what ``backward`` needs in ``_cache``; ``backward(grad_out)``
returns d loss / d input, adds into ``p.grad`` and drops the cache. With one cache slot per module, schedules
that run several forwards before their backwards (pipeline micro-batches) must ``stash_activations`` and
``restore_activations`` in between.

[Note: input_grad=False]
The first layer's input is usually data whose gradient nobody reads, and it costs ``Linear`` a matrix product
as large as its forward. So a backward may take ``input_grad=False`` and return None; containers pass it on
through ``call_backward``, only to backwards whose signature has it, so layers written without it still run.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .._dtypes import array_module, is_cupy_array
from ..errors import (ArgumentTypeError, BackendUnavailableError, BackwardBeforeForwardError, InvalidArgumentError,
                      InvalidKeyError, ModuleNotInitializedError, ShapeError, StateDictError)
from .matmul import sync_matmul_precision
from .parameter import Parameter


def _takes_input_grad(backward: Callable[..., Any]) -> bool:
    """Whether ``backward`` (a function or bound method) has a parameter named ``input_grad``."""
    code = getattr(getattr(backward, "__func__", backward), "__code__", None)
    return code is not None and "input_grad" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def call_backward(backward: Callable[..., Any], grad_out: Any, input_grad: bool = True) -> Any:
    """``backward(grad_out)``, with ``input_grad=False`` passed only where the backward takes it (see the module note)."""
    if not input_grad and _takes_input_grad(backward):
        return backward(grad_out, input_grad=False)
    return backward(grad_out)


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` could not match."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def _to_array_module_of(value: Any, like: Any) -> Any:
    """``value`` as an array of the same kind (numpy or cupy) as ``like``."""
    if is_cupy_array(value) and not is_cupy_array(like):
        value = value.get()
    return array_module(like).asarray(value)


def _move(arr: Any, device: Optional[str], dtype: Any, cupy: Any) -> Any:
    """``arr`` on ``device`` ("cpu"/"cuda"/None), floating arrays cast to ``dtype``."""
    if device == "cpu" and is_cupy_array(arr):
        arr = arr.get()
    elif device == "cuda" and not is_cupy_array(arr):
        arr = cupy.asarray(arr)
    if dtype is not None and arr.dtype.kind == "f":
        arr = arr.astype(dtype)
    return arr


class Module:
    """Base class of layers: holds Parameters, submodules and buffers.

    Subclasses call ``super().__init__()`` first, assign Parameters and
    Modules as attributes, and implement ``forward`` and ``backward``.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_cache", None)

    # ------------------------------------------------------------------ registration

    def _registries(self) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
        try:
            return self.__dict__["_parameters"], self.__dict__["_modules"], self.__dict__["_buffers"]
        except KeyError:
            raise ModuleNotInitializedError(
                f"{type(self).__name__}.__init__ must call super().__init__() before assigning attributes"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        params, modules, buffers = self._registries()
        if isinstance(value, Parameter):
            modules.pop(name, None)
            buffers.pop(name, None)
            self.__dict__.pop(name, None)
            params[name] = value
        elif isinstance(value, Module):
            params.pop(name, None)
            buffers.pop(name, None)
            self.__dict__.pop(name, None)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise ArgumentTypeError(
                    f"cannot assign {type(value).__name__} to parameter {name!r} of {type(self).__name__}; "
                    "assign a Parameter, or write into the existing one with param.data[...] = values"
                )
            del params[name]
            object.__setattr__(self, name, None)
        elif name in buffers:
            if value is None:
                del buffers[name]
                self._non_persistent.discard(name)
                object.__setattr__(self, name, None)
            else:
                buffers[name] = value
        elif name in modules and value is None:
            del modules[name]
            object.__setattr__(self, name, None)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails, i.e. for registered entries.
        d = self.__dict__
        for registry in ("_parameters", "_modules", "_buffers"):
            entries = d.get(registry)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        params, modules, buffers = self._registries()
        for registry in (params, modules, buffers):
            if name in registry:
                del registry[name]
                self._non_persistent.discard(name)
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, array: Any, persistent: bool = True) -> None:
        """Register a non-trainable array (running statistics, masks), or None to reserve the name.

        Buffers move with ``to()``, are broadcast by data-parallel wrappers and, when ``persistent``, saved in
        ``state_dict()``. Raises KeyError if ``name`` is already a parameter or submodule.
        """
        params, modules, buffers = self._registries()
        if not isinstance(name, str) or not name or "." in name:
            raise InvalidKeyError(f"buffer name must be a non-empty string without '.', got {name!r}")
        if name in params or name in modules:
            raise InvalidKeyError(f"{name!r} is already a parameter or submodule of {type(self).__name__}")
        self.__dict__.pop(name, None)
        buffers[name] = array
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    # ------------------------------------------------------------------ traversal

    def named_children(self) -> List[Tuple[str, "Module"]]:
        """Direct submodules as (name, module), in registration order."""
        return list(self._registries()[1].items())

    def children(self) -> List["Module"]:
        """Direct submodules in registration order."""
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix: str = "") -> List[Tuple[str, "Module"]]:
        """This module and all submodules, depth first, as (dotted name, module); "" is self."""
        out: List[Tuple[str, Module]] = []
        seen = set()

        def visit(module: Module, name: str) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            out.append((name, module))
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

        visit(self, prefix)
        return out

    def modules(self) -> List["Module"]:
        """This module and all submodules, depth first."""
        return [m for _, m in self.named_modules()]

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> List[Tuple[str, Parameter]]:
        """Parameters as (dotted name, Parameter) in registration order, each once (under its first name), as a list."""
        modules = self.named_modules(prefix) if recurse else [(prefix, self)]
        out: List[Tuple[str, Parameter]] = []
        seen = set()
        for mod_name, module in modules:
            for name, p in module._registries()[0].items():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{mod_name}.{name}" if mod_name else name, p))
        return out

    def parameters(self, recurse: bool = True) -> List[Parameter]:
        """Parameters in registration order (each shared Parameter once)."""
        return [p for _, p in self.named_parameters(recurse=recurse)]

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> List[Tuple[str, Any]]:
        """Buffers (persistent or not, None excluded) as (dotted name, array)."""
        modules = self.named_modules(prefix) if recurse else [(prefix, self)]
        out: List[Tuple[str, Any]] = []
        for mod_name, module in modules:
            for name, b in module._registries()[2].items():
                if b is not None:
                    out.append((f"{mod_name}.{name}" if mod_name else name, b))
        return out

    def buffers(self, recurse: bool = True) -> List[Any]:
        """Buffer arrays in registration order."""
        return [b for _, b in self.named_buffers(recurse=recurse)]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Copies of all parameters and persistent buffers, by dotted name, in registration order."""
        out: "OrderedDict[str, Any]" = OrderedDict()
        for key, (module, name, kind) in self._state_targets().items():
            registry = module._registries()[0 if kind == "param" else 2]
            value = registry[name].data if kind == "param" else registry[name]
            out[key] = value.copy()
        return out

    def named_state(self) -> "OrderedDict[str, Tuple[str, Any]]":
        """Where each ``state_dict()`` entry is read from: name -> ``("param", Parameter)`` or ``("buffer", array)``; no copies."""
        out: "OrderedDict[str, Tuple[str, Any]]" = OrderedDict()
        for key, (module, name, kind) in self._state_targets().items():
            out[key] = (kind, module._registries()[0 if kind == "param" else 2][name])
        return out

    def _state_targets(self) -> "OrderedDict[str, Tuple[Module, str, str]]":
        """name -> (owning module, local name, "param" | "buffer") for every state_dict entry."""
        out: "OrderedDict[str, Tuple[Module, str, str]]" = OrderedDict()
        seen = set()
        for mod_name, module in self.named_modules():
            dot = f"{mod_name}." if mod_name else ""
            for name, p in module._registries()[0].items():
                if id(p) not in seen:
                    seen.add(id(p))
                    out[dot + name] = (module, name, "param")
            for name, b in module._registries()[2].items():
                if b is not None and name not in module._non_persistent:
                    out[dot + name] = (module, name, "buffer")
        return out

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy values into the parameters and buffers, in place (into ``p.data``, cast and moved); returns IncompatibleKeys.

        Raises StateDictError, before anything is copied, listing every shape mismatch and (with ``strict``) every
        missing or unexpected key.
        """
        missing, unexpected = self.check_state_dict(state_dict, strict)
        for key, (module, name, kind) in self._state_targets().items():
            if key not in state_dict:
                continue
            if kind == "param":
                data = module._parameters[name].data
                data[...] = _to_array_module_of(state_dict[key], data)
            else:
                buf = module._buffers[name]
                buf[...] = _to_array_module_of(state_dict[key], buf)
        return IncompatibleKeys(missing, unexpected)

    def check_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Tuple[List[str], List[str]]:
        """Raise StateDictError, changing nothing, where ``load_state_dict`` would refuse; else ``(missing keys,
        unexpected keys)``."""
        if not isinstance(state_dict, dict):
            raise StateDictError(f"cannot load a {type(state_dict).__name__} into {type(self).__name__}: a state "
                                 f"dict is a dict of names to arrays")
        targets = self._state_targets()
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        problems = []
        if strict and missing:
            problems.append("missing keys: " + ", ".join(repr(k) for k in missing))
        if strict and unexpected:
            problems.append("unexpected keys: " + ", ".join(repr(k) for k in unexpected))
        for key, (module, name, kind) in targets.items():
            if key not in state_dict:
                continue
            current = module._parameters[name].data if kind == "param" else module._buffers[name]
            value = state_dict[key]
            # .shape first: np.shape would dispatch (or copy) for a device array.
            value_shape = tuple(value.shape) if hasattr(value, "shape") else tuple(np.shape(value))
            if value_shape != tuple(current.shape):
                problems.append(
                    f"shape mismatch for {key!r}: the state dict has {value_shape}, "
                    f"the module has {tuple(current.shape)}"
                )
        if problems:
            raise StateDictError(f"cannot load state dict into {type(self).__name__}: " + "; ".join(problems))
        return missing, unexpected

    # ------------------------------------------------------------------ modes and gradients

    def train(self, mode: bool = True) -> "Module":
        """Set training mode (Dropout active) on this module and all submodules; returns self."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        """Set evaluation mode (Dropout is the identity), as ``train(False)``; returns self."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset every parameter's gradient.

        The default zeroes in place, so gradient views a data-parallel wrapper installed stay valid;
        ``set_to_none`` drops the arrays instead.
        """
        for p in self.parameters():
            p.zero_grad(set_to_none)

    def to(self, device: Optional[str] = None, dtype: Any = None) -> "Module":
        """Move parameters, gradients and buffers to ``device`` ("cpu", "cuda" or None) and/or floating ``dtype``; returns self.

        This rebinds ``p.data``: do it before building an optimizer or wrapper. Raises ValueError for an unknown device,
        BackendUnavailableError for "cuda" without cupy.
        """
        if device not in (None, "cpu", "cuda"):
            raise InvalidArgumentError(f"device must be 'cpu', 'cuda' or None, got {device!r}")
        cupy = None
        if device == "cuda":
            try:
                import cupy
            except ImportError as exc:
                raise BackendUnavailableError(f"Module.to('cuda') needs cupy: {exc}") from exc
        if dtype is not None:
            dtype = np.dtype(dtype)
        for p in self.parameters():
            p.data = _move(p.data, device, dtype, cupy)
            if p.grad is not None:
                p.grad = _move(p.grad, device, dtype, cupy)
        for m in self.modules():
            buffers = m._registries()[2]
            for name, b in list(buffers.items()):
                if b is not None:
                    buffers[name] = _move(b, device, dtype, cupy)
        return self

    # ------------------------------------------------------------------ forward / backward

    # The built-in layers take arrays: ``__call__`` refuses anything else with the message a user can act on
    # (a list reached ``x.ndim`` and failed with an AttributeError). User modules may take what they like.
    takes_arrays = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sync_matmul_precision()  # settings.allow_tf32 reaches cupy before the products run
        if self.takes_arrays and args and not isinstance(args[0], np.ndarray) and not is_cupy_array(args[0]):
            raise ArgumentTypeError(f"{type(self).__name__} takes a numpy or cupy array, got "
                                    f"{type(args[0]).__module__}.{type(args[0]).__name__}; pass np.asarray(x) "
                                    f"(of the model's dtype, e.g. np.float32)")
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the output and cache what ``backward`` needs; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, grad_out: Any) -> Any:
        """Backpropagate through the last ``forward``: add into each ``p.grad``, drop the cache, return d loss / d input.

        Returns None for integer inputs. Raises BackwardBeforeForwardError if no forward ran since the last backward.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement backward")

    def _pop_cache(self) -> Any:
        """Take the cached forward activations (leaving none), or raise."""
        cache = self.__dict__.get("_cache")
        replaced = self.__dict__.get("_replaced", 0)  # forwards whose cache a later forward replaced
        if cache is None:
            earlier = self.__dict__.get("_replaced_before_backward", 0)
            object.__setattr__(self, "_replaced_before_backward", 0)
            if earlier:
                raise BackwardBeforeForwardError(
                    f"{type(self).__name__}.backward was called again without a forward, and this module was "
                    f"called {earlier + 1} times before its last backward: "
                    "each call replaces the cache of the one before, so only the last can be backpropagated. "
                    "One instance used at two places of a model (the same activation listed twice in a "
                    "Sequential) needs an instance for each place")
            raise BackwardBeforeForwardError(
                f"{type(self).__name__}.backward was called without a forward since the last backward "
                "(call the module on an input first; restore_activations() after stash_activations())"
            )
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_replaced", 0)
        object.__setattr__(self, "_replaced_before_backward", replaced)
        return cache

    def _save_cache(self, cache: Any) -> None:
        if self.__dict__.get("_cache") is not None:
            object.__setattr__(self, "_replaced", self.__dict__.get("_replaced", 0) + 1)
        object.__setattr__(self, "_cache", cache)

    def stash_activations(self) -> List[Any]:
        """Take the cached activations of this module and its submodules (restore with ``restore_activations``)."""
        saved = []
        for m in self.modules():
            saved.append(m.__dict__.get("_cache"))
            object.__setattr__(m, "_cache", None)
        return saved

    def restore_activations(self, saved: List[Any]) -> None:
        """Put back activations taken by ``stash_activations``; ShapeError if from another structure."""
        modules = self.modules()
        if len(saved) != len(modules):
            raise ShapeError(
                f"restore_activations got caches for {len(saved)} modules, this module tree has {len(modules)}"
            )
        for m, cache in zip(modules, saved):
            object.__setattr__(m, "_cache", cache)

    # ------------------------------------------------------------------ printing

    def extra_repr(self) -> str:
        """Layer settings shown inside the parentheses of ``repr``."""
        return ""

    def __repr__(self) -> str:
        children = self.named_children()
        if not children:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"{type(self).__name__}("]
        if self.extra_repr():
            lines.append("  " + self.extra_repr())
        for name, child in children:
            lines.append(f"  ({name}): " + repr(child).replace("\n", "\n  "))
        lines.append(")")
        return "\n".join(lines)


def require_module(obj: Any, who: str) -> "Module":
    """``obj`` when it is an ``nn.Module``, else ArgumentTypeError naming its type."""
    if not isinstance(obj, Module):
        raise ArgumentTypeError(f"{who} wraps an axonhpc.nn.Module, got {type(obj).__module__}.{type(obj).__name__}")
    return obj


__all__ = ["Module", "IncompatibleKeys", "call_backward", "require_module"]
