"""``python -m lightning_dfl`` runs the command line, with the same import path as the ``lightning-dfl`` command:
``python -m`` puts the working folder first on ``sys.path``, where a config's ``class_path`` could import a module
no one meant to run; it is taken off unless ``PYTHONPATH`` names it (``PYTHONPATH=.``, as for the command)."""

import os
import sys


def _without_working_folder(path: list[str]) -> list[str]:
    """``path`` without its first entry when that is the working folder that ``python -m`` put there and
    ``PYTHONPATH`` does not name it."""
    cwd = os.getcwd()
    named = {os.path.abspath(p or ".") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if path and os.path.abspath(path[0] or ".") == cwd and cwd not in named:
        return path[1:]
    return path


if __name__ == "__main__":
    sys.path[:] = _without_working_folder(sys.path)
    from lightning_dfl.cli import main

    main()
