"""Distributed data parallelism: every rank holds the model, gradients are averaged in buckets.

- ``wrapper``: ``DistributedDataParallel``: bucketed all-reduce overlapped with
  backward, ``no_sync``, ``join`` for uneven inputs, communication hooks.
- ``buckets``: a gradient bucket and its reduction's state; the buckets laid
  out in the node's shared window.
- ``join``: ``Joiner``, what ``ddp.join()`` runs (flag exchange, shadowing,
  the final model).
- ``autotune``: the bucket size measured on this machine at start-up
  (``bucket_size_mb="auto"``).
"""
from .wrapper import DDP, DistributedDataParallel, GradientAfterReductionError, UnusedParameterError

__all__ = ["DDP", "DistributedDataParallel", "GradientAfterReductionError", "UnusedParameterError"]
