"""What a failed run was: bad input, a known condition of the training, or a bug (no torch import here).

- Bad input is refused by validation, before the first round (``ValueError``, :class:`ConfigurationError`
  and the like): the command line prints one line and exits with 2.
- :class:`RunDiverged`: every client that trained in a round ended non-finite (a learning rate too
  high, data holding NaN/inf): a known, explained condition; one line naming the round, the clients and
  the likely cause, exit code :data:`DIVERGED_EXIT_CODE`.
- :class:`RunFileError`: a file of the run folder could not be written (a read-only folder, a full disk) or
  read (a damaged ``metrics.csv``): the machine's or the file's condition, not a bug, also inside a round; one
  line naming the file and the OS's cause, exit code 2.
- :class:`MachinesDidNotMeet`: the machines of a several-machine run did not meet within ``rendezvous_timeout`` (one
  was not started, or cannot reach the first's address and port): one line naming the machines missing and the
  command that starts them, exit code 2.
- :class:`MissingExtra`: a feature's optional extra is not installed (matplotlib, tensorboard): one line with the
  ``pip install`` command, exit code 2.
- Anything else raised inside a round is a bug, whatever its type: the trainer marks it with the round
  (:func:`mark_in_round`) and the command line shows its traceback, exit 1, and where to report it.
"""

from __future__ import annotations

import csv
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

#: the exit code of a run stopped because every client diverged (2 is bad input, 1 a bug)
DIVERGED_EXIT_CODE = 3

_ROUND_ATTRIBUTE = "lightning_dfl_round"


class ConfigurationError(TypeError, ValueError):
    """A value the user gave (a config value, an option a class lacks) that the project's own argument checks
    refuse: bad input, not a bug, told apart by its type. Both a ``TypeError`` (an option of the wrong kind, one a
    builder does not take) and a ``ValueError`` (a value out of range), so that callers catching either keep
    catching it."""


class RunDiverged(FloatingPointError):
    """Every client that trained in a round ended with non-finite weights or loss: the run stops."""

    exit_code = DIVERGED_EXIT_CODE


class MachinesDidNotMeet(ValueError):
    """The machines of a run over several machines (``num_nodes`` > 1) did not meet within ``rendezvous_timeout``, or
    the first one cannot serve or be reached at ``MASTER_ADDR:MASTER_PORT``: the message names the machines missing
    and how to start them."""


class MissingExtra(ImportError):
    """A feature needs an optional extra that is not installed (matplotlib for figures, tensorboard for its logger
    and runs): the message names the ``pip install`` command; bad set-up, not a bug (exit code 2)."""


class RunFileError(ValueError):
    """A file of a run could not be written (read-only folder, disk full) or read (damaged, not text): the
    message names the file and the cause."""


def _os_cause(err: OSError) -> str:
    code = f" ({errno.errorcode.get(err.errno, err.errno)})" if err.errno else ""
    return f"{err.strerror or err}{code}"


@contextmanager
def writing(path: str | os.PathLike | None) -> Iterator[None]:
    """Turn an ``OSError`` raised while writing ``path`` (a file of the run folder) into a :class:`RunFileError`
    naming the file and the OS's cause (no space left, read-only file system, permission denied)."""
    try:
        yield
    except RunFileError:
        raise
    except OSError as err:
        where = str(err.filename) if err.filename else str(path)
        raise RunFileError(f"cannot write {where!r}: {_os_cause(err)}; free space on that disk or choose another "
                           "run folder (trainer.default_root_dir)") from err


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Turn an error raised while reading the text file ``path`` (a run's CSV) into a :class:`RunFileError`
    naming it: an ``OSError``, bytes that are not UTF-8 text, a malformed CSV."""
    try:
        yield
    except RunFileError:
        raise
    except OSError as err:
        raise RunFileError(f"cannot read {str(path)!r}: {_os_cause(err)}") from err
    except (UnicodeDecodeError, csv.Error) as err:
        raise RunFileError(f"cannot read {str(path)!r}: it is not a CSV file written by lightning-dfl "
                           f"({type(err).__name__}: {err})") from err
    except (ValueError, KeyError) as err:  # a cell that is not a number, a row without a column it must have
        if str(path) in str(err):  # a message of the reader's own, naming the file
            raise
        what = f"no column {err}" if isinstance(err, KeyError) else str(err)
        raise RunFileError(f"cannot read {str(path)!r}: it is damaged or not a file written by lightning-dfl "
                           f"({what})") from err


def mark_in_round(err: BaseException, round_idx: int) -> None:
    """Record that ``err`` was raised inside round ``round_idx`` (after validation: not bad input)."""
    if getattr(err, _ROUND_ATTRIBUTE, None) is None:
        try:
            setattr(err, _ROUND_ATTRIBUTE, round_idx)
        except AttributeError:  # an exception type without a __dict__: left unmarked
            pass


def raised_in_round(err: BaseException) -> int | None:
    """The round ``err`` (or an exception it was raised from / during) was raised in, else ``None``."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen:
        round_idx = getattr(current, _ROUND_ATTRIBUTE, None)
        if round_idx is not None:
            return int(round_idx)
        seen.append(current)
        current = current.__cause__ or current.__context__
    return None
