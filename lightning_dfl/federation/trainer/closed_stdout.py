"""A run outlives a closed stdout: ``lightning-dfl fit ... | head -1`` keeps training and writes its results.

Within :func:`tolerating_closed_stdout`, ``sys.stdout`` is a wrapper whose writes and flushes, once the reader has
gone (``BrokenPipeError``), go to the null device instead of ending the run: the rounds, checkpoints, ``metrics.csv``
and ``summary.json`` are written as without the pipe. The guard's ``closed`` says whether that happened, so the
command can say so and exit with 1 (its printed output was cut short) after the results are safe.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["StdoutGuard", "tolerating_closed_stdout"]


class StdoutGuard:
    """``sys.stdout``'s stand-in: writes through until the reader closes it, then to the null device."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.closed_by_reader = False

    def _closed(self) -> None:
        self.closed_by_reader = True
        try:  # later writes and the interpreter's last flush of the real stream go to the null device too
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError, AttributeError):  # a stream without a file descriptor (a test's capture)
            pass

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._closed()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._closed()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... as the real stream's
        return getattr(self._stream, name)


@contextlib.contextmanager
def tolerating_closed_stdout() -> Iterator[StdoutGuard]:
    """Within this block a closed stdout does not end the run (module docstring)."""
    previous = sys.stdout
    guard = StdoutGuard(previous)
    sys.stdout = guard
    try:
        yield guard
    finally:
        if sys.stdout is guard:
            sys.stdout = previous
