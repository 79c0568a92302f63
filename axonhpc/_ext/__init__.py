"""Compiled core built from ``cython_src/*.pyx``: buffers and the shared-memory engine (use them through
``axonhpc.bucketing``), and the host kernels of the layers and optimizers (``_layers``, ``_updates``; used by
``axonhpc.nn`` and ``axonhpc.optim`` through ``axonhpc._kernels.host_modules``)."""
