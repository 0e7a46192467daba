"""What a path is, and the regular files of a folder tree walked without hanging.

Opening a FIFO blocks until a writer comes, reading a device such as ``/dev/zero`` never ends, and a symbolic link
to a folder's own ancestor makes a walk that follows links loop forever. Every file the package reads from a path a
user gives (a config, a checkpoint, an image) is therefore checked to be a regular file first
(:func:`check_regular_file`), and image folders are walked with :func:`regular_files`: each real folder once, only
regular files. Pure Python.
"""

from __future__ import annotations

import heapq
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from lightning_dfl.errors import ConfigurationError

__all__ = ["check_regular_file", "path_kind", "regular_files"]

_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def path_kind(path: str | os.PathLike) -> str:
    """What ``path`` is, after following links: ``"a regular file"``, ``"a folder"``, ``"a FIFO (named pipe)"``, a
    device, a socket, ``"a broken link"`` or ``"missing"``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else "missing"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a ``Path`` if it is a regular file (or a link to one); else a ``ConfigurationError`` naming
    ``what``, the path and what it is (nothing is opened)."""
    kind = path_kind(path)
    if kind != "a regular file":
        shown = repr(str(path))
        raise ConfigurationError(f"{what} {shown} does not exist" if kind == "missing" else
                                 f"{what} {shown} is {kind}, not a regular file")
    return Path(path)


def regular_files(folder: str | os.PathLike, extensions: Iterable[str]) -> list[str]:
    """The regular files under ``folder`` whose names end with one of ``extensions`` (case-insensitive), in
    torchvision's ``make_dataset`` order (folders by path, files by name). Links are followed, but each real folder
    is walked once (a link to an ancestor, or two links to one folder, add nothing). A name with one of the
    extensions that is not a regular file (a FIFO, a device, a broken link) is refused: ``ConfigurationError``."""
    ends = tuple(e.lower() for e in extensions)
    seen: set[str] = set()
    found: list[tuple[str, list[str]]] = []
    pending = [str(folder)]  # a heap: folders walked in path order, so which link to a folder counts is fixed
    while pending:
        current = heapq.heappop(pending)
        real = os.path.realpath(current)
        if real in seen:
            continue
        seen.add(real)
        files = []
        with os.scandir(current) as entries:
            for entry in entries:
                kind = path_kind(entry.path)
                if kind == "a folder":
                    heapq.heappush(pending, entry.path)
                elif entry.name.lower().endswith(ends):
                    if kind != "a regular file":  # it would block, never end, or fail to open: say so
                        raise ConfigurationError(f"{entry.path!r} is {kind}, not a regular file: an image folder "
                                                 "holds image files (and folders) only")
                    files.append(entry.name)
        found.append((current, sorted(files)))
    return [os.path.join(root, name) for root, names in sorted(found) for name in names]
