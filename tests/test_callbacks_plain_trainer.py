"""``SparseClassifier`` with each of our callbacks in a plain ``lightning.Trainer``, as a user writes it: the
module builds its network in its ``setup`` (after the callbacks' ``setup``), the callbacks act on its mask."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import plain_trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

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


# -- checkpoints, evaluation, foreign modules, bad arguments ------------------------------------------------------
class _KilledAt(Callback):
    """Stops the run as a kill would, at the start of epoch ``epoch`` (the checkpoint of the epoch before is kept)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("killed")


def _resumable_fit(dirpath, dense, kill_at=None, ckpt_path=None, epochs=5):
    density = 1.0 if dense else 0.5
    model = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=density, lr=0.05)
    callbacks = [PruningTimeVoting(delta_pr=10.0), PQIPruning(target_sparsity=0.8),
                 RigL(density=0.3 if dense else None, update_every=3)]
    extra = [_KilledAt(kill_at)] if kill_at is not None else []
    trainer = Trainer(accelerator="cpu", max_epochs=epochs, limit_train_batches=4, limit_val_batches=2, logger=False,
                      callbacks=[*callbacks, ModelCheckpoint(dirpath=dirpath, save_last=True), *extra],
                      default_root_dir=dirpath, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model, _data(), ckpt_path=ckpt_path)  # each epoch's order from (seed, epoch): resumable
    except RuntimeError as killed:
        assert str(killed) == "killed"
    return model, callbacks


@pytest.mark.parametrize("dense", [True, False], ids=["dense_module_at_rigls_density", "sparse_module"])
def test_a_killed_run_resumed_from_its_checkpoint_ends_as_an_uninterrupted_one(tmp_path, dense):
    """Killed after the pruning epoch (index 2) and resumed with ``ckpt_path``: RigL's, the voting's and PQI's
    states and the module's mask come back, and the run ends bit for bit as one never stopped. A dense module at
    RigL's density 0.3, pruned since to 0.2, is not refused as "another density" on resume."""
    whole, whole_callbacks = _resumable_fit(tmp_path / "whole", dense)
    _resumable_fit(tmp_path / "killed", dense, kill_at=3)
    resumed, resumed_callbacks = _resumable_fit(tmp_path / "killed", dense, ckpt_path=tmp_path / "killed" / "last.ckpt")
    assert [e.round_idx for e in whole_callbacks[1].history] == [2]
    for name, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert all(torch.equal(m, resumed.mask.masks[n]) for n, m in whole.mask.masks.items())
    voting, resumed_voting = whole_callbacks[0], resumed_callbacks[0]
    assert (voting.t_star, voting.vote_shares, voting.score_means) == (
        resumed_voting.t_star, resumed_voting.vote_shares, resumed_voting.score_means)
    assert whole_callbacks[1].state_dict() == resumed_callbacks[1].state_dict()
    assert whole_callbacks[2].state_dict() == resumed_callbacks[2].state_dict()


def test_a_run_resumed_with_more_epochs_prunes_on_the_new_schedule(tmp_path):
    """Eq. 6's pruning rounds run to T: a finished 5-epoch run (t* = 2, pruning rounds [3]) resumed with
    max_epochs=9 prunes at the rounds of T = 9 after it, [3, 5, 7, 8] (indices 2, 4, 6, 7: 6 and 7 are new), as
    RigL's schedule follows the new T; before, the checkpoint's T kept it at [3]."""
    from lightning_dfl.pruning_time import pruning_rounds

    _, first = _resumable_fit(tmp_path, dense=False)
    assert first[0].pruning_round_indices == (2,)
    _, resumed = _resumable_fit(tmp_path, dense=False, ckpt_path=tmp_path / "last.ckpt", epochs=9)
    voting, pqi = resumed[0], resumed[1]
    assert voting.t_star == 2 and [t - 1 for t in pruning_rounds(2, 9)] == [2, 4, 6, 7]
    assert voting.pruning_round_indices == (2, 4, 6, 7) and voting.total_rounds == 9
    assert [e.round_idx for e in pqi.history] == [2, 6, 7]  # epoch 4 ran before, under T = 5


