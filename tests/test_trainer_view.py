"""What Lightning callbacks read of a federated trainer: ``state`` is Lightning's ``TrainerState`` (the engine's
record is ``federation``), the settings by name, and the worker's pieces once ``fit`` set them up."""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import Local
from lightning_dfl.federation.loop.state import FederationState
from lightning_dfl.module import SparseClassifier


class SeesState(Callback):
    """Reads ``trainer.state`` as Lightning's own callbacks do."""

    def __init__(self) -> None:
        self.seen = []

    def on_train_start(self, trainer, pl_module):
        self.seen.append((trainer.state.fn, trainer.state.stage, trainer.state.status))


def test_state_is_lightnings_trainer_state_and_the_engine_record_is_federation(tmp_path):
    seen = SeesState()
    trainer = FederatedTrainer(algorithm=Local(), rounds=1, local_epochs=1, logger=False, enable_progress_bar=False,
                               accelerator="cpu", callbacks=[seen], default_root_dir=str(tmp_path))
    assert trainer.state.status == TrainerStatus.INITIALIZING and trainer.state.fn is None
    assert trainer.federation is None and trainer.store is None and trainer.module is None
    assert trainer.rounds == 1 and trainer.seed == 0 and trainer.max_rounds == 1  # the settings by name
    trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5), FederatedDataModule(num_clients=3))
    assert seen.seen == [(TrainerFn.FITTING, RunningStage.TRAINING, TrainerStatus.RUNNING)]
    assert trainer.state.status == TrainerStatus.FINISHED
    assert isinstance(trainer.federation, FederationState) and trainer.store is trainer.federation.store
    assert trainer.lightning_module is trainer.module is trainer.federation.worker.module
    with pytest.raises(AttributeError, match="has no attribute 'roundz'"):
        trainer.roundz  # noqa: B018
