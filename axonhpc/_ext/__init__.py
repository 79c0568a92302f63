"""Compiled core built from ``cython_src/*.pyx``: buffers and the shared-memory engine (use them through
``axonhpc.bucketing``), and the host kernels of the layers and optimizers (``_layers``, ``_updates``; used by
``axonhpc.nn`` and ``axonhpc.optim`` through ``host_modules``)."""
from typing import Any, Tuple


class _Host:
    layers: Any = None
    updates: Any = None
    loaded = False


def host_modules() -> Tuple[Any, Any]:
    """The compiled host kernels ``(axonhpc._ext._layers, axonhpc._ext._updates)``; None for each one not built.

    See [Note: host kernels] in ``axonhpc.nn.kernels``. An installation that did not compile
    the Cython core (a source tree without ``build_ext``) keeps the numpy code everywhere.
    """
    if not _Host.loaded:
        try:
            from . import _layers as layers
        except ImportError:
            layers = None
        try:
            from . import _updates as updates
        except ImportError:
            updates = None
        _Host.layers, _Host.updates, _Host.loaded = layers, updates, True
    return _Host.layers, _Host.updates
