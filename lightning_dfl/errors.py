"""What a failed run was: bad input, a known condition of the training, or a bug (no torch import here).

- Bad input is refused by validation, before the first round (``ValueError`` and the like): the command
  line prints one line and exits with 2.
- :class:`RunDiverged`: every client that trained in a round ended non-finite (a learning rate too
  high, data holding NaN/inf): a known, explained condition; one line naming the round, the clients and
  the likely cause, exit code :data:`DIVERGED_EXIT_CODE`.
- Anything else raised inside a round is a bug, whatever its type: the trainer marks it with the round
  (:func:`mark_in_round`) and the command line shows its traceback, exit 1, and where to report it.
"""

from __future__ import annotations

#: the exit code of a run stopped because every client diverged (2 is bad input, 1 a bug)
DIVERGED_EXIT_CODE = 3

_ROUND_ATTRIBUTE = "lightning_dfl_round"


class RunDiverged(FloatingPointError):
    """Every client that trained in a round ended with non-finite weights or loss: the run stops."""

    exit_code = DIVERGED_EXIT_CODE


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
