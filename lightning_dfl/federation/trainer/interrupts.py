"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM.

The first signal asks the trainer to stop after the round in progress: the round completes (a
round is the unit a checkpoint restores bit for bit), a checkpoint is written and
:class:`Interrupted` carries the command that resumes. A second signal abandons the round at once; one
that arrives while a checkpoint is written stops the run as soon as the write completes.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: exit codes of a run stopped by a signal (128 + the signal's number)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal: ``exit_code`` (130 SIGINT, 143 SIGTERM), the checkpoint it wrote
    (or the last one on disk) and ``resume_hint``, the command that continues it."""

    def __init__(self, exit_code: int, checkpoint: Path | None, resume_hint: str, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint
        self.resume_hint = resume_hint

    @classmethod
    def after(cls, exit_code: int, what: str, checkpoint: Path, command_line: Sequence[str] | None) -> Interrupted:
        """The stop after ``what`` happened, naming ``checkpoint`` and the command that resumes from it when the
        file exists ("no checkpoint was written" otherwise)."""
        path = checkpoint if checkpoint.is_file() else None
        hint = resume_command(path, command_line) if path is not None else ""
        where = f"checkpoint {path}" if path is not None else "no checkpoint was written"
        return cls(exit_code, path, hint, f"{what}; {where}")


class StopRequest:
    """Set by the first signal; :attr:`exit_code` tells which signal."""

    def __init__(self) -> None:
        self.exit_code: int | None = None
        self.holding = False
        #: a second signal that arrived while :meth:`hold` held it
        self.held: int | None = None

    @property
    def requested(self) -> bool:
        return self.exit_code is not None

    @contextmanager
    def hold(self, on_abandon: Callable[[int], BaseException]) -> Iterator[None]:
        """Within this block (a checkpoint's write) a second signal waits until the block ends, then raises
        ``on_abandon(exit_code)``: the checkpoint is complete, so the resume line can name it."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.held is not None:
            raise on_abandon(self.held)


@contextmanager
def stop_requests(on_abandon: Callable[[int], BaseException]) -> Iterator[StopRequest]:
    """Within this block SIGINT and SIGTERM set the yielded :class:`StopRequest`; a second signal
    raises ``on_abandon(exit_code)`` at once. Outside the main thread no handler is installed."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, frame: object) -> None:
        code = EXIT_CODES.get(signal.Signals(signum), 130)
        if request.requested and request.holding:
            request.held = code
            print(f"\nlightning-dfl: {signal.Signals(signum).name}: stopping once the checkpoint is written",
                  file=sys.stderr, flush=True)
            return
        if request.requested:
            raise on_abandon(code)
        request.exit_code = code
        print(f"\nlightning-dfl: {signal.Signals(signum).name}: finishing the current round, then writing a "
              "checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in EXIT_CODES}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def resume_command(checkpoint: Path, command_line: Sequence[str] | None) -> str:
    """The command that resumes from ``checkpoint``: the run's command line with ``--ckpt_path``
    (replacing any earlier one), or the Python call when the run did not come from the CLI."""
    if not command_line:
        return f"trainer.fit(model, datamodule, ckpt_path={str(checkpoint)!r})"
    args, skip = [], False
    for arg in command_line[1:]:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            args.append(arg)
    return shlex.join([command_line[0], *args, "--ckpt_path", str(checkpoint)])
