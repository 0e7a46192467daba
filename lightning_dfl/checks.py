"""Argument checks shared by every layer: integers and numbers, with messages that name the value.

Pure Python. ``bool`` is never an integer or a number here (``True`` as a batch size is a mistake);
numpy integers and floats are (they register with :mod:`numbers`).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_int", "check_positive", "is_int", "is_number"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (``int``, ``numpy.int64``, ...), ``bool`` excluded."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object, finite: bool = True) -> bool:
    """Whether ``value`` is a real number, ``bool`` excluded; with ``finite``, NaN and infinities are not."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer in ``[minimum, maximum]`` (either bound optional).

    Otherwise raises ``ValueError`` naming ``name``, the allowed range and the value, e.g.
    ``"batch_size must be an integer >= 1, got 0"``.
    """
    if is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return int(value)
    if minimum is not None and maximum is not None:
        allowed = f" in [{minimum}, {maximum}]"
    elif minimum is not None:
        allowed = f" >= {minimum}"
    elif maximum is not None:
        allowed = f" <= {maximum}"
    else:
        allowed = ""
    raise ValueError(f"{name} must be an integer{allowed}, got {value!r}")


def check_positive(name: str, value: object) -> float:
    """``value`` as a ``float`` if it is a finite number > 0, else ``ValueError`` naming ``name`` and the value."""
    if is_number(value) and value > 0:
        return float(value)
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; else a ``ValueError`` naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
