"""``TrainerView``: what Lightning callbacks and user code read of a federated trainer.

Lightning callbacks look for ``current_round``-like progress, ``max_rounds``, ``is_global_zero``, ``log_dir``,
``loggers``, ``lightning_module``; the project's callbacks also keep per-client state through
:meth:`TrainerView.client_state` and log through :meth:`TrainerView.log_metrics`. Every value is read from the
trainer's settings (:class:`~lightning_dfl.federation.trainer.settings.RunSettings`) and its engine record
(:class:`~lightning_dfl.federation.loop.state.FederationState`), never copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import Logger
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.algorithms.context import CountingBatches, TaskFields
from lightning_dfl.federation.store.fields import ClientFields
from lightning_dfl.federation.trainer.settings import RunSettings
from lightning_dfl.module import SparseClassifier

__all__ = ["TrainerView"]


class TrainerView:
    """The read side of :class:`~lightning_dfl.federation.trainer.trainer.FederatedTrainer` (module docstring); the
    trainer sets ``settings``, ``federation``, ``fabric``, ``logger`` and ``_datamodule``."""

    settings: RunSettings
    #: the engine's record of the federation (:class:`~lightning_dfl.federation.loop.state.FederationState`)
    federation: Any
    fabric: Any
    logger: Any
    _datamodule: FederatedDataModule | None
    _fitted: bool
    summary: Any

    def __getattr__(self, name: str) -> Any:
        """The settings by name (``trainer.rounds``, ``trainer.seed``, ...), read from :attr:`settings`."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in RunSettings.__dataclass_fields__:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- what Lightning callbacks and user code read -------------------------------------------
    @property
    def current_round(self) -> int:
        """The round running (or the last one run); 0 before the first."""
        return self.federation.progress.round_idx if self.federation is not None else 0

    @property
    def current_client(self) -> int | None:
        """The client whose task is running (``None`` between tasks)."""
        return self.federation.progress.client if self.federation is not None else None

    @property
    def train_dataloader(self) -> CountingBatches | None:
        """The running task's training batches (its context's), ``None`` between tasks."""
        task = self.federation.progress.task if self.federation is not None else None
        return task.train_batches if task is not None else None

    @property
    def state(self) -> TrainerState:
        """Lightning's ``Trainer.state``: ``fn`` fitting and ``stage`` training once ``fit`` started; ``status``
        initializing before, running during and finished after (the engine's record is :attr:`federation`)."""
        if not self._fitted:
            return TrainerState()
        status = TrainerStatus.FINISHED if self.summary is not None else TrainerStatus.RUNNING
        return TrainerState(status=status, fn=TrainerFn.FITTING, stage=RunningStage.TRAINING)

    @property
    def max_rounds(self) -> int:
        """T, the total rounds (the name Lightning callbacks look for)."""
        return self.settings.rounds

    @property
    def datamodule(self) -> FederatedDataModule | None:
        return self._datamodule

    @property
    def num_clients(self) -> int:
        return self._datamodule.num_clients

    @property
    def module(self) -> SparseClassifier | None:
        """The worker module (Lightning's ``lightning_module``)."""
        return self.federation.worker.module if self.federation is not None else None

    lightning_module = module

    @property
    def optimizer(self) -> Any:
        return self.federation.worker.optimizer if self.federation is not None else None

    @property
    def store(self) -> Any:
        """The client store (every client's model, mask and declared fields)."""
        return self.federation.store if self.federation is not None else None

    @property
    def worker(self) -> Any:
        """The worker (:class:`~lightning_dfl.federation.loop.worker.Worker`: the one module every task trains on,
        its optimizer, Fabric and tensors), ``None`` before ``fit``."""
        return self.federation.worker if self.federation is not None else None

    @property
    def worker_tensors(self) -> dict[str, Any] | None:
        """The worker module's floating parameters and buffers by the store's names (views of the module)."""
        return self.federation.worker.tensors if self.federation is not None else None

    @property
    def is_global_zero(self) -> bool:
        # before Fabric launches, a process it started knows its rank from the environment only
        return rank_zero_only.rank == 0 and (self.fabric is None or self.fabric.is_global_zero)

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank if self.fabric is not None else rank_zero_only.rank

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", None) if self.logger else None

    @property
    def run_folder(self) -> Path:
        """The folder the run writes: the logger's ``log_dir`` (``default_root_dir`` without a logger)."""
        return Path(self.log_dir or self.settings.default_root_dir)

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoints go: ``<run_folder>/checkpoints/last.ckpt``."""
        return self.run_folder / "checkpoints" / "last.ckpt"

    @property
    def loggers(self) -> list[Logger]:
        return [self.logger] if self.logger else []

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Add metrics to the current round's row (callbacks use this, while ``fit`` runs)."""
        if self.federation is None:
            raise RuntimeError(f"log_metrics({sorted(metrics)}) before fit: a round's row exists only while fit runs")
        self.federation.progress.logged.update(metrics)

    def client_state(self, client: int) -> ClientFields | TaskFields:
        """A client's declared fields, read and written by name (callbacks keep their per-client
        state here: ``trainer.client_state(k)["voting/delta_first"]``). During the client's own task the
        writes are staged with the task's update: committed when it publishes, discarded if it is contained
        (a non-finite vote or score never reaches the store or a checkpoint)."""
        task = self.federation.progress.task if self.federation is not None else None
        if task is not None and int(task.node) == int(client):
            return TaskFields(task)
        return ClientFields(self.store, client)

    def test_batches(self, client: int) -> CountingBatches:
        """The client's test batches on the worker's device, in the precision's input dtype."""
        return self.federation.worker.test_batches(client)

