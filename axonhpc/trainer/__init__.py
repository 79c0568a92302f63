"""The training loop on top of the parallel strategies: data, metrics, checkpoints, resume, preemption."""
from .preemption import PREEMPTED_EXIT_CODE, Preemption, PreemptedExit
from .strategies import STRATEGIES
from .trainer import DistributedTrainer

__all__ = ["DistributedTrainer", "Preemption", "PreemptedExit", "PREEMPTED_EXIT_CODE", "STRATEGIES"]
