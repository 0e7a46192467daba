"""``SparseClassifier`` with each of our callbacks in a plain ``lightning.Trainer``, as a user writes it: the
module builds its network in its ``setup`` (after the callbacks' ``setup``), the callbacks act on its mask."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_dfl.callbacks import PQIPruning, PruningTimeVoting, RigL
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.module import SparseClassifier


def _data() -> FederatedDataModule:
    return FederatedDataModule(dataset="digits", num_clients=1, batch_size=32, cache=False)


def _fit(model, callbacks, epochs=1, batches=4):
    trainer = plain_trainer(callbacks, max_epochs=epochs, limit_train_batches=batches, limit_val_batches=0)
    trainer.fit(model, _data())
    return trainer


def _zero_outside_the_mask(model) -> bool:
    return all(int(torch.count_nonzero(model.mask.params[n].detach()[~m])) == 0 for n, m in model.mask.masks.items())


def test_rigl_sets_a_dense_modules_density():
    """``SparseClassifier(density=1.0)`` with ``RigL(density=0.3)``: the model trains at 0.3, and RigL updates
    the module's own mask (it builds none of its own)."""
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    rigl = RigL(density=0.3, update_every=2)
    trainer = _fit(model, [rigl])
    assert trainer.global_step == 4
    assert not rigl.owns_mask and rigl.state_dict()["num_updates"] == 1  # at step 2; step 4 is T
    assert model.mask.density() == pytest.approx(0.3, abs=len(model.mask.masks) / model.mask.num_masked())
    assert _zero_outside_the_mask(model)


def test_rigl_keeps_a_sparse_modules_mask_without_a_density():
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    rigl = RigL(update_every=2)
    _fit(model, [rigl])
    counts = {n: int(m.sum()) for n, m in model.mask.masks.items()}
    fresh = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    fresh.build_for(_ready(_data()))
    assert counts == {n: int(m.sum()) for n, m in fresh.mask.masks.items()}  # the module's density, layer by layer
    assert rigl.state_dict()["num_updates"] == 1 and _zero_outside_the_mask(model)


def _ready(data: FederatedDataModule) -> FederatedDataModule:
    data.setup("fit")
    return data


def test_rigl_and_a_sparse_module_at_another_density_are_refused_before_training():
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    trainer = plain_trainer([RigL(density=0.3)], max_epochs=1, limit_train_batches=4)
    with pytest.raises(MisconfigurationException) as raised:
        trainer.fit(model, _data())
    message = str(raised.value)
    assert message.startswith("RigL(density=0.3) conflicts with the module's own mask at density 0.5")
    assert "(SparseClassifier(density=0.5))" in message and "\n" not in message
    assert trainer.global_step == 0


def test_rigl_at_the_modules_own_density_is_accepted():
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    _fit(model, [RigL(density=0.5, update_every=2)])
    assert model.mask.density() == pytest.approx(0.5, abs=len(model.mask.masks) / model.mask.num_masked())


def test_pqi_prunes_the_modules_own_mask_and_logs_it():
    model = SparseClassifier(arch="cnn_digits", lr=0.05)  # dense
    pqi = PQIPruning(target_sparsity=0.5, schedule=[0])
    trainer = _fit(model, [pqi])
    (event,) = pqi.history
    assert not pqi.owns_mask and event.round_idx == 0 and event.pruned > 0
    assert event.sparsity_before == 0.0 and event.sparsity_after == model.mask.sparsity() <= 0.5
    assert trainer.callback_metrics["pqi/pruned_weights"].item() == event.pruned
    assert trainer.callback_metrics["sparsity/mean"].item() == pytest.approx(model.mask.sparsity())
    assert model.mask.num_masked() - model.mask.num_active() == event.pruned and _zero_outside_the_mask(model)


def test_voting_decides_and_pqi_prunes_with_rigl_on_the_modules_mask():
    """DA-DPFL's pruning in centralized training: one voter, a round is an epoch."""
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    voting = PruningTimeVoting(delta_pr=10.0)  # every score is below 10: the second epoch's vote is stable
    pqi = PQIPruning(target_sparsity=0.8)
    rigl = RigL(update_every=2)
    trainer = _fit(model, [voting, pqi, rigl], epochs=4, batches=2)
    assert voting.vote_shares == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}  # no score, hence no stable vote, in epoch 0
    assert voting.t_star == 2 and voting.pruning_round_indices == (2,)  # t_1 = t* + 1 = 3 (paper), index 2
    assert trainer.callback_metrics["voting/t_star"].item() == 2.0
    assert [e.round_idx for e in pqi.history] == [2]
    assert not pqi.owns_mask and not rigl.owns_mask
    assert model.mask.sparsity() == pytest.approx(pqi.history[0].sparsity_after)
    assert 0.5 < model.mask.sparsity() <= 0.8 and _zero_outside_the_mask(model)
