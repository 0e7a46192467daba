"""The command line: ``lightning-dfl fit --config configs/<file>.yaml`` through LightningCLI."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_dfl.analysis import SUBCOMMANDS
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.trainer import FederatedTrainer
from lightning_dfl.module import SparseClassifier


class FederatedCLI(LightningCLI):
    """LightningCLI whose trainer is :class:`FederatedTrainer` (not a ``Trainer`` subclass).

    ``model`` configures the worker module (architecture, mask density, optimizer), ``data`` the
    federated datamodule and ``trainer`` the federation (algorithm, rounds, Fabric settings,
    callbacks, logger). The resolved config is saved next to the run's metrics.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf"} if _has_omegaconf() else {})
        super().__init__(
            model_class=SparseClassifier,
            datamodule_class=FederatedDataModule,
            trainer_class=FederatedTrainer,
            save_config_callback=None,
            auto_configure_optimizers=False,
            seed_everything_default=False,
            args=args,
            run=run,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "datamodule"}}

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(self.trainer_class, "trainer", fail_untyped=False, instantiate=False,
                                   sub_configs=True)
        parser.add_lightning_class_args(self._model_class, "model")
        parser.add_lightning_class_args(self._datamodule_class, "data")

    def instantiate_trainer(self, **kwargs: Any) -> FederatedTrainer:
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        return self.trainer_class(**config)

    def before_fit(self) -> None:
        log_dir = self.trainer.log_dir
        if log_dir and self.trainer.is_global_zero:
            getattr(self.trainer.logger, "experiment", None)  # let the logger create its folder first
            parser = self._parser(self.subcommand)
            config = self.config[self.subcommand] if self.subcommand else self.config
            parser.save(config, str(Path(log_dir) / "config.yaml"), skip_none=False, overwrite=True,
                        multifile=False)

    def after_fit(self) -> None:
        summary = self.trainer.summary
        if summary is not None and summary.log_dir:
            summary.save(summary.log_dir)


def _has_omegaconf() -> bool:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return False
    return True


USAGE = """usage: lightning-dfl {fit,schedule,cost,curves} ...

  fit       train a federation: lightning-dfl fit --config configs/dispfl_digits.yaml (fit --help)
  schedule  DA-DPFL dynamic aggregation: parallelism and delay against M and N (Figs. 8-9)
  cost      C_total(theta) cost curves of finished runs (DA-DPFL Sec. VI-A5)
  curves    plot logged metrics against the round for finished runs (needs .[plots])
"""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-dfl`` console script."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    if args[0] in SUBCOMMANDS:
        from jsonargparse import CLI

        CLI(SUBCOMMANDS[args[0]], args=args[1:])
        return
    FederatedCLI(args=None if argv is None else args)


if __name__ == "__main__":
    main()
