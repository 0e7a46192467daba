"""Batched clients (torch.func vmap over a level's clients) against the serial executor."""

import warnings

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation.algorithms import DPSGD, DFedSAM, DisPFL, Local
from lightning_dfl.federation.trainer import FederatedTrainer
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _fit(algorithm, batched, rounds=1, momentum=0.0, arch="cnn_digits", callbacks=None, local_epochs=1, **kw):
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=local_epochs, seed=0, accelerator="cpu",
                               logger=False, enable_progress_bar=False, batched_clients=batched,
                               callbacks=callbacks, **kw)
    model = SparseClassifier(arch=arch, density=0.5, lr=0.05, momentum=momentum)
    # uneven clients: Dirichlet sizes, and a last batch smaller than the others
    dm = FederatedDataModule(dataset="digits", num_clients=6, batch_size=16, test_samples_per_client=20)
    trainer.fit(model, dm)
    return trainer


def _close(a, b, atol=1e-4, rel=1e-4):
    """Equal up to float rounding (SGD amplifies rounding differences over many steps: longer runs
    are compared with a looser tolerance)."""
    for name, t in a.store.weights.items():
        assert torch.allclose(t, b.store.weights[name], atol=atol), name
    for x, y in zip(a.history, b.history):
        assert x["acc/personal_mean"] == pytest.approx(y["acc/personal_mean"], abs=1 / 120)  # one test sample
        assert x["samples/train"] == y["samples/train"] and x["flops/train_total"] == y["flops/train_total"]
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=rel)


@pytest.mark.parametrize("algorithm", [lambda: Local(), lambda: DPSGD(num_neighbors=2)], ids=["local", "dpsgd"])
def test_batched_training_equals_the_serial_path_up_to_rounding(algorithm):
    _close(_fit(algorithm(), False), _fit(algorithm(), True))


def test_two_rounds_of_two_epochs_stay_close():
    _close(_fit(DPSGD(num_neighbors=2), False, rounds=2, local_epochs=2),
           _fit(DPSGD(num_neighbors=2), True, rounds=2, local_epochs=2), atol=2e-3, rel=1e-3)


def test_momentum_and_a_mask_search_match_the_serial_path():
    _close(_fit(DisPFL(num_neighbors=2), False, momentum=0.5), _fit(DisPFL(num_neighbors=2), True, momentum=0.5))


def test_local_steps_with_uneven_clients_match():
    _close(_fit(Local(), False, local_steps=7), _fit(Local(), True, local_steps=7))


def test_the_compact_store_gives_the_same_batched_run_bit_for_bit():
    """Start-of-round records freed after a level's last reader (the batched executor reads a whole level
    first): the same run as with the dense store."""
    dense = _fit(DisPFL(num_neighbors=2), True, rounds=2, momentum=0.5)
    compact = _fit(DisPFL(num_neighbors=2), True, rounds=2, momentum=0.5, store="compact")
    strip = [{k: v for k, v in m.items() if "wall" not in k} for m in dense.history]
    assert [{k: v for k, v in m.items() if "wall" not in k} for m in compact.history] == strip
    for node in range(6):
        (wd, md), (wc, mc) = dense.store.published(node), compact.store.published(node)
        assert all(torch.equal(wd[n].view(torch.uint8), wc[n].view(torch.uint8)) for n in wd)
        assert all(torch.equal(md[n], mc[n]) for n in md)
    assert not any(record["neg"] for record in compact.store.records)  # pruned weights are plain +0.0 here too


class BatchHook(FederatedCallback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "resnet20"}, "the model's bn1 \\(BatchNorm2d\\) behaves differently per batch"),
    ({"algorithm": DFedSAM(num_neighbors=2)}, "DFedSAM has its own loss"),
    ({"callbacks": [BatchHook()]}, "callback BatchHook has batch hooks \\(on_train_batch_end\\)"),
    ({"precision": "bf16-true"}, "precision 'bf16-true'; only 32-true is batched"),
])
def test_what_cannot_be_batched_is_refused_before_training(kwargs, match):
    algorithm = kwargs.pop("algorithm", Local())
    with pytest.raises(ValueError, match=match):
        _fit(algorithm, True, rounds=1, **kwargs)


def test_batched_clients_with_several_processes_is_refused():
    with pytest.raises(ValueError, match="batched_clients .* cannot be combined with 2 processes"):
        FederatedTrainer(devices=2, batched_clients=True, logger=False)
