"""The trainer: a run's checked settings, its set-up, the round loop's driver, checkpoints and interrupts.

* :mod:`~.trainer`: :class:`FederatedTrainer`, the settings, the set-up and the round loop;
* :mod:`~.settings`: :class:`RunSettings`, every value checked once; :mod:`~.kernel_settings` the worker's kernels;
* :mod:`~.build`: ``build_federation``, the set-up; :mod:`~.view`: what Lightning callbacks read;
* :mod:`~.checkpoint` (save and resume) and :mod:`~.checkpoint_file` (the file, read without running code);
* :mod:`~.interrupts`: stopping cleanly on Ctrl-C or SIGTERM.
"""

from typing import Any

__all__ = ["FederatedTrainer"]


def __getattr__(name: str) -> Any:  # lazy: reading a checkpoint's file does not import the round loop
    if name == "FederatedTrainer":
        from lightning_dfl.federation.trainer.trainer import FederatedTrainer

        return FederatedTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
