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
    with pytest.raises(ValueError, match=r"^model.num_classes=10 but the data has 7 classes; leave model.num_classes "
                                         r"unset \(None\) to take it from the data$"):
        model.build(7, 1, 8)
    model.build(10, 1, 8)  # the same sizes again: nothing to do


def test_same_seed_same_initial_model_and_mask():
    a = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=0.5, seed=3)
    b = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=0.5, seed=3)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    for n in a.mask.masks:
        assert torch.equal(a.mask.masks[n], b.mask.masks[n])


@pytest.mark.parametrize("kwargs, message", [
    ({"distribution": "normal"}, "unknown distribution 'normal'; allowed: erk, uniform"),
    ({"arch": 5}, "unknown arch 5; allowed: alexnet, "),
    ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
    ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
    ({"lr": "0.1"}, "lr must be a finite number > 0, got '0.1'"),
    ({"lr_decay": 1.5}, r"lr_decay must be in \(0, 1\], got 1.5"),
    ({"lr_decay": float("nan")}, r"lr_decay must be in \(0, 1\], got nan"),
    ({"density": 0.0}, r"density must be in \(0, 1\], got 0.0"),
    ({"density": float("nan")}, r"density must be in \(0, 1\], got nan"),
    ({"density": True}, r"density must be in \(0, 1\], got True"),
    ({"erk_power_scale": -1.0}, "erk_power_scale must be a finite number >= 0, got -1.0"),
    ({"erk_power_scale": float("nan")}, "erk_power_scale must be a finite number >= 0, got nan"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
    ({"momentum": -0.5}, r"momentum must be in \[0, 1\), got -0.5"),
    ({"weight_decay": -1e-4}, "weight_decay must be a finite number >= 0, got -0.0001"),
    ({"weight_decay": float("inf")}, "weight_decay must be a finite number >= 0, got inf"),
    ({"seed": 1.5}, r"seed must be an integer in \[0, 4294967295\], got 1.5"),
    ({"seed": -1}, r"seed must be an integer in \[0, 4294967295\], got -1"),
    ({"seed": 2**70}, r"seed must be an integer in \[0, 4294967295\], got 1180591620717411303424"),  # overflowed
    ({"num_classes": 0}, "num_classes must be an integer >= 1, or None to take it from the data; got 0"),
    ({"num_classes": 2.5}, "num_classes must be an integer >= 1, or None to take it from the data; got 2.5"),
    ({"in_channels": True}, "in_channels must be an integer >= 1, or None to take it from the data; got True"),
    ({"image_size": "32"}, "image_size must be an integer >= 1, or None to take it from the data; got '32'"),
    ({"mask_shortcuts": "yes"}, "mask_shortcuts must be True or False, got 'yes'"),
    ({"mask_exclude": "fc"},
     r"mask_exclude must be a list of non-empty name parts \(e.g. \['fc'\]\) or None, got 'fc'"),
    ({"model_options": ["norm"]}, r"model_options must be a mapping of option names to values or None, got \['norm'\]"),
])
def test_bad_module_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseClassifier(**kwargs)


@pytest.fixture(scope="module")
def digits():
    dm = FederatedDataModule(dataset="digits", num_clients=2, test_samples_per_client=10)
    dm.setup()
    return dm


@pytest.mark.parametrize("kwargs, message", [
    ({"num_classes": 5}, "model.num_classes=5 but the data set digits has 10 classes; "
                         "leave model.num_classes unset (None) to take it from the data"),
    ({"in_channels": 3}, "model.in_channels=3 but the data set digits has 1 channel(s) per image; "
                         "leave model.in_channels unset (None) to take it from the data"),
    ({"image_size": 16}, "model.image_size=16 but the data set digits has images of 8x8 pixels "
                         "(data.image_size=16 resizes them); leave model.image_size unset (None) to take it from "
                         "the data"),
    ({"num_classes": 10, "in_channels": 3, "image_size": 32},
     "model.in_channels=3 but the data set digits has 1 channel(s) per image; model.image_size=32 but the data set "
     "digits has images of 8x8 pixels (data.image_size=32 resizes them); leave model.in_channels and "
     "model.image_size unset (None) to take them from the data"),
])
def test_given_sizes_that_differ_from_the_data_are_refused(digits, kwargs, message):
    model = SparseClassifier(arch="cnn_digits", **kwargs)
    with pytest.raises(ValueError) as err:
        model.build_for(digits)
    assert str(err.value) == message
    assert model.hparams.num_classes == kwargs.get("num_classes")  # not overwritten by the data's size


def test_sizes_left_unset_or_equal_are_taken_from_the_data(digits):
    model = SparseClassifier(arch="cnn_digits", num_classes=10)  # equal to the data's: accepted
    model.build_for(digits)
    assert model.input_spec == (10, 1, 8)
    other = SparseClassifier(arch="cnn_digits")
    other.build(7, 1, 8)  # built for other data first
    with pytest.raises(ValueError, match=r"^the model was built for num_classes=7 but the data set digits has 10 "
                                         r"classes; build a new model for this data$"):
        other.build_for(digits)
    with pytest.raises(ValueError, match="the data gives num_classes=0; it must be an integer >= 1"):
        SparseClassifier(arch="cnn_digits").build(0, 1, 8)


def test_plain_trainer_refuses_a_wrong_num_classes_before_training(tmp_path):
    dm = FederatedDataModule(dataset="digits", num_clients=1, partition="iid", test_samples_per_client=10)
    model = SparseClassifier(arch="cnn_digits", num_classes=5)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="model.num_classes=5 but the data set digits has 10 classes"):
        trainer.fit(model, dm)
    assert model.model is None and trainer.global_step == 0


def test_mask_exclude_and_model_options():
    model = SparseClassifier(arch="vgg11", num_classes=10, in_channels=3, image_size=32, density=0.5,
                             mask_exclude=["classifier"], model_options={"norm": "batch"})
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.model.modules())
    assert not any("classifier" in name for name in model.mask.masks)
    assert model.mask.density() == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="has no option"):
        SparseClassifier(arch="vgg11", model_options={"colour": "red"})
