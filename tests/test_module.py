"""SparseClassifier in a plain Lightning Trainer."""

import lightning as L
import pytest
import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.module import SparseClassifier


def test_plain_trainer_keeps_the_mask_with_momentum_and_weight_decay(tmp_path):
    dm = FederatedDataModule(dataset="digits", num_clients=1, partition="iid", batch_size=64)
    model = SparseClassifier(arch="cnn_digits", density=0.3, lr=0.05, momentum=0.9, weight_decay=5e-3)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, dm)
    assert model.mask.density() == pytest.approx(0.3, abs=1e-3)
    for name, param in model.mask.params.items():
        assert (param[~model.mask.masks[name]] == 0).all()
    result = trainer.validate(model, dm, verbose=False)[0]
    assert result["val/acc"] > 0.5  # chance is 0.1


def test_build_takes_sizes_and_counts_active_flops():
    model = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=0.5)
    dense = model.flops_profile.dense_forward_flops()
    assert 0.35 * dense < model.forward_flops() < 0.65 * dense
    with pytest.raises(ValueError, match="built for"):
        model.build(7, 1, 8)


def test_same_seed_same_initial_model_and_mask():
    a = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=0.5, seed=3)
    b = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=0.5, seed=3)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    for n in a.mask.masks:
        assert torch.equal(a.mask.masks[n], b.mask.masks[n])


@pytest.mark.parametrize("kwargs, message", [
    ({"distribution": "normal"}, "unknown distribution 'normal'"),
    ({"lr": 0.0}, "lr must be > 0"),
    ({"lr_decay": 1.5}, "lr_decay must be in"),
    ({"density": 0.0}, "density must be in"),
])
def test_bad_module_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseClassifier(**kwargs)


def test_mask_exclude_and_model_options():
    model = SparseClassifier(arch="vgg11", num_classes=10, in_channels=3, image_size=32, density=0.5,
                             mask_exclude=["classifier"], model_options={"norm": "batch"})
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.model.modules())
    assert not any("classifier" in name for name in model.mask.masks)
    assert model.mask.density() == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="has no option"):
        SparseClassifier(arch="vgg11", model_options={"colour": "red"})
