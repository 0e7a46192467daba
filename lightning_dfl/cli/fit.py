"""``lightning-dfl fit``: LightningCLI with the federated trainer, imported only when ``fit`` runs.

Kept apart from the rest of :mod:`lightning_dfl.cli` so that ``lightning-dfl --help``, ``--version`` and the
analysis subcommands start without importing torch and Lightning.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from jsonargparse import _optionals as jsonargparse_optionals
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_dfl.cli.help import PROG, HelpFormatter
from lightning_dfl.cli.trust import check_callables
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.algorithms import ALGORITHMS  # noqa: F401  (imports every algorithm: see below)
from lightning_dfl.federation.trainer.checkpoint_file import check_file
from lightning_dfl.federation.trainer.trainer import FederatedTrainer
from lightning_dfl.module import SparseClassifier


def _parse_docstring(component: Any, params: bool = False, logger: Any = None) -> Any:
    """jsonargparse's docstring reader, with the project's conventions: an Args entry naming several parameters
    (``momentum, weight_decay: ...``) describes each of them, and a class's short description is its first
    paragraph (docstring_parser keeps only its first line, cutting it mid-sentence)."""
    import copy

    doc = _jsonargparse_parse_docstring(component, params=params, logger=logger)
    if doc is None:
        return None
    if doc.long_description and doc.short_description and not doc.short_description.rstrip().endswith("."):
        first, _, rest = doc.long_description.partition("\n\n")
        doc.short_description = " ".join(f"{doc.short_description} {first}".split())
        doc.long_description = rest or None
    split = []
    for meta in doc.meta:
        names = [n.strip() for n in getattr(meta, "arg_name", "").split(",")] if meta in doc.params else []
        if len(names) > 1 and all(n.isidentifier() for n in names):
            for name in names:
                one = copy.copy(meta)
                one.arg_name = name
                split.append(one)
        else:
            split.append(meta)
    doc.meta = split
    return doc


# jsonargparse reads docstrings through this private function; where a version lacks it, the help keeps
# jsonargparse's own reading (less complete) rather than failing to import
_jsonargparse_parse_docstring = getattr(jsonargparse_optionals, "parse_docstring", None)


@contextlib.contextmanager
def _project_docstrings() -> Iterator[None]:
    """Within this block jsonargparse reads docstrings with :func:`_parse_docstring`; its own reader is put back
    after, so that other parsers in the process are left as they were."""
    if _jsonargparse_parse_docstring is None:
        yield
        return
    jsonargparse_optionals.parse_docstring = _parse_docstring
    try:
        yield
    finally:
        jsonargparse_optionals.parse_docstring = _jsonargparse_parse_docstring


# ALGORITHMS is imported above for its side effect: the registry imports every algorithm's module, and jsonargparse
# finds a short class name (--trainer.algorithm=FedFomo) only among the subclasses already imported (the package
# lightning_dfl.federation.algorithms imports its classes on first use)


class FederatedArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose help (also a subclass's ``--*.help``) is plain text with allowed values."""

    def __init__(self, *args: Any, formatter_class: type[argparse.HelpFormatter] = HelpFormatter,
                 **kwargs: Any) -> None:
        kwargs.setdefault("prog", PROG)
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


# -- the fit command --------------------------------------------------------------------
class FederatedCLI(LightningCLI):
    """LightningCLI whose trainer is :class:`FederatedTrainer` (not a ``Trainer`` subclass).

    ``model`` configures the worker module (architecture, mask density, optimizer), ``data`` the
    federated datamodule and ``trainer`` the federation (algorithm, rounds, Fabric settings,
    callbacks, logger). The resolved config is saved next to the run's metrics.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        given = sys.argv[1:] if args is None else args
        #: the command that started the run (the trainer's resume hint after Ctrl-C repeats it)
        self.command_line = [PROG, *given] if isinstance(given, (list, tuple)) else None
        kwargs["parser_kwargs"] = {**({"parser_mode": "omegaconf"} if _has_omegaconf() else {}),
                                   **(kwargs.get("parser_kwargs") or {})}
        kwargs.setdefault("parser_class", FederatedArgumentParser)
        with _project_docstrings():  # the parser is built, and the command run, with the project's help
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

    def before_instantiate_classes(self) -> None:
        """In safe mode, refuse a callable-valued setting from outside the trusted modules, before anything is
        built (:func:`lightning_dfl.cli.trust.check_callables`)."""
        check_callables(self.config[self.subcommand] if self.subcommand else self.config)

    def _set_seed(self) -> None:
        """Refuse ``--seed_everything``: a federation derives every random stream from ``trainer.seed``."""
        seed = self._get(self.config, "seed_everything")
        if seed is not False and seed is not None:
            raise ValueError(f"seed_everything={seed!r} is not used by a federation: set --trainer.seed "
                             "(the seed of every random stream: topology, sampling, data order, masks) instead")

    def _parse_ckpt_path(self) -> None:
        """Nothing: LightningCLI would ``torch.load`` the file for a LightningModule's hyperparameters, which a
        federation checkpoint does not hold; :meth:`FederatedTrainer.fit` reads and checks it."""

    def instantiate_trainer(self, **kwargs: Any) -> FederatedTrainer:
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        try:
            trainer = self.trainer_class(**config)
        except Exception as err:
            err._lightning_dfl_option = "trainer"  # type: ignore[attr-defined]
            raise
        if hasattr(trainer, "command_line"):
            trainer.command_line = self.command_line
        return trainer

    def before_fit(self) -> None:
        """Hand the trainer the resolved config: it writes ``config.yaml`` into the run folder when the run
        starts (after set-up and a resume are checked), so a refused run leaves no folder behind."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("ckpt_path"):
            check_file(config["ckpt_path"])
        if hasattr(self.trainer, "run_files"):
            self.trainer.run_files["config.yaml"] = self._parser(self.subcommand).dump(config, skip_unset=False)

    def after_fit(self) -> None:
        """Write ``summary.json``; then, where stdout's reader went away during the run (``fit ... | head``), say
        on stderr that the run finished and where its results are, and end as a command cut short (exit code 1)."""
        summary = self.trainer.summary
        if summary is not None and summary.log_dir:
            summary.save(summary.log_dir)
        if getattr(self.trainer, "stdout_closed", False):
            where = f": its results are in {summary.log_dir}" if summary is not None and summary.log_dir else ""
            sys.stderr.write(f"{PROG}: stdout was closed by its reader during the run (piped into head?); the run "
                             f"finished{where}\n")
            raise BrokenPipeError("stdout closed by its reader")


def _has_omegaconf() -> bool:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return False
    return True
