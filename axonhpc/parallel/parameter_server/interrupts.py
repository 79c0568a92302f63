"""A Ctrl-C (SIGINT) that reaches a serving parameter server is raised where its messages are whole.

[Note: where an interrupt lands]
Python raises ``KeyboardInterrupt`` at whatever line the main thread is on when SIGINT arrives: between the header
of a server's reply and the parameters that follow it, say. A worker that had the header would then wait for the
rest, and the server's last word (``server``'s note) could not reach it. While ``serve()`` runs its loop on the
main thread under Python's own SIGINT handler, ``HeldInterrupt`` takes the signal instead and the loop raises the
``KeyboardInterrupt`` at the top of its next sweep (at most ``POLL_MAX`` later when it is idle), where no message is
half sent. A second SIGINT before then raises at once, so a loop stuck inside a call still ends on Ctrl-C. A
``KeyboardInterrupt`` raised by code the loop runs (the optimizer) is raised as it is: it never lands inside a
reply.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Optional


class HeldInterrupt:
    """Within ``with HeldInterrupt() as held:``, SIGINT is held until ``held.check()`` (see the note).

    It changes nothing off the main thread, or where SIGINT has a handler other than Python's own.
    """

    def __init__(self) -> None:
        self.held = False  # a SIGINT waits for ``check``
        self._previous: Optional[Any] = None

    def __enter__(self) -> "HeldInterrupt":
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._take)
        return self

    def _take(self, signum: int, frame: Any) -> None:
        if self.held:  # the second: at once
            self.check(frame)
        self.held = True

    def check(self, frame: Any = None) -> None:
        """Raise ``KeyboardInterrupt`` if a SIGINT is held (once: it is delivered)."""
        if self.held:
            self.held = False
            signal.default_int_handler(signal.SIGINT, frame)  # Python's own handler, held from: it raises

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if exc_type is None:
            self.check()  # one that came after the last check is not lost
        return False


__all__ = ["HeldInterrupt"]
