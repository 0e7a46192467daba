"""Write ``fit``'s help texts into the package (``lightning_dfl/help_texts.json``), so that the first
``lightning-dfl fit --help`` (and ``--trainer.algorithm.help=DADPFL``, ...) of a fresh clone is shown without
importing torch and Lightning. Run after changing a source file: ``python -m lightning_dfl.help_texts``
(the test suite checks that the kept texts are those of the sources). Texts written with other versions of
Python or of the libraries that write the help are not shown: the help is rendered (and cached) as usual."""

from __future__ import annotations

import json
import os

from lightning_dfl.cli import KEPT_HELP, KEPT_HELP_WIDTH, help_environment, help_source_key, render_fit_help

#: our callbacks, offered by ``--trainer.callbacks.help``
CALLBACKS = ("RigL", "PruningTimeVoting", "PQIPruning")


def requests() -> list[str]:
    """The help requests kept: ``--help``, every algorithm's, the clock's and our callbacks'."""
    from lightning_dfl.federation.algorithms import ALGORITHMS

    return ["--help", *(f"--trainer.algorithm.help={cls.__name__}" for cls in ALGORITHMS.values()),
            "--trainer.clock.help=Clock", *(f"--trainer.callbacks.help={name}" for name in CALLBACKS)]


def render_all() -> dict[str, str]:
    """Every kept request's text, rendered at :data:`KEPT_HELP_WIDTH` columns."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(KEPT_HELP_WIDTH)
    try:
        return {request: render_fit_help(request) for request in requests()}
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def write() -> None:
    texts = render_all()
    KEPT_HELP.write_text(json.dumps({"key": help_source_key(), "environment": help_environment(),
                                     "width": KEPT_HELP_WIDTH, "texts": texts},
                                    indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(texts)} help texts to {KEPT_HELP}")


if __name__ == "__main__":
    write()
