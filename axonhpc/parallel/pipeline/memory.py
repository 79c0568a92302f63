"""Closed-form activation memory and bubble of pipeline schedules.

[Note: formulas]
With p stages (one per rank), m micro-batches and equal forward time f and backward time b on every stage:
GPipe holds all m micro-batches' activations at its peak. 1F1B lets rank r run only ``min(p - r - 1, m)``
forwards before its first backward and then frees one micro-batch per new forward, so it holds at most
``min(p - r, m)``. Both take ``(m + p - 1) * (f + b)`` (fill and drain span ``p - 1`` steps each way) while
each rank is busy ``m * (f + b)``, so the idle fraction is ``(p - 1) / (m + p - 1)`` whatever f and b are.
Interleaved 1F1B with v chunks per rank cuts each step into v, giving ``(p - 1) / (v * m + p - 1)``.
``simulate.simulate_pipeline`` measures the same for any schedule; the tests check that the two agree.
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
        """Micro-batches whose activations a GPipe stage holds at its peak: ``m``, whatever p."""
        _check(p, m)
        return m

    @staticmethod
    def one_f_one_b_peak_activations(p: int, m: int) -> int:
        """Micro-batches the first stage holds at its peak under 1F1B: ``min(p, m)`` (rank r: ``min(p - r, m)``)."""
        _check(p, m)
        return min(p, m)

    @staticmethod
    def bubble_fraction(p: int, m: int) -> float:
        """Idle fraction of GPipe and 1F1B over all ranks: ``(p - 1) / (m + p - 1)``."""
        _check(p, m)
        return (p - 1) / (m + p - 1)

    @staticmethod
    def interleaved_bubble_fraction(p: int, m: int, v: int) -> float:
        """Idle fraction of interleaved 1F1B over all ranks: ``(p - 1) / (v * m + p - 1)``.

        All four raise ConfigurationError unless p, m (and v) are positive ints.
        """
        _check(p, m, v)
        return (p - 1) / (v * m + p - 1)


__all__ = ["PipelineMemoryStats"]
