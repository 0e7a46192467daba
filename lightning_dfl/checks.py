"""Argument checks shared by every layer: integers and numbers, with messages that name the value.

Pure Python. ``bool`` is never an integer or a number here (``True`` as a batch size is a mistake);
numpy integers and floats are (they register with :mod:`numbers`). A value refused raises
:class:`~lightning_dfl.errors.ConfigurationError` (a ``ValueError`` and a ``TypeError``): bad input, which the
command line reports in one line.
"""

from __future__ import annotations

import math
import numbers

from lightning_dfl.errors import ConfigurationError

__all__ = ["check_int", "check_output_path", "check_positive", "is_int", "is_number"]


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

    Otherwise raises ``ConfigurationError`` (a ``ValueError``) naming ``name``, the allowed range and the value,
    e.g. ``"batch_size must be an integer >= 1, got 0"``.
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
    raise ConfigurationError(f"{name} must be an integer{allowed}, got {value!r}")


def check_positive(name: str, value: object) -> float:
    """``value`` as a ``float`` if it is a finite number > 0, else ``ConfigurationError`` naming ``name`` and the
    value."""
    if is_number(value) and value > 0:
        return float(value)
    raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; else a ``ConfigurationError`` naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


#: the longest path the command line accepts, and the longest name of one folder or file in it (Linux's limits)
MAX_PATH = 4096
MAX_NAME = 255


def check_output_path(name: str, path: object, folder: bool = True) -> str:
    """``path`` as a ``str`` if a folder (``folder``) or a file can be created there: a non-empty path of at most
    :data:`MAX_PATH` bytes whose names have at most :data:`MAX_NAME` bytes each, under no existing file, and (for a
    file) not an existing folder. Else a ``ConfigurationError`` naming ``name``, the path and what is allowed.
    Nothing is created."""
    import os
    from pathlib import Path

    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ConfigurationError(f"{name} must be a {'folder' if folder else 'file'} path, got {path!r}")
    text = str(path)
    shown = repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text.encode())} bytes)"
    if len(text.encode()) > MAX_PATH:
        raise ConfigurationError(f"{name} {shown} is too long: a path may have at most {MAX_PATH} bytes")
    long = next((p for p in Path(text).parts if len(p.encode()) > MAX_NAME), None)
    if long is not None:
        raise ConfigurationError(f"{name} {shown} holds a name of {len(long.encode())} bytes ({long[:40]!r}...): a "
                                 f"folder or file name may have at most {MAX_NAME} bytes")
    target = Path(text).expanduser()
    if target.is_dir() and not folder:
        raise ConfigurationError(f"{name} {shown} is a folder; give a file path")
    if target.exists() and not target.is_dir() and folder:
        raise ConfigurationError(f"{name} {shown} is a file; give a folder path")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigurationError(f"{name} {shown} lies under {str(parent)!r}, which is a file, not a folder")
    return text
