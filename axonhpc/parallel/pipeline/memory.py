"""Closed-form activation memory and bubble of pipeline schedules.

[Note: formulas]
With p pipeline stages (one per rank), m micro-batches and the same forward
time f and backward time b on every stage:

- GPipe runs every forward before any backward, so each stage holds the
  activations of all m micro-batches at its peak: ``m``.
- 1F1B lets rank r run only ``min(p - r - 1, m)`` forwards before its first
  backward, and from then on one backward frees a micro-batch for every new
  forward, so rank r holds at most ``min(p - r, m)``; the first stage holds
  the most, ``min(p, m)``.
- Both take ``(m + p - 1) * (f + b)``: the last micro-batch's forward enters
  the last stage after ``p - 1`` forward steps and its backward needs ``p - 1``
  more backward steps to reach the first stage, while each rank is busy for
  only ``m * (f + b)``. The idle fraction over all ranks is therefore
  ``(p - 1) / (m + p - 1)``, whatever f and b are.
- Megatron's interleaved 1F1B with v chunks per rank (m a multiple of p) cuts
  every stage's work into v chunks of time ``(f + b) / v``; the fill and
  drain still span ``p - 1`` chunk steps, so the idle fraction falls to
  ``(p - 1) / (v * m + p - 1)``. (The simulator reproduces this exactly for
  the schedules ``pipeline_schedule`` generates with f = 1 and b = 1 or 2.)

``axonhpc.parallel.pipeline.simulate.simulate_pipeline`` measures the same
quantities for any schedule; the tests check that the two agree.
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigurationError


def _check(p: Any, m: Any, v: Any = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive int, got {value!r}")


class PipelineMemoryStats:
    """Closed-form peak activations and bubble of GPipe and 1F1B (see the module note)."""

    @staticmethod
    def gpipe_peak_activations(p: int, m: int) -> int:
        """Micro-batches whose activations a GPipe stage holds at its peak: ``m``.

        Args:
            p: number of pipeline stages (ranks).
            m: number of micro-batches.

        Returns:
            ``m`` (every stage, independent of p).

        Raises:
            ConfigurationError: p or m is not a positive int.
        """
        _check(p, m)
        return m

    @staticmethod
    def one_f_one_b_peak_activations(p: int, m: int) -> int:
        """Micro-batches the first stage holds at its peak under 1F1B: ``min(p, m)``.

        Rank r holds at most ``min(p - r, m)``; the first stage holds the most.

        Args:
            p: number of pipeline stages (ranks).
            m: number of micro-batches.

        Returns:
            ``min(p, m)``.

        Raises:
            ConfigurationError: p or m is not a positive int.
        """
        _check(p, m)
        return min(p, m)

    @staticmethod
    def bubble_fraction(p: int, m: int) -> float:
        """Idle fraction of GPipe and 1F1B over all ranks: ``(p - 1) / (m + p - 1)``.

        Args:
            p: number of pipeline stages (ranks).
            m: number of micro-batches.

        Returns:
            The fraction of rank-time spent idle, for equal costs on every stage.

        Raises:
            ConfigurationError: p or m is not a positive int.
        """
        _check(p, m)
        return (p - 1) / (m + p - 1)

    @staticmethod
    def interleaved_bubble_fraction(p: int, m: int, v: int) -> float:
        """Idle fraction of interleaved 1F1B over all ranks: ``(p - 1) / (v * m + p - 1)``.

        Args:
            p: number of pipeline ranks.
            m: number of micro-batches (a multiple of p for the schedule to exist).
            v: model chunks (stages) per rank; v = 1 gives ``bubble_fraction(p, m)``.

        Returns:
            The fraction of rank-time spent idle, for equal costs on every stage.

        Raises:
            ConfigurationError: p, m or v is not a positive int.
        """
        _check(p, m, v)
        return (p - 1) / (v * m + p - 1)


__all__ = ["PipelineMemoryStats"]
