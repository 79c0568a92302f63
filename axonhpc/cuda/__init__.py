"""CUDA graphs and device kernels: ``capture`` (a step being captured, as the layers see it), ``kernels``
(device elementwise kernels built once and kept) and ``graphs`` (``ax.graph_step``).

A namespace, not a layer: ``capture`` and ``kernels`` sit under the models, ``graphs`` above ``parallel``
(docs/architecture.md), so this file imports nothing.
"""
