"""Random generator state as checkpointable data.

[Note: rng state]
PCG64's state holds 128-bit ints, which the checkpoint format stores as decimal strings so nothing is
rounded. The captured dict records whether it came from a ``Generator``, a ``RandomState`` or numpy's global
RNG, so ``restore_rng_state`` can rebuild a generator of the right kind when no target is given.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, Optional, Union

import numpy as np

from ..errors import ArgumentTypeError, CheckpointError

RNG = Union[np.random.Generator, np.random.RandomState]

_KINDS = ("generator", "random_state", "global")


def capture_rng_state(generator: Optional[RNG] = None) -> Dict[str, Any]:
    """The state of ``generator`` as plain data that ``save`` can store (the arrays in it are copies).

    ``generator`` is a ``numpy.random.Generator``, a ``RandomState``, or None for numpy's global RNG. Returns
    ``{"kind": "generator" | "random_state" | "global", "state": {...}}``; raises TypeError for another type.
    """
    if isinstance(generator, np.random.Generator):
        return {"kind": "generator", "state": copy.deepcopy(generator.bit_generator.state)}
    if isinstance(generator, np.random.RandomState):
        return {"kind": "random_state", "state": copy.deepcopy(generator.get_state(legacy=False))}
    if generator is None:
        return {"kind": "global", "state": copy.deepcopy(np.random.get_state(legacy=False))}
    raise ArgumentTypeError(f"capture_rng_state takes a numpy Generator, RandomState or None, "
                    f"got {type(generator).__name__}")


def _bit_generator_class(name: Any) -> type:
    cls = getattr(np.random, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, np.random.BitGenerator)):
        raise CheckpointError(f"rng state names bit generator {name!r}, which numpy does not provide")
    return cls


def restore_rng_state(state: Dict[str, Any], generator: Optional[RNG] = None) -> Optional[RNG]:
    """Put a state from ``capture_rng_state`` back into a generator.

    With ``generator=None`` a new one of the recorded kind is made, except that a ``"global"`` state goes back
    into numpy's global RNG. Returns the generator that now has the state, or None for the global RNG.

    Raises:
        CheckpointError: ``state`` is not a captured rng state, or is of another kind of generator or bit
            generator than ``generator``.
    """
    if not isinstance(state, dict) or state.get("kind") not in _KINDS or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"not an rng state from capture_rng_state: expected a dict with 'kind' in "
                              f"{_KINDS} and a 'state' dict, got {type(state).__name__} "
                              f"{sorted(state) if isinstance(state, dict) else ''}")
    kind, inner = state["kind"], copy.deepcopy(state["state"])
    name = inner.get("bit_generator")
    if kind == "generator":
        if generator is None:
            generator = np.random.Generator(_bit_generator_class(name)())
        elif not isinstance(generator, np.random.Generator):
            raise CheckpointError(f"the rng state is a Generator's; cannot restore it into a "
                                  f"{type(generator).__name__}")
        have = type(generator.bit_generator).__name__
        if have != name:
            raise CheckpointError(f"the rng state is for bit generator {name!r}, the generator uses {have!r}")
        generator.bit_generator.state = inner
        return generator
    # A RandomState's state, or the global RNG's (which is a RandomState too).
    if generator is None and kind == "global":
        np.random.set_state(inner)
        return None
    if generator is None:
        generator = np.random.RandomState(_bit_generator_class(name)())
    elif not isinstance(generator, np.random.RandomState):
        raise CheckpointError(f"the rng state is a RandomState's; cannot restore it into a "
                              f"{type(generator).__name__}")
    have = generator.get_state(legacy=False)["bit_generator"]
    if have != name:
        raise CheckpointError(f"the rng state is for bit generator {name!r}, the RandomState uses {have!r}")
    generator.set_state(inner)
    return generator


_ARRAY = "__ndarray__"  # how rng_state_text marks an array (some bit generators keep their state in one)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {_ARRAY: value.dtype.str, "shape": list(value.shape), "values": value.ravel().tolist()}
    if isinstance(value, np.integer):
        return int(value)
    raise ArgumentTypeError(f"rng_state_text: cannot write a {type(value).__name__} of an rng state")


def _array(obj: Dict[str, Any]) -> Any:
    if _ARRAY not in obj:
        return obj
    try:
        return np.array(obj["values"], dtype=np.dtype(obj[_ARRAY])).reshape(obj["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"not an array of an rng state: {sorted(obj)} ({exc})") from exc


def rng_state_text(state: Any) -> str:
    """States from ``capture_rng_state`` (any nesting of them in dicts and lists) as JSON text, exactly:
    Python's JSON keeps integers of any size, and the integer arrays of some bit generators are marked."""
    return json.dumps(state, default=_plain, sort_keys=True)


def rng_state_from_text(text: str) -> Any:
    """What ``rng_state_text`` wrote, arrays included. Raises CheckpointError for text it did not write."""
    try:
        return json.loads(text, object_hook=_array)
    except ValueError as exc:
        raise CheckpointError(f"not the text of an rng state: {exc}") from exc
