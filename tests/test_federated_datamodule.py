"""The federated data module on the bundled digits, and the batched transforms it uses."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from lightning_dfl.datamodules import BatchAugment, FederatedDataModule, Normalize, channel_stats, to_float
from lightning_dfl.datamodules.partition import allocate_counts

# ----------------------------------------------------------------------------- transforms


def test_random_crop_matches_per_sample_reference():
    x = torch.arange(2 * 3 * 5 * 6, dtype=torch.float32).reshape(2, 3, 5, 6).repeat(8, 1, 1, 1)  # [16, 3, 5, 6]
    out = BatchAugment(random_crop_padding=2)(x, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # same draws, in the documented order: dy, then dx
    dy, dx = torch.randint(0, 5, (16,), generator=g), torch.randint(0, 5, (16,), generator=g)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(16):
        assert torch.equal(out[i], padded[i, :, dy[i] : dy[i] + 5, dx[i] : dx[i] + 6])
    assert len({(int(a), int(b)) for a, b in zip(dy, dx)}) > 1  # offsets differ per sample


def test_random_crop_window_set_on_a_2x2_image():
    # padding 1 around [[1, 2], [3, 4]]: 9 possible 2x2 windows, all of which occur over a large batch
    x = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8).expand(500, 1, 2, 2)
    out = BatchAugment(random_crop_padding=1)(x, torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x[0, 0], (1, 1, 1, 1))
    windows = {tuple(padded[r : r + 2, c : c + 2].flatten().tolist()) for r in range(3) for c in range(3)}
    seen = {tuple(o.flatten().tolist()) for o in out[:, 0]}
    assert seen == windows and out.dtype == torch.uint8


def test_flip_is_per_sample_and_seeded():
    x = torch.rand(400, 2, 3, 4)
    aug = BatchAugment(horizontal_flip=True)
    out = aug(x, torch.Generator().manual_seed(1))
    flipped = torch.tensor([torch.equal(o, xi.flip(-1)) for o, xi in zip(out, x)])
    kept = torch.tensor([torch.equal(o, xi) for o, xi in zip(out, x)])
    assert bool((flipped | kept).all()) and 150 < int(flipped.sum()) < 250
    assert torch.equal(out, aug(x, torch.Generator().manual_seed(1)))
    assert not torch.equal(out, aug(x, torch.Generator().manual_seed(2)))
    assert torch.equal(BatchAugment()(x, torch.Generator()), x)  # nothing enabled: identity
    with pytest.raises(ValueError, match="random_crop_padding must be an integer >= 0, got -1"):
        BatchAugment(random_crop_padding=-1)


def test_pad_with_a_per_channel_fill_and_crop_from_the_padded_source():
    x = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]])  # [1, 2, 1, 2]
    aug = BatchAugment(random_crop_padding=1, horizontal_flip=True)
    padded = aug.pad(x, fill=torch.tensor([-1.0, -2.0])[:, None, None])
    assert torch.equal(padded[0, 0], torch.tensor([[-1.0, -1, -1, -1], [-1, 1, 2, -1], [-1, -1, -1, -1]]))
    assert torch.equal(padded[0, 1], torch.tensor([[-2.0, -2, -2, -2], [-2, 3, 4, -2], [-2, -2, -2, -2]]))
    assert torch.equal(aug.pad(x), torch.nn.functional.pad(x, (1, 1, 1, 1)))  # no fill: zeros
    # cutting from a padded source replays __call__ draw for draw
    batch = torch.rand(64, 3, 5, 6)
    whole = aug(batch, torch.Generator().manual_seed(4))
    index = torch.tensor([5, 0, 63, 5])
    part = aug.crop_flip(aug.pad(batch[index]), torch.arange(4), torch.Generator().manual_seed(4))
    assert torch.equal(part, aug(batch[index], torch.Generator().manual_seed(4)))
    assert torch.equal(aug.crop_flip(aug.pad(batch), torch.arange(64), torch.Generator().manual_seed(4)), whole)


def test_normalize_and_float_conversion_hand_values():
    x = torch.tensor([[[[0, 255]], [[51, 102]]]], dtype=torch.uint8)  # [1, 2, 1, 2]
    assert torch.allclose(to_float(x), torch.tensor([[[[0.0, 1.0]], [[0.2, 0.4]]]]))
    out = Normalize([0.5, 0.2], [0.5, 0.1])(x)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.tensor([[[[-1.0, 1.0]], [[0.0, 2.0]]]]))
    mean, std = channel_stats(x)
    assert np.allclose(mean, [0.5, 0.3]) and np.allclose(std, [0.5, 0.1])
    with pytest.raises(ValueError, match="std must be positive"):
        Normalize([0.5], [0.0])


# ----------------------------------------------------------------------------- the data module


@pytest.fixture(scope="module")
def digits():
    dm = FederatedDataModule(dataset="digits", num_clients=10, alpha=0.3, test_samples_per_client=40, batch_size=32)
    dm.setup()
    return dm


def test_digits_properties(digits):
    assert digits.num_classes == 10 and digits.classes == [str(c) for c in range(10)]
    assert digits.input_shape == (1, 8, 8) and digits.in_channels == 1 and digits.image_size == 8
    assert not digits.batch_augment.enabled  # digits: no augmentation by default


def test_client_train_sets_are_disjoint_and_cover_the_split(digits):
    parts = [digits.client_train_indices(k) for k in range(10)]
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged) == 1347
    assert all(digits.client_train_size(k) == len(parts[k]) >= 10 for k in range(10))
    labels = digits.split.train.labels.numpy()
    for k in range(10):
        assert np.array_equal(digits.client_label_counts(k), np.bincount(labels[parts[k]], minlength=10))


def test_personal_test_sets_follow_train_proportions(digits):
    for k in range(10):
        train_counts = digits.client_label_counts(k)
        test_counts = digits.client_test_label_counts(k)
        assert test_counts.sum() == 40 == digits.client_test_size(k)
        assert np.all(np.abs(test_counts - 40 * train_counts / train_counts.sum()) < 1)  # within rounding
        assert np.array_equal(test_counts, allocate_counts(train_counts, 40))
        idx = digits.client_test_indices(k)
        assert len(np.unique(idx)) == len(idx)  # no repeats within a client


def test_train_batches_shapes_epochs_and_normalisation(digits):
    k = 3
    n = digits.client_train_size(k)
    batches = digits.client_train_batches(k, torch.Generator().manual_seed(0))
    assert len(batches) == math.ceil(n / 32)
    epoch1, epoch2 = list(batches), list(batches)  # re-iterable: each pass is a fresh epoch
    assert len(epoch1) == len(batches)
    assert [len(y) for _, y in epoch1] == [32] * (n // 32) + ([n % 32] if n % 32 else [])
    for x, y in epoch1:
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8) and y.dtype == torch.int64
    for epoch in (epoch1, epoch2):
        labels = torch.cat([y for _, y in epoch]).numpy()
        assert np.array_equal(np.bincount(labels, minlength=10), digits.client_label_counts(k))
    assert not torch.equal(torch.cat([y for _, y in epoch1]), torch.cat([y for _, y in epoch2]))
    # digits are not augmented: the multiset of normalised images is the client's own
    expected = digits.normalizer(digits.split.train.images[digits.client_train_indices(k)])
    got = torch.cat([x for x, _ in epoch1])
    assert torch.allclose(got.sum(0), expected.sum(0), atol=1e-3)
    # normalised with the training split's statistics: about zero mean, unit std overall
    everything = digits.normalizer(digits.split.train.images)
    assert abs(float(everything.mean())) < 1e-4 and abs(float(everything.std()) - 1) < 1e-3


def test_train_batches_are_determined_by_the_generator(digits):
    def run(seed):
        return [(x.clone(), y.clone()) for x, y in digits.client_train_batches(0, torch.Generator().manual_seed(seed))]

    a, b, c = run(5), run(5), run(6)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not all(torch.equal(ya, yc) for (_, ya), (_, yc) in zip(a, c))


def test_augmented_batches_are_normalize_of_augment_draw_for_draw():
    # TensorBatches normalises and pads once, then cuts batches: it must equal augmenting each
    # uint8 batch (zero padding) and normalising it, with the documented draw order
    dm = FederatedDataModule(dataset="digits", augment=True, test_samples_per_client=10, batch_size=50)
    k = 1
    got = list(dm.client_train_batches(k, torch.Generator().manual_seed(9)))
    images = dm.split.train.images[dm.client_train_indices(k)]
    labels = dm.split.train.labels[dm.client_train_indices(k)]
    g = torch.Generator().manual_seed(9)
    order = torch.randperm(len(labels), generator=g)
    expected = [
        (dm.normalizer(dm.batch_augment(images[idx], g)), labels[idx]) for idx in order.split(dm.batch_size)
    ]
    assert len(got) == len(expected) > 1
    for (x, y), (ex, ey) in zip(got, expected):
        assert x.dtype == torch.float32 and x.is_contiguous()
        assert torch.equal(x, ex) and torch.equal(y, ey)
    border = torch.cat([x[:, :, 0, :] for x, _ in got])  # padding reaches the top row of many crops
    assert bool((border == dm.normalizer(torch.zeros(1, 1, 1, 1, dtype=torch.uint8))).any())


def test_augmentation_default_and_override():
    assert FederatedDataModule(dataset="cifar10").batch_augment.random_crop_padding == 4
    assert FederatedDataModule(dataset="ham10000").batch_augment.horizontal_flip
    assert not FederatedDataModule(dataset="mnist").batch_augment.enabled
    assert not FederatedDataModule(dataset="svhn", augment=False).batch_augment.enabled

    dm = FederatedDataModule(dataset="digits", augment=True, test_samples_per_client=10)
    plain = FederatedDataModule(dataset="digits", augment=False, test_samples_per_client=10)
    a = next(iter(dm.client_train_batches(0, torch.Generator().manual_seed(0))))
    b = next(iter(plain.client_train_batches(0, torch.Generator().manual_seed(0))))
    assert torch.equal(a[1], b[1]) and not torch.equal(a[0], b[0])  # same order, cropped/flipped images


def test_test_batches_are_fixed_and_on_the_requested_device(digits):
    batches = digits.client_test_batches(2, device="cpu")
    assert len(batches) == 1  # 40 samples, eval batch 512
    (x1, y1), (x2, y2) = next(iter(batches)), next(iter(batches))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (40, 1, 8, 8)
    expected_y = digits.split.test.labels[digits.client_test_indices(2)]
    assert torch.equal(y1, expected_y)
    x, _ = next(iter(digits.client_train_batches(2, torch.Generator().manual_seed(0), device="cpu")))
    assert x.device.type == "cpu"


@pytest.mark.parametrize("augment", [False, True])
def test_batches_are_cut_on_the_given_device_with_draws_from_a_cpu_generator(augment):
    # "meta" stands in for an accelerator (no GPU here): every batch must land on it, and in-place
    # ops between a CPU and a meta tensor (e.g. the flip's index_copy_) raise a device mismatch
    dm = FederatedDataModule(augment=augment, test_samples_per_client=10, batch_size=100)
    train = list(dm.client_train_batches(0, torch.Generator().manual_seed(0), device="meta"))
    test = list(dm.client_test_batches(0, device="meta"))
    assert len(train) == math.ceil(dm.client_train_size(0) / 100) and len(test) == 1
    for x, y in train + test:
        assert x.device.type == y.device.type == "meta" and x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8)


def test_same_seed_same_partition_other_seed_differs():
    a = FederatedDataModule(seed=11, test_samples_per_client=20)
    b = FederatedDataModule(seed=11, test_samples_per_client=20)
    c = FederatedDataModule(seed=12, test_samples_per_client=20)
    for k in range(10):
        assert np.array_equal(a.client_train_indices(k), b.client_train_indices(k))
        assert np.array_equal(a.client_test_indices(k), b.client_test_indices(k))
    assert any(not np.array_equal(a.client_train_indices(k), c.client_train_indices(k)) for k in range(10))


def test_pathological_and_iid_through_the_module():
    path = FederatedDataModule(
        partition="pathological", classes_per_client=3, num_clients=6, test_samples_per_client=30
    )
    for k in range(6):
        assert np.count_nonzero(path.client_label_counts(k)) == 3
        assert set(np.flatnonzero(path.client_test_label_counts(k))) == set(np.flatnonzero(path.client_label_counts(k)))
    iid = FederatedDataModule(partition="iid", num_clients=4, test_samples_per_client=30)
    assert sum(iid.client_train_size(k) for k in range(4)) == 1347


def test_exdir_through_the_module():
    # PSFL's ExDir(2, 10) on digits (1,347 training samples): 20 clients, mean size 67, at least min_size = 10 each
    from lightning_dfl.datamodules.partition import ExDirPartitioner

    dm = FederatedDataModule(dataset="digits", num_clients=20, partition="exdir", classes_per_client=2, alpha=10.0,
                             min_size=10, test_samples_per_client=30)
    assert isinstance(dm.partitioner, ExDirPartitioner)
    assert (dm.partitioner.classes_per_client, dm.partitioner.alpha, dm.partitioner.min_size) == (2, 10.0, 10)
    dm.setup()
    parts = [dm.client_train_indices(k) for k in range(20)]
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged) == 1347  # disjoint; every class drawn, so every sample used
    for k in range(20):
        held = np.flatnonzero(dm.client_label_counts(k))
        assert 1 <= len(held) <= 2 and dm.client_train_size(k) >= 10
        assert set(np.flatnonzero(dm.client_test_label_counts(k))) <= set(held)
    again = FederatedDataModule(dataset="digits", num_clients=20, partition="exdir", classes_per_client=2,
                                alpha=10.0, test_samples_per_client=30)
    again.setup()
    assert all(np.array_equal(again.client_train_indices(k), parts[k]) for k in range(20))


def test_more_test_samples_per_client_than_the_test_split_holds_is_refused():
    """Every client got the whole test split (450 samples of digits), fewer than asked, with a warning only."""
    with pytest.raises(ValueError) as err:
        FederatedDataModule(test_samples_per_client=451).setup()
    assert str(err.value) == ("test_samples_per_client=451 exceeds the 450 samples of the test split of dataset "
                              "'digits'; allowed: an integer from 1 to 450")
    dm = FederatedDataModule(num_clients=2, partition="iid", test_samples_per_client=450)
    dm.setup()
    assert [dm.client_test_size(k) for k in range(2)] == [450, 450]


def test_short_test_pools_warn():
    dm = FederatedDataModule(partition="pathological", classes_per_client=1, num_clients=3)
    with pytest.warns(UserWarning, match="test_samples_per_client=100"):
        dm.setup()
    assert all(dm.client_test_size(k) < 100 for k in range(3))  # one class: at most its ~45 test samples


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dataset": "imagenet"}, "unknown dataset 'imagenet'; allowed: .*digits"),
        ({"partition": "zipf"},
         "unknown partition 'zipf'; allowed: cluster, dirichlet, dirichlet_equal, exdir, iid, pathological"),
        ({"num_clients": 0}, "num_clients must be an integer >= 1, got 0"),
        ({"alpha": 0.0}, "alpha must be a finite number > 0, got 0.0"),
        ({"alpha": -1}, "alpha must be a finite number > 0, got -1"),
        ({"classes_per_client": 0}, "classes_per_client must be an integer >= 1, got 0"),
        ({"min_size": -1}, "min_size must be an integer >= 0, got -1"),
        ({"test_samples_per_client": -5}, r"test_samples_per_client must be an integer >= 1 \(each client's accuracy, "
                                          r"the run's headline number, is measured on its personal test set\), got -5"),
        ({"test_samples_per_client": 0}, r"test_samples_per_client must be an integer >= 1 .*, got 0"),
        ({"alpha": float("nan")}, "alpha must be a finite number > 0, got nan"),
        ({"alpha": float("inf")}, "alpha must be a finite number > 0, got inf"),
        ({"num_clients": 2.0}, "num_clients must be an integer >= 1, got 2.0"),
        ({"classes_per_client": 1.5}, "classes_per_client must be an integer >= 1, got 1.5"),
        ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
        ({"num_clients": 20, "max_train_samples": 5},
         r"max_train_samples must be None \(the whole training split\) or an integer >= num_clients=20 \(a sample per "
         r"client at least\), got 5"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"eval_batch_size": 2.5}, "eval_batch_size must be an integer >= 1, got 2.5"),
        ({"image_size": 0}, "image_size must be an integer >= 1, got 0"),
        ({"augment": "yes"}, "augment must be True, False or None, got 'yes'"),
        ({"seed": -1}, r"seed must be an integer in \[0, 4294967295\], got -1"),
        ({"seed": 2**32}, r"seed must be an integer in \[0, 4294967295\], got 4294967296"),
        ({"download": True}, "download=True is only supported for cifar10, cifar100, mnist, svhn, not 'digits'"),
    ],
)
def test_bad_arguments_fail_in_init(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederatedDataModule(**kwargs)


def test_data_dependent_checks_fail_in_setup(tmp_path):
    dm = FederatedDataModule(partition="pathological", classes_per_client=11)  # init cannot know digits has 10
    with pytest.raises(ValueError, match="classes_per_client=11 exceeds the 10 classes of dataset 'digits'"):
        dm.setup()
    with pytest.raises(ValueError, match="classes_per_client=11 exceeds the 10 classes of dataset 'digits'"):
        FederatedDataModule(partition="exdir", classes_per_client=11, alpha=10.0).setup()
    with pytest.raises(ValueError, match="cannot give each of 200 clients min_size=10"):
        FederatedDataModule(num_clients=200).setup()
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        FederatedDataModule(dataset="cifar10", root=str(tmp_path)).setup()
    with pytest.raises(IndexError, match=r"client index must be in \[0, 10\), got 10"):
        FederatedDataModule(test_samples_per_client=10).client_train_size(10)


def test_a_client_without_training_samples_fails_in_setup():
    # alpha -> 0 hands each class almost whole to one client: with min_size=0 most of 30 clients get nothing
    dm = FederatedDataModule(num_clients=30, alpha=0.01, min_size=0, test_samples_per_client=10)
    with pytest.raises(ValueError, match=r"of 30 clients \(first: client \d+\) received no training samples.*min_size"):
        dm.setup()


def test_image_size_resizes_digits():
    dm = FederatedDataModule(image_size=16, test_samples_per_client=10)
    assert dm.input_shape == (1, 16, 16)
    x, _ = next(iter(dm.client_test_batches(0)))
    assert x.shape[1:] == (1, 16, 16)


def test_state_dict_round_trip_and_mismatch():
    dm = FederatedDataModule(seed=3, alpha=0.5)
    state = dm.state_dict()
    assert state["seed"] == 3 and state["alpha"] == 0.5 and state["dataset"] == "digits"
    FederatedDataModule(seed=3, alpha=0.5).load_state_dict(state)  # same partition: accepted
    with pytest.raises(ValueError, match="seed: checkpoint 3 vs now 4"):
        FederatedDataModule(seed=4, alpha=0.5).load_state_dict(state)


class _TinyClassifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8)
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_plain_trainer_uses_the_lightning_hooks():
    dm = FederatedDataModule(batch_size=64, test_samples_per_client=10)
    trainer = L.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(_TinyClassifier(), datamodule=dm)
    assert len(dm.train_dataloader()) == math.ceil(1347 / 64)
    assert sum(len(y) for _, y in dm.val_dataloader()) == 450
    assert trainer.callback_metrics["val_acc"] > 0.8  # a linear model learns digits in three epochs


def test_max_train_samples_takes_a_stratified_seeded_subset():
    dm = FederatedDataModule(dataset="digits", num_clients=4, partition="iid", max_train_samples=400, seed=1)
    dm.setup()
    assert sum(dm.client_train_size(k) for k in range(4)) == 400
    full = FederatedDataModule(dataset="digits", num_clients=4, partition="iid")
    full.setup()
    share = np.bincount(dm.split.train.labels.numpy(), minlength=10) / 400
    full_share = np.bincount(full.split.train.labels.numpy(), minlength=10) / len(full.split.train)
    assert np.abs(share - full_share).max() < 0.01
    again = FederatedDataModule(dataset="digits", num_clients=4, partition="iid", max_train_samples=400, seed=1)
    again.setup()
    assert torch.equal(again.split.train.labels, dm.split.train.labels)
    with pytest.raises(ValueError, match="max_train_samples"):
        FederatedDataModule(dataset="digits", num_clients=4, max_train_samples=2)


# ----------------------------------------------------------------------------- settings that cannot take effect


@pytest.mark.parametrize("kwargs, message", [
    ({"num_clients": 2, "max_train_samples": 5},
     "max_train_samples=5 is fewer than the 10 classes of dataset 'digits': a stratified subset needs a sample of "
     "every class; allowed: an integer from 10 to 1347, or None for the whole split"),
    ({"num_clients": 2, "max_train_samples": 2000},
     "max_train_samples=2000 exceeds the 1347 training samples of dataset 'digits'; allowed: an integer from 10 to "
     "1347, or None for the whole split"),
    ({"num_clients": 2, "max_train_samples": 1344},  # leaves 3 samples out, fewer than the 10 classes
     "max_train_samples=1344 cannot be drawn stratified from the 1347 training samples of dataset 'digits' "
     "(scikit-learn: "),
    ({"num_clients": 1400, "partition": "dirichlet_equal"},
     "cannot give each of 1400 clients a sample: only 1347 samples; use at most 1347 clients"),
    ({"num_clients": 1400, "partition": "iid"},
     "cannot give each of 1400 clients a sample: only 1347 samples; use at most 1347 clients"),
    ({"num_clients": 1400, "partition": "dirichlet", "min_size": 1},
     "cannot give each of 1400 clients min_size=1 samples: only 1347 samples (need 1400); lower min_size or "
     "num_clients"),
])
def test_settings_that_cannot_take_effect_fail_in_setup(kwargs, message):
    dm = FederatedDataModule(**{"test_samples_per_client": 10, **kwargs})
    with pytest.raises(ValueError) as err:
        dm.setup()
    assert str(err.value).startswith(message)
    assert dm._split is None  # nothing half set up


def test_max_train_samples_equal_to_the_split_is_the_whole_split():
    dm = FederatedDataModule(num_clients=2, max_train_samples=1347, test_samples_per_client=10)
    assert len(dm.split.train) == 1347


def test_a_client_without_test_samples_fails_in_setup(monkeypatch):
    from lightning_dfl.datamodules.datasets import DATASETS
    from lightning_dfl.datamodules.images import ImageData, Split

    def load_no_test_bees(root=None):  # class 1 ("bee") has training samples but none in the test split
        images = torch.zeros(12, 1, 4, 4, dtype=torch.uint8)
        train = ImageData(images, torch.tensor([0] * 6 + [1] * 6), ["ant", "bee"])
        return Split(train, ImageData(images[:3], torch.tensor([0, 0, 0]), ["ant", "bee"]))

    monkeypatch.setitem(DATASETS, "no_test_bees", load_no_test_bees)
    dm = FederatedDataModule(dataset="no_test_bees", num_clients=2, partition="pathological", classes_per_client=1,
                             test_samples_per_client=2)
    with pytest.raises(ValueError, match=(
        r"^1 of 2 clients \(first: client (\d)\) would get an empty personal test set: the test split of dataset "
        r"'no_test_bees' \(3 samples\) holds no samples of their classes \(client \1: \['bee'\]\); add test samples "
        r"of these classes or change the partition$"
    )):
        dm.setup()


def test_bad_data_on_disk_fails_in_setup_naming_the_file(tmp_path):
    from torchvision.io import encode_jpeg, write_file

    for half, count in (("train", 4), ("test", 2)):
        for name in ("ant", "bee"):
            (tmp_path / half / name).mkdir(parents=True)
            for i in range(count):
                image = torch.full((3, 4, 4), 99, dtype=torch.uint8)
                write_file(str(tmp_path / half / name / f"{i}.jpg"), encode_jpeg(image))
    kwargs = {"dataset": "image_folder", "root": str(tmp_path), "num_clients": 2, "partition": "iid",
              "test_samples_per_client": 2}
    FederatedDataModule(**kwargs).setup()  # the intact folder loads
    (tmp_path / "train" / "bee" / "1.jpg").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=f"cannot decode image {tmp_path / 'train' / 'bee' / '1.jpg'} "):
        FederatedDataModule(**kwargs).setup()
    (tmp_path / "train" / "bee" / "1.jpg").unlink()
    (tmp_path / "test" / "cat").mkdir()
    with pytest.raises(ValueError, match=r"only in test \['cat'\]; every class needs a folder with images in both"):
        FederatedDataModule(**kwargs).setup()
    with pytest.raises(FileNotFoundError, match=f"image folder not found: {tmp_path / 'absent'} does not exist"):
        FederatedDataModule(**{**kwargs, "root": str(tmp_path / "absent")}).setup()


def _epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)  # what Lightning calls before each epoch
    return [(x.clone(), y.clone()) for x, y in loader]


def test_the_training_loaders_epochs_are_drawn_from_the_seed_and_the_epoch():
    """Each epoch's order and augmentations come from (seed, epoch) alone: a loader built afresh (a resumed fit,
    ``reload_dataloaders_every_n_epochs``) gives epoch 3 as the first loader gave it after epochs 0-2; epochs
    differ from each other, and another data seed gives other epochs."""
    dm = FederatedDataModule(batch_size=64, test_samples_per_client=10, augment=True)
    first = dm.train_dataloader()
    epochs = [_epoch(first, e) for e in range(4)]
    again = _epoch(dm.train_dataloader(), 3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(epochs[3], again))
    assert not torch.equal(epochs[0][0][1], epochs[1][0][1])  # another order
    same_order = [torch.equal(a[1], b[1]) for a, b in zip(_epoch(first, 2), epochs[2])]
    assert all(same_order) and sorted(torch.cat([y for _, y in epochs[0]]).tolist()) == sorted(
        torch.cat([y for _, y in epochs[1]]).tolist())  # every sample once per epoch
    other = FederatedDataModule(batch_size=64, test_samples_per_client=10, augment=True, seed=1).train_dataloader()
    assert not torch.equal(_epoch(other, 0)[0][1], epochs[0][0][1])
