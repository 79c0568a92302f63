"""What a run shows of itself: ``log`` (the "axonhpc" logger), ``tracing`` (spans on this rank), ``timeline``
(``ax.timeline``: every rank's spans in one trace) and ``doctor`` (``axonhpc doctor``: the flight recorders read
after the fact).

A namespace, not a layer: ``log`` and ``tracing`` sit at the bottom, ``timeline`` above the collectives,
``doctor`` at the top (docs/architecture.md), so this file imports nothing.
"""
