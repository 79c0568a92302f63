"""Parallel strategies built on the collectives and the model layer."""
from .ddp import DDP, DistributedDataParallel, GradientAfterReductionError, UnusedParameterError

__all__ = ["DDP", "DistributedDataParallel", "UnusedParameterError", "GradientAfterReductionError"]
