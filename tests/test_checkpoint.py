"""Kill a federation at a round, resume from its checkpoint, and finish bit for bit the same."""

import warnings

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.algorithms import DADPFL
from lightning_dfl.federation.checkpoint_io import CheckpointError, read_state
from lightning_dfl.federation.trainer import FederatedTrainer
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


class Kill(FederatedCallback):
    """Stops the process (as a crash would) when a given round starts."""

    def __init__(self, at_round):
        self.at_round = at_round

    def on_federated_round_start(self, trainer, pl_module):
        if trainer.current_round == self.at_round:
            raise KeyboardInterrupt


def _trainer(tmp_path, callbacks=None, rounds=6, **kwargs):
    algorithm = DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7)
    return FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=1, logger=False, accelerator="cpu",
                            enable_progress_bar=False, default_root_dir=str(tmp_path), callbacks=callbacks,
                            **kwargs)


def _parts():
    dm = FederatedDataModule(dataset="digits", num_clients=5, batch_size=32, test_samples_per_client=30)
    return SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05), dm


def _comparable(history):
    return [{k: v for k, v in m.items() if not k.startswith("time/wall")} for m in history]


def test_resume_after_a_kill_finishes_identically(tmp_path):
    straight = _trainer(tmp_path / "a")
    straight.fit(*_parts())

    killed = _trainer(tmp_path / "b", callbacks=[Kill(at_round=3)], checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(*_parts())
    ckpt = killed.checkpoint_path
    assert ckpt.is_file() and not ckpt.with_name(ckpt.name + ".tmp").exists()

    resumed = _trainer(tmp_path / "b")
    resumed.fit(*_parts(), ckpt_path=str(ckpt))
    for name in straight.store.names:
        assert torch.equal(straight.store.weights[name], resumed.store.weights[name])
    for name in straight.store.masked_names:
        assert torch.equal(straight.store.masks[name], resumed.store.masks[name])
    assert _comparable(resumed.history) == _comparable(straight.history)
    assert resumed.history[-1]["density/mean"] < 0.5  # the pruning state came back too


def test_resume_refuses_another_configuration_and_missing_files(tmp_path):
    first = _trainer(tmp_path, checkpoint_every=2, rounds=2)
    first.fit(*_parts())
    assert read_state(first.checkpoint_path)["next_round"] == 2  # plain data, read weights-only
    other = FederatedTrainer(algorithm=DADPFL(num_neighbors=2, max_wait=1), rounds=2, local_epochs=1, logger=False,
                             enable_progress_bar=False)
    with pytest.raises(ValueError, match="another configuration"):
        other.fit(*_parts(), ckpt_path=str(first.checkpoint_path))
    with pytest.raises(CheckpointError, match="no checkpoint at .*nope.ckpt"):
        _trainer(tmp_path).fit(*_parts(), ckpt_path=str(tmp_path / "nope.ckpt"))
    with pytest.raises(ValueError, match="checkpoint_every"):
        _trainer(tmp_path, checkpoint_every=-1)
