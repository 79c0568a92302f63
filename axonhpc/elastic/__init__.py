"""Training that goes on when ranks die: shrink the world on ULFM, rebuild, redo the step (docs/fault-tolerance.md).

- ``loop``: ``ElasticTraining``, the steps and the recovery;
- ``buddy``: ``BuddyCopies``, each FSDP shard kept on a second rank;
- ``state``: the whole model and optimizer state gathered from the survivors' pieces;
- ``spares`` and ``respawn``: ranks that take the places of lost ones, started with the job or spawned.
"""
from .buddy import BuddyCopies
from .loop import KILL_POINTS, ElasticTraining, Recovery, parse_failures
from .respawn import is_replacement

__all__ = ["ElasticTraining", "Recovery", "BuddyCopies", "parse_failures", "KILL_POINTS", "is_replacement"]
