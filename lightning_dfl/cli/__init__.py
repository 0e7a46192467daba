"""The command line, ``lightning-dfl``: :func:`main` is the console script.

One concern per module, all but :mod:`~lightning_dfl.cli.fit` free of torch and Lightning, so that
``lightning-dfl --help``, ``--version``, a kept ``fit --help`` and the analysis subcommands start in a moment:

- :mod:`lightning_dfl.cli.entry`: the entry point, the usage and the subcommands' dispatch;
- :mod:`lightning_dfl.cli.errors`: bad input, a diverged run or a bug: the one-line messages and exit codes;
- :mod:`lightning_dfl.cli.help`: help formatting (plain text, the allowed names of every choice);
- :mod:`lightning_dfl.cli.kept_help`: ``fit``'s help texts kept in the package, their key and their writer
  (``python -m lightning_dfl.cli.kept_help``); :mod:`lightning_dfl.cli.fit_help`: the kept, cached or rendered
  text of a ``fit`` help request;
- :mod:`lightning_dfl.cli.fit`: the LightningCLI of ``fit`` (imports torch and Lightning);
- :mod:`lightning_dfl.cli.analysis`: ``schedule``, ``cost``, ``curves`` and ``export``;
  :mod:`lightning_dfl.cli.plot`: ``plot``;
- :mod:`lightning_dfl.cli.config_files`: ``--config`` files checked before they are read.

``FederatedCLI`` and ``FederatedArgumentParser`` (``from lightning_dfl.cli import FederatedCLI``) are imported from
:mod:`lightning_dfl.cli.fit` on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

__all__ = ["FederatedArgumentParser", "FederatedCLI", "main"]

def main(argv: Sequence[str] | None = None) -> None:
    """The ``lightning-dfl`` console script (:func:`lightning_dfl.cli.entry.main`); importing this package
    imports none of its modules, so that ``python -m lightning_dfl.cli.kept_help`` runs its module once."""
    from lightning_dfl.cli.entry import main as entry_main

    entry_main(argv)


#: the classes of ``fit`` (torch and Lightning), imported on first use
_LAZY = {"FederatedCLI": "lightning_dfl.cli.fit", "FederatedArgumentParser": "lightning_dfl.cli.fit"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