def test_validate_test_predict_and_load_from_checkpoint_keep_the_mask(tmp_path):
    model = SparseClassifier(arch="cnn_digits", lr=0.05)
    callbacks = [PruningTimeVoting(delta_pr=10.0), PQIPruning(target_sparsity=0.8), RigL(density=0.4, update_every=3)]
    trainer = Trainer(accelerator="cpu", max_epochs=4, limit_train_batches=4, limit_val_batches=2, logger=False,
                      callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    data = _data()
    trainer.fit(model, data)
    density, masks = model.mask.density(), model.mask.state()
    assert density < 0.4  # RigL's 0.4, then pruned
    (validated,) = trainer.validate(model, data, verbose=False)
    tested = {name.replace("val/", "test/"): value for name, value in validated.items()}  # the same clients' data
    assert trainer.test(model, data, verbose=False) == [tested] and model.mask.density() == density
    assert sorted(tested) == ["test/acc", "test/loss"]
    loaded = SparseClassifier.load_from_checkpoint(tmp_path / "last.ckpt")
    assert loaded.mask.density() == density and all(torch.equal(m, loaded.mask.masks[n]) for n, m in masks.items())
    evaluator = plain_trainer([])
    assert evaluator.validate(loaded, data, verbose=False) == [validated] and loaded.mask.density() == density
    batches = evaluator.predict(loaded, data)  # the test split's (x, y) batches: predict_step takes x
    x, _ = next(iter(data.test_dataloader()))
    loaded.eval()
    assert torch.equal(batches[0], loaded(x)) and sum(len(b) for b in batches) == len(data.test_dataloader().dataset)
    assert loaded.mask.density() == density


class _ForeignNet(LightningModule):
    """A user's module that knows nothing of masks: a Conv2d and a Linear in an ``nn.Sequential``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                       torch.nn.Linear(8 * 64, 10))

    def forward(self, x):
        return self.net(x.view(-1, 1, 8, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _UpdateSteps(Callback):
    """The optimizer steps at which RigL updated its mask, and the mask's per-layer counts after each batch."""

    def __init__(self, rigl: RigL) -> None:
        self.rigl, self.steps, self.counts, self._seen = rigl, [], set(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = self.rigl.state_dict()["num_updates"]
        if done != self._seen:
            self.steps.append(trainer.global_step)
            self._seen = done
        self.counts.add(tuple(int(m.sum()) for m in self.rigl.state_dict()["masks"].values()))


@pytest.mark.parametrize("precision, accumulate", [("32-true", 2), ("bf16-mixed", 1), ("bf16-mixed", 2)])
def test_rigl_masks_a_foreign_module_under_mixed_precision_and_accumulation(digits_loader, precision, accumulate):
    """The README's claim: RigL masks any LightningModule's Conv/Linear weights itself; with
    ``accumulate_grad_batches`` it updates at every ``update_every``-th optimizer step (not batch), and under
    ``bf16-mixed`` too every layer keeps its active count exactly and its inactive weights at zero."""
    rigl = RigL(density=0.3, update_every=3)
    spy = _UpdateSteps(rigl)
    model = _ForeignNet()
    trainer = plain_trainer([rigl, spy], max_epochs=1, precision=precision, accumulate_grad_batches=accumulate)
    trainer.fit(model, digits_loader)
    steps = math.ceil(len(digits_loader) / accumulate)
    assert trainer.global_step == steps and rigl.owns_mask
    assert spy.steps == list(range(3, steps, 3))  # the last step is T: no update there
    assert len(spy.counts) == 1  # the same per-layer counts after every batch
    own = rigl.state_dict()["masks"]
    params = dict(model.named_parameters())
    assert sum(int(m.sum()) for m in own.values()) == pytest.approx(0.3 * sum(m.numel() for m in own.values()), abs=2)
    assert all(int(torch.count_nonzero(params[n].detach()[~m])) == 0 for n, m in own.items())


@pytest.mark.parametrize("make, message", [
    (lambda: RigL(seed=-1), "`seed` must be an int in [0, 4294967295], got -1"),
    (lambda: RigL(seed=2**64), f"`seed` must be an int in [0, 4294967295], got {2**64}"),
    (lambda: RigL(seed=1.0), "`seed` must be an int in [0, 4294967295], got 1.0"),
    (lambda: RigL(verbose=1.0), "`verbose` must be any of (0, 1, 2), got 1.0"),
    (lambda: PruningTimeVoting(verbose=2.0), "`verbose` must be any of (0, 1, 2), got 2.0"),
    (lambda: PQIPruning(verbose=True), "`verbose` must be any of (0, 1, 2), got True"),
    (lambda: RigL(update_every=2.5), "`update_every` must be an int >= 1, got 2.5"),
    (lambda: RigL(regrowth="grad"), "`regrowth` must be one of ('gradient', 'random'), got 'grad'"),
    (lambda: RigL(density=float("nan")), "`density` must be a float in (0, 1] or None, got nan"),
    (lambda: PruningTimeVoting(delta_v=1.5), "`delta_v` must be a float in (0, 1], got 1.5"),
    (lambda: PQIPruning(p=2.0, q=1.5), "the PQ index needs `p` < `q`, got p=2.0, q=1.5"),
    (lambda: PQIPruning(schedule=[1, -1]), "`schedule` must be a callable round_idx -> bool, a list of round"),
])
def test_bad_callback_arguments_are_refused_in_one_line_naming_the_value(make, message):
    """Before training, at construction: a seed NumPy's seed sequence or torch's generator cannot take (random
    regrowth failed mid-training on -1), a float ``verbose``, and spot checks of the other arguments."""
    with pytest.raises(MisconfigurationException) as raised:
        make()
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
