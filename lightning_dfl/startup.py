"""How long a run waited for its first round: the start-up its summary prints.

Start-up is counted from the process's start (read from ``/proc/self/stat`` on Linux, elsewhere from this
module's import, which the command line does first of all) or, for a later ``fit`` in the same process, from
the end of the one before it: the imports of torch and Lightning, the configuration, the data and the model.
"""

from __future__ import annotations

import os
import time

_IMPORTED = time.monotonic()
#: the end of the last fit in this process (monotonic seconds), after which the next run's start-up counts
_last_fit_end: float | None = None


def process_start() -> float:
    """The process's start on :func:`time.monotonic`'s clock; this module's import where it cannot be read.

    Linux's ``starttime`` (field 22 of ``/proc/self/stat``, clock ticks after boot) is on the boot-time clock
    since kernel 5.3 and on the monotonic clock before; the later of the two readings is taken, and never a
    time after this module's import.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command's name may hold spaces and ')'
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: the fields after the name start at 3
        now = time.monotonic()
        ages = [time.clock_gettime(clock) - started for clock in (time.CLOCK_BOOTTIME, time.CLOCK_MONOTONIC)]
        age = min(a for a in ages if a >= 0)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
    return min(now - age, _IMPORTED)


def seconds_waited() -> float:
    """Seconds from the process's start, or the end of its previous fit, until now."""
    since = _last_fit_end if _last_fit_end is not None else process_start()
    return time.monotonic() - since


def fit_ended() -> None:
    """Marks the end of a fit: the next run in this process counts its start-up from here."""
    global _last_fit_end
    _last_fit_end = time.monotonic()
