"""Rank 0's progress through an epoch: tqdm's bar on a terminal, a plain line now and then in a file.

[Note: progress in a file]
tqdm redraws its bar with carriage returns. In an sbatch ``.out`` file (stdout
not a terminal) every redraw stays: one epoch of the digits demo left 43-55 KB
of ``\\r``-joined bars. So where stdout is not a terminal the trainer prints a
plain line (tqdm's own text of the bar, ``tqdm.format_meter``, or a short one
without tqdm) every N percent of the epoch or every N seconds, whichever comes
first, and at the end of the epoch; ``DistributedTrainer(progress="5%")`` or
``progress="30s"`` sets how often (default ``"10%"`` and at most a minute
apart).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Optional, Tuple, Union

from ..errors import ConfigurationError

DEFAULT_PERCENT, DEFAULT_SECONDS = 10.0, 60.0


def parse_every(value: Union[bool, str]) -> Tuple[float, float]:
    """``(percent, seconds)`` between plain lines from the trainer's ``progress`` argument.

    Raises:
        ConfigurationError: a string that is not ``"N%"`` or ``"Ns"`` with N positive.
    """
    if value is True:
        return DEFAULT_PERCENT, DEFAULT_SECONDS
    text = str(value).strip().lower()
    try:
        if text.endswith("%") and float(text[:-1]) > 0:
            return float(text[:-1]), float("inf")
        if text.endswith("s") and float(text[:-1]) > 0:
            return float("inf"), float(text[:-1])
    except ValueError:
        pass
    raise ConfigurationError(f"progress={value!r}: use True, False, 'N%' (a line every N percent of an epoch) or "
                             f"'Ns' (a line every N seconds) for output that is not a terminal")


class Progress:
    """One epoch's progress on rank 0 (see the module note).

    Args:
        total: steps in the epoch.
        initial: steps already done (a resumed epoch).
        desc: the label ("epoch 3/20").
        every: ``parse_every``'s ``(percent, seconds)``.
        stream: where to write (default ``sys.stdout``, looked up at each call).
    """

    def __init__(self, total: int, initial: int, desc: str, every: Tuple[float, float], stream: Any = None):
        self.total, self.n, self.desc = total, initial, desc
        self.percent, self.seconds = every
        self.stream = stream
        self.start = self.last = time.monotonic()
        self.last_n = initial
        self.postfix = ""
        self.bar = None
        out = self._out()
        if out.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, leave=False, file=out, dynamic_ncols=True)
            except ImportError:
                pass

    def _out(self) -> Any:
        return self.stream if self.stream is not None else sys.stdout

    def update(self, loss: Optional[float] = None) -> None:
        """One more step (with its loss, shown beside the count)."""
        self.n += 1
        if loss is not None:
            self.postfix = f"loss={loss:.4f}"
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}")
            return
        now = time.monotonic()
        step_percent = 100.0 * (self.n - self.last_n) / max(self.total, 1)
        if self.n < self.total and step_percent < self.percent and now - self.last < self.seconds:
            return
        self.last, self.last_n = now, self.n
        self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        try:
            from tqdm import tqdm

            text = tqdm.format_meter(self.n, self.total, elapsed, prefix=self.desc, postfix=self.postfix or None,
                                     ncols=None)
        except ImportError:
            text = f"{self.desc}: {self.n}/{self.total} steps, {elapsed:.1f} s" + (
                f", {self.postfix}" if self.postfix else "")
        print(text, file=self._out(), flush=True)

    def close(self) -> None:
        """End the epoch's display (tqdm's bar; a line was printed for the last step already)."""
        if self.bar is not None:
            self.bar.close()


__all__ = ["Progress", "parse_every"]
