"""The training loop on top of the parallel strategies: data, metrics, checkpoints, resume, preemption."""
from .preemption import PREEMPTED_EXIT_CODE, Preemption
from .strategies import STRATEGIES
from .trainer import DistributedTrainer

__all__ = ["DistributedTrainer", "Preemption", "PREEMPTED_EXIT_CODE", "STRATEGIES"]
