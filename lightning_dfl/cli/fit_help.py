"""Where ``lightning-dfl fit --help`` (or a class's help) comes from: the text kept in the package
(:mod:`lightning_dfl.cli.kept_help`), else the one kept in the user's cache, else rendered (seconds: torch and
Lightning are imported) and then cached."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_dfl.cli.help import version
from lightning_dfl.cli.kept_help import kept_text, library_versions, render_fit_help, source_folders

__all__ = ["CLASS_HELP", "fit_help", "fit_help_request"]

#: a class's help in ``fit``: ``--trainer.algorithm.help=DADPFL`` or ``--trainer.algorithm.help DADPFL``
CLASS_HELP = re.compile(r"--[\w.]+\.help(=.*)?")
#: ``$LIGHTNING_DFL_CACHE`` (the data cache's variable) values that turn caching off
_CACHE_OFF = ("0", "off", "false", "no", "none", "disable", "disabled")


def fit_help_request(args: Sequence[str]) -> str | None:
    """``fit --help`` or one class's help alone (``fit --trainer.algorithm.help=DADPFL``): the request as the
    help texts are kept (``"--help"``, ``"--trainer.algorithm.help=DADPFL"``); None for any other command."""
    if len(args) < 2 or args[0] != "fit":
        return None
    rest = list(args[1:])
    if rest in (["--help"], ["-h"]):
        return "--help"
    if len(rest) == 1 and CLASS_HELP.fullmatch(rest[0]) and "=" in rest[0]:
        return rest[0]
    if len(rest) == 2 and CLASS_HELP.fullmatch(rest[0]) and "=" not in rest[0] and not rest[1].startswith("-"):
        return f"{rest[0]}={rest[1]}"
    return None


def _help_cache() -> Path | None:
    """Where ``fit --help`` is kept: ``help/`` in ``$LIGHTNING_DFL_CACHE``, else ``~/.cache/lightning-dfl/help``."""
    root = os.environ.get("LIGHTNING_DFL_CACHE", "").strip()
    if root.lower() in _CACHE_OFF and root:
        return None
    return Path(root or "~/.cache/lightning-dfl").expanduser() / "help"


def _help_key(request: str) -> str:
    """The user cache's key of a help text: the project's sources (their sizes and times), the versions of
    Python, lightning-dfl and the libraries that write the help, the terminal's width and the request."""
    import hashlib
    import shutil

    digest = hashlib.sha256(f"{sys.version}|{version()}|{shutil.get_terminal_size().columns}|{request}|"
                            f"{library_versions()}".encode())
    for folder in source_folders():
        for path in sorted(folder.rglob("*.py")):
            stat = path.stat()
            digest.update(f"|{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def fit_help(request: str = "--help") -> str:
    """The text of ``lightning-dfl fit <request>`` (``--help`` or a class's help): the one kept in the package
    when it was written for these sources; else written once (seconds) into the user's cache and read from there
    until a source file, a library or the terminal's width changes."""
    text = kept_text(request)
    if text is not None:
        return text
    folder = _help_cache()
    name = "fit" if request == "--help" else "class"
    path = folder / f"{name}-{_help_key(request)}.txt" if folder is not None else None
    if path is not None and path.is_file():
        return path.read_text()
    text = render_fit_help(request)
    if path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if name == "fit":
                for old in folder.glob("fit-*.txt"):
                    old.unlink(missing_ok=True)
            temporary = folder / f".{path.name}.{os.getpid()}.tmp"
            temporary.write_text(text)
            os.replace(temporary, path)
        except OSError:  # a read-only or full cache: the help is still printed
            pass
    return text
