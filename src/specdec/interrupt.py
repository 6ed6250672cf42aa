"""Ctrl-C while the command's libraries import (see :mod:`specdec.entry`): a watch that
remembers it came however those libraries handled it. Imports nothing heavy."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class InterruptWatch:
    """A context that remembers whether Ctrl-C (SIGINT) came while it was open.

    Ctrl-C raises ``KeyboardInterrupt`` wherever Python is; during the imports of the
    CLI's libraries that can be inside code that does not let it through: a destructor
    (Python prints "Exception ignored in ..." and goes on) or an import machinery that
    turns it into an ``ImportError`` of a partially initialized module. The watch's
    handler raises ``KeyboardInterrupt`` as Python's does, and records that it came, so
    the caller can stop cleanly however the interrupt was handled on the way.

    A SIGINT the process was started ignoring (a shell script's background job) stays
    ignored.

    Attributes:
        seen: ``True`` once a SIGINT arrived inside the context.
    """

    def __init__(self) -> None:
        self.seen = False
        self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> InterruptWatch:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return self  # ignored as the parent asked (e.g. a background job of a script)
        try:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: signals go elsewhere
            self._previous = None
        return self

    def __exit__(self, *exc) -> bool:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def interrupted() -> int:
    """Say so on standard error; returns the exit status after Ctrl-C (128 + SIGINT)."""
    print("\nspecdec: interrupted", file=sys.stderr)
    return 130


def watched(load: Callable[[], T]) -> tuple[T | None, int | None]:
    """Call ``load`` (imports, parser building) under an :class:`InterruptWatch`.

    Returns:
        ``(load's value, None)``, or ``(None, 130)`` after Ctrl-C (said on standard error),
        whether the interrupt reached here, became another error on the way, or was
        swallowed by a library.
    """
    with InterruptWatch() as watch:
        try:
            value = load()
        except KeyboardInterrupt:
            return None, interrupted()
        except Exception:
            if watch.seen:  # Ctrl-C that a library turned into another error
                return None, interrupted()
            raise
    if watch.seen:  # Ctrl-C that a library swallowed
        return None, interrupted()
    return value, None
