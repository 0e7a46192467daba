"""Loaders read tiny fixtures written in each data set's official on-disk format."""

from __future__ import annotations

import csv
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg, encode_png, write_file

from lightning_dfl.datamodules import readers
from lightning_dfl.datamodules.datasets import DATASETS, default_data_root, load_dataset
from lightning_dfl.datamodules.images import ImageData, Split
from lightning_dfl.datamodules.readers import (
    HAM10000_CLASSES,
    load_cifar10,
    load_cifar100,
    load_digits,
    load_ham10000,
    load_image_folder,
    load_mnist,
    load_svhn,
    load_tiny_imagenet,
)

# Distinct solid colours survive JPEG almost exactly: a decoded image's mean colour names its class.
COLOURS = [(230, 20, 20), (20, 230, 20), (20, 20, 230), (230, 230, 20), (20, 230, 230), (230, 20, 230), (120, 120, 120)]


def _solid(colour, height=10, width=12) -> torch.Tensor:
    return torch.tensor(colour, dtype=torch.uint8)[:, None, None].expand(3, height, width).contiguous()


def _write_jpeg(path, image: torch.Tensor) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_file(str(path), encode_jpeg(image, quality=95))


def _colour_labels(images: torch.Tensor) -> list[int]:
    """Index of the nearest fixture colour for each decoded image."""
    means = images.float().mean(dim=(2, 3))
    palette = torch.tensor(COLOURS, dtype=torch.float32)
    return torch.cdist(means, palette).argmin(dim=1).tolist()


@pytest.fixture
def accept_fixture_checksums(monkeypatch):
    """Fixture files cannot match the official MD5s: let torchvision's check test existence only."""
    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.svhn as tv_svhn

    def exists(fpath, md5=None):
        return os.path.isfile(fpath)

    monkeypatch.setattr(tv_cifar, "check_integrity", exists)
    monkeypatch.setattr(tv_svhn, "check_integrity", exists)


# ----------------------------------------------------------------------------- records


def test_image_data_validates_and_reports_length():
    data = ImageData(torch.zeros(3, 1, 2, 2, dtype=torch.uint8), torch.tensor([0, 1, 1]), ["a", "b"])
    assert len(data) == 3 and data.num_classes == 2 and data.input_shape == (1, 2, 2)
    with pytest.raises(ValueError, match="uint8"):
        ImageData(torch.zeros(3, 1, 2, 2), torch.tensor([0, 1, 1]), ["a", "b"])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        ImageData(torch.zeros(3, 1, 2, 2, dtype=torch.uint8), torch.tensor([0, 1, 2]), ["a", "b"])
    with pytest.raises(ValueError, match="class list"):
        Split(data, ImageData(data.images, data.labels, ["a", "c"]))


# ----------------------------------------------------------------------------- digits


def test_digits_split_is_stratified_scaled_and_deterministic():
    split = load_digits()
    assert (len(split.train), len(split.test)) == (1347, 450)
    assert split.input_shape == (1, 8, 8) and split.num_classes == 10
    assert split.train.images.dtype == torch.uint8 and int(split.train.images.max()) == 255
    # 0..16 -> 0..255: only the 17 values round(v * 255 / 16) occur
    allowed = {round(v * 255 / 16) for v in range(17)}
    assert set(torch.unique(split.train.images).tolist()) <= allowed
    test_counts = torch.bincount(split.test.labels, minlength=10)
    class_totals = test_counts + torch.bincount(split.train.labels, minlength=10)
    assert ((test_counts - 0.25 * class_totals).abs() <= 1).all()  # stratified: a quarter of every class
    again = load_digits()
    assert torch.equal(again.train.images, split.train.images) and torch.equal(again.test.labels, split.test.labels)


# ----------------------------------------------------------------------------- MNIST


def _write_idx(path, array: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_reads_torchvision_idx_layout(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "MNIST" / "raw"
    train_x, test_x = rng.integers(0, 256, (6, 28, 28)), rng.integers(0, 256, (4, 28, 28))
    train_y, test_y = np.array([0, 1, 2, 3, 4, 9]), np.array([5, 6, 7, 8])
    _write_idx(raw / "train-images-idx3-ubyte", train_x)
    _write_idx(raw / "train-labels-idx1-ubyte", train_y)
    _write_idx(raw / "t10k-images-idx3-ubyte", test_x)
    _write_idx(raw / "t10k-labels-idx1-ubyte", test_y)

    split = load_mnist(tmp_path)
    assert split.train.images.shape == (6, 1, 28, 28) and split.test.images.shape == (4, 1, 28, 28)
    assert torch.equal(split.train.images[:, 0], torch.from_numpy(train_x.astype(np.uint8)))
    assert split.train.labels.tolist() == train_y.tolist() and split.test.labels.tolist() == test_y.tolist()
    assert split.classes[0] == "0 - zero" and split.num_classes == 10


def test_mnist_missing_names_path_layout_and_download(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_mnist(tmp_path / "nowhere")
    message = str(err.value)
    assert str(tmp_path / "nowhere") in message and "MNIST/raw" in message and "download=True" in message


# ----------------------------------------------------------------------------- CIFAR


def _pickle(path, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _write_cifar10(root, per_batch=2, test=3, seed=0):
    rng = np.random.default_rng(seed)
    base = root / "cifar-10-batches-py"
    rows, labels = [], []
    for i in range(1, 6):
        data = rng.integers(0, 256, (per_batch, 3072)).astype(np.uint8)
        lab = rng.integers(0, 10, per_batch).tolist()
        _pickle(base / f"data_batch_{i}", {"data": data, "labels": lab})
        rows.append(data)
        labels += lab
    test_rows = rng.integers(0, 256, (test, 3072)).astype(np.uint8)
    test_labels = rng.integers(0, 10, test).tolist()
    _pickle(base / "test_batch", {"data": test_rows, "labels": test_labels})
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _pickle(base / "batches.meta", {"label_names": names})
    return np.concatenate(rows), labels, test_rows, test_labels, names


def test_cifar10_reads_official_pickles_channel_first(tmp_path, accept_fixture_checksums):
    rows, labels, test_rows, test_labels, names = _write_cifar10(tmp_path)
    split = load_cifar10(tmp_path)
    assert split.train.images.shape == (10, 3, 32, 32) and split.test.images.shape == (3, 3, 32, 32)
    # an official row is R plane, G plane, B plane, each row-major 32x32
    assert torch.equal(split.train.images, torch.from_numpy(rows.reshape(-1, 3, 32, 32)))
    assert torch.equal(split.test.images, torch.from_numpy(test_rows.reshape(-1, 3, 32, 32)))
    assert split.train.labels.tolist() == labels and split.test.labels.tolist() == test_labels
    assert split.classes == names and split.train.images.is_contiguous()


def test_cifar10_with_wrong_checksums_is_a_clear_error(tmp_path):
    _write_cifar10(tmp_path)  # not the official bytes: torchvision's MD5 check must reject them
    with pytest.raises(ValueError, match="corrupt or not the official files") as err:
        load_cifar10(tmp_path)
    assert str(tmp_path) in str(err.value) and "download=True" in str(err.value)


def test_cifar10_missing_names_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py") as err:
        load_cifar10(tmp_path)
    assert "data_batch_1" in str(err.value) and "dataset='image_folder'" in str(err.value)


def test_cifar100_reads_fine_labels(tmp_path, accept_fixture_checksums):
    rng = np.random.default_rng(1)
    base = tmp_path / "cifar-100-python"
    train = rng.integers(0, 256, (4, 3072)).astype(np.uint8)
    test = rng.integers(0, 256, (2, 3072)).astype(np.uint8)
    _pickle(base / "train", {"data": train, "fine_labels": [0, 99, 42, 7], "coarse_labels": [0, 1, 2, 3]})
    _pickle(base / "test", {"data": test, "fine_labels": [5, 6], "coarse_labels": [4, 5]})
    names = [f"class{i:02d}" for i in range(100)]
    _pickle(base / "meta", {"fine_label_names": names, "coarse_label_names": [f"super{i}" for i in range(20)]})

    split = load_cifar100(tmp_path)
    assert split.num_classes == 100 and split.classes[99] == "class99"
    assert split.train.labels.tolist() == [0, 99, 42, 7] and split.test.labels.tolist() == [5, 6]
    assert torch.equal(split.test.images, torch.from_numpy(test.reshape(-1, 3, 32, 32)))


# ----------------------------------------------------------------------------- SVHN


def test_svhn_reads_mat_files_and_maps_label_10_to_0(tmp_path, accept_fixture_checksums):
    from scipy.io import savemat

    rng = np.random.default_rng(2)
    x_train = rng.integers(0, 256, (32, 32, 3, 5)).astype(np.uint8)  # official layout: H, W, C, N
    x_test = rng.integers(0, 256, (32, 32, 3, 2)).astype(np.uint8)
    savemat(tmp_path / "train_32x32.mat", {"X": x_train, "y": np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)})
    savemat(tmp_path / "test_32x32.mat", {"X": x_test, "y": np.array([[3], [10]], dtype=np.uint8)})

    split = load_svhn(tmp_path)
    assert split.train.labels.tolist() == [0, 1, 2, 0, 9] and split.test.labels.tolist() == [3, 0]
    assert torch.equal(split.train.images, torch.from_numpy(x_train.transpose(3, 2, 0, 1).copy()))
    assert split.input_shape == (3, 32, 32)


def test_svhn_missing_mentions_files_and_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_32x32.mat") as err:
        load_svhn(tmp_path)
    assert "download=True" in str(err.value)


# ----------------------------------------------------------------------------- Tiny-ImageNet


def _write_tiny_imagenet(root):
    base = root / "tiny-imagenet-200"
    wnids = ["n02000000", "n01000000", "n03000000"]  # sorted order: n01 (colour 1), n02 (colour 0), n03 (colour 2)
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    colour_of = {"n02000000": 0, "n01000000": 1, "n03000000": 2}
    for wnid in wnids:
        for i in range(2):
            _write_jpeg(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", _solid(COLOURS[colour_of[wnid]], 64, 64))
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    lines = []
    for i, wnid in enumerate(["n03000000", "n02000000", "n01000000"]):
        _write_jpeg(base / "val" / "images" / f"val_{i}.JPEG", _solid(COLOURS[colour_of[wnid]], 64, 64))
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    # a grayscale validation image must come out RGB
    gray = torch.full((1, 64, 64), 120, dtype=torch.uint8)
    _write_jpeg(base / "val" / "images" / "val_3.JPEG", gray)
    lines.append("val_3.JPEG\tn01000000\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return base


def test_tiny_imagenet_official_layout(tmp_path):
    _write_tiny_imagenet(tmp_path)
    split = load_tiny_imagenet(tmp_path)  # the parent of tiny-imagenet-200 works as root
    assert split.classes == ["n01000000", "n02000000", "n03000000"]
    assert split.train.images.shape == (6, 3, 64, 64) and split.test.images.shape == (4, 3, 64, 64)
    # label l is wnid sorted[l]; colours: n01 -> 1, n02 -> 0, n03 -> 2
    colour_for_label = [1, 0, 2]
    assert _colour_labels(split.train.images) == [colour_for_label[l] for l in split.train.labels.tolist()]
    assert split.test.labels.tolist() == [2, 1, 0, 0]
    assert _colour_labels(split.test.images[:3]) == [2, 0, 1]
    assert (split.test.images[3].float() - 120).abs().max() <= 2  # grayscale replicated to 3 channels

    small = load_tiny_imagenet(tmp_path / "tiny-imagenet-200", image_size=32)
    assert small.input_shape == (3, 32, 32) and torch.equal(small.train.labels, split.train.labels)


def test_tiny_imagenet_bad_annotation_is_named(tmp_path):
    base = _write_tiny_imagenet(tmp_path)
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn09999999\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match="val_annotations.txt:1"):
        load_tiny_imagenet(base)


def test_tiny_imagenet_missing_describes_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match="wnids.txt") as err:
        load_tiny_imagenet(tmp_path)
    assert str(tmp_path) in str(err.value) and "val_annotations.txt" in str(err.value)


# ----------------------------------------------------------------------------- HAM10000


def _write_ham(root, per_class=5, official_parts=False, size=(30, 40)):
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    n = 0
    for c, dx in enumerate(HAM10000_CLASSES):
        for _ in range(per_class):
            image_id = f"ISIC_{n:07d}"
            folder = ("HAM10000_images_part_1" if n % 2 else "HAM10000_images_part_2") if official_parts else "images"
            _write_jpeg(root / folder / f"{image_id}.jpg", _solid(COLOURS[c], *size))
            rows.append([f"HAM_{n:07d}", image_id, dx, "histo", "50.0", "male", "back"])
            n += 1
    order = np.random.default_rng(3).permutation(len(rows))  # the official csv is not sorted by class
    with open(root / "HAM10000_metadata.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization"])
        writer.writerows(rows[i] for i in order)


@pytest.mark.parametrize("official_parts", [False, True])
def test_ham10000_layouts_classes_and_stratified_split(tmp_path, official_parts):
    _write_ham(tmp_path / "ham10000", official_parts=official_parts)
    split = load_ham10000(tmp_path, image_size=16, test_fraction=0.2)  # parent of ham10000/ works as root
    assert split.classes == ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]
    assert (len(split.train), len(split.test)) == (28, 7)
    assert torch.bincount(split.test.labels, minlength=7).tolist() == [1] * 7  # stratified: 1 of 5 per class
    assert split.input_shape == (3, 16, 16)
    assert _colour_labels(split.train.images) == split.train.labels.tolist()  # images stay with their labels
    assert _colour_labels(split.test.images) == split.test.labels.tolist()
    again = load_ham10000(tmp_path / "ham10000", image_size=16, test_fraction=0.2)
    assert torch.equal(again.test.images, split.test.images)
    other = load_ham10000(tmp_path / "ham10000", image_size=16, test_fraction=0.2, seed=1)
    assert not torch.equal(other.test.images, split.test.images)


def test_ham10000_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="HAM10000_metadata.csv"):
        load_ham10000(tmp_path)
    _write_ham(tmp_path, per_class=2)
    os.remove(tmp_path / "images" / "ISIC_0000003.jpg")
    with pytest.raises(FileNotFoundError, match="ISIC_0000003"):
        load_ham10000(tmp_path)
    with pytest.raises(ValueError, match="test_fraction"):
        load_ham10000(tmp_path, test_fraction=1.0)


# ----------------------------------------------------------------------------- image folder


def _write_image_folder(root, classes=("cat", "ant", "bee"), per_class=(3, 1), size=(8, 8)):
    for half, count in zip(("train", "test"), per_class):
        for c, name in enumerate(sorted(classes)):
            for i in range(count):
                _write_jpeg(root / half / name / f"{i:04d}.jpg", _solid(COLOURS[c], *size))


def test_image_folder_sorted_classes_and_labels(tmp_path):
    _write_image_folder(tmp_path)
    (tmp_path / "train" / "ant" / "notes.txt").write_text("not an image")  # ignored, as ImageFolder does
    png = encode_png(_solid(COLOURS[2], 8, 8))
    write_file(str(tmp_path / "train" / "cat" / "extra.png"), png)
    split = load_image_folder(tmp_path)
    assert split.classes == ["ant", "bee", "cat"]
    assert split.train.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert _colour_labels(split.train.images) == split.train.labels.tolist()
    assert split.test.labels.tolist() == [0, 1, 2] and split.input_shape == (3, 8, 8)
    assert load_image_folder(tmp_path, image_size=4).input_shape == (3, 4, 4)


def test_sixteen_bit_png_is_scaled_not_wrapped(tmp_path):
    from PIL import Image

    _write_image_folder(tmp_path, classes=("ant",), per_class=(0, 1), size=(2, 4))
    values = np.array([[0, 255, 256, 511], [4096, 32768, 65280, 65535]], dtype=np.uint16)
    (tmp_path / "train" / "ant").mkdir(parents=True)
    Image.fromarray(values).save(tmp_path / "train" / "ant" / "deep.png")  # 16-bit grayscale
    images = load_image_folder(tmp_path).train.images
    assert images.dtype == torch.uint8 and images.shape == (1, 3, 2, 4)
    # scaled to 8 bits (value >> 8), gray replicated to RGB; wrapping modulo 256 would give 0, 255, 0, 255, ...
    assert images[0, 0].tolist() == [[0, 0, 1, 1], [16, 128, 255, 255]]
    assert torch.equal(images[0, 0], images[0, 2])


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_image_folder(tmp_path / "absent")
    assert str(tmp_path / "absent" / "train") in str(err.value) and "<class>" in str(err.value)

    _write_image_folder(tmp_path / "mismatch")
    (tmp_path / "mismatch" / "test" / "dog").mkdir()
    _write_jpeg(tmp_path / "mismatch" / "test" / "dog" / "0.jpg", _solid(COLOURS[0], 8, 8))
    with pytest.raises(ValueError, match=r"only in test \['dog'\]"):
        load_image_folder(tmp_path / "mismatch")

    _write_image_folder(tmp_path / "sizes")
    _write_jpeg(tmp_path / "sizes" / "train" / "ant" / "big.jpg", _solid(COLOURS[0], 16, 16))
    with pytest.raises(ValueError, match="image_size"):
        load_image_folder(tmp_path / "sizes")
    assert load_image_folder(tmp_path / "sizes", image_size=8).train.images.shape[0] == 10

    _write_image_folder(tmp_path / "broken")
    (tmp_path / "broken" / "train" / "ant" / "0000.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="cannot decode image .*0000.jpg"):
        load_image_folder(tmp_path / "broken")


# ----------------------------------------------------------------------------- registry


def test_registry_names_and_unknown_name():
    assert set(DATASETS) == {
        "digits", "mnist", "cifar10", "cifar100", "svhn", "tiny_imagenet", "ham10000", "image_folder"
    }
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'.*cifar10.*digits"):
        load_dataset("imagenet")


def test_load_dataset_dispatches_options_and_resizes(tmp_path):
    digits = load_dataset("digits", download=False, image_size=16)  # digits has no size of its own: resized
    assert digits.input_shape == (1, 16, 16) and len(digits.train) == 1347
    _write_image_folder(tmp_path)
    assert load_dataset("image_folder", tmp_path, image_size=4).input_shape == (3, 4, 4)
    with pytest.raises(TypeError, match="does not take"):
        load_dataset("image_folder", tmp_path, download=True)


def test_load_dataset_missing_data_uses_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DFL_DATA", str(tmp_path / "data"))
    assert default_data_root() == tmp_path / "data"
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "data")):
        load_dataset("cifar100")


# ----------------------------------------------------------------------------- bad data on disk


@pytest.mark.parametrize("case, error, message", [
    ("missing", FileNotFoundError,
     "image folder not found: {root} does not exist. Expected layout: {root}/train/<class>/"),
    ("a file", FileNotFoundError, "image folder not found: {root} is not a folder. Expected layout:"),
    ("empty", FileNotFoundError, "image folder not found: {root}/train is missing. Expected layout:"),
    ("flat", FileNotFoundError, "no class folders in {root}/train: images must sit in one sub-folder per class. "
                                "Expected layout: {root}/train/<class>/<image>"),
    ("class only in test", ValueError, "class folders differ between {root}/train and {root}/test: only in train [], "
                                       "only in test ['dog']; every class needs a folder with images in both train/ "
                                       "and test/"),
    ("class images only in test", FileNotFoundError, "class folder {root}/train/bee holds no images (allowed "
                                                     "extensions: .jpg, "),
    ("class images only in train", FileNotFoundError, "class folder {root}/test/bee holds no images"),
], ids=["missing", "a-file", "empty", "flat", "class-only-in-test", "class-images-only-in-test",
        "class-images-only-in-train"])
def test_image_folder_layout_errors_name_the_path(tmp_path, case, error, message):
    """Each case fails while loading, before any training, naming the path and the expected layout."""
    root = tmp_path / "data"
    if case == "a file":
        root.write_text("not a folder")
    elif case == "empty":
        root.mkdir()
    elif case == "flat":
        _write_jpeg(root / "train" / "0.jpg", _solid(COLOURS[0], 8, 8))
        _write_jpeg(root / "test" / "0.jpg", _solid(COLOURS[0], 8, 8))
    elif case != "missing":
        _write_image_folder(root)
        if case == "class only in test":
            _write_jpeg(root / "test" / "dog" / "0.jpg", _solid(COLOURS[0], 8, 8))
        else:
            half = "train" if case == "class images only in test" else "test"
            for image in (root / half / "bee").iterdir():
                image.unlink()
    with pytest.raises(error) as err:
        load_image_folder(root)
    assert message.format(root=root) in str(err.value)


@pytest.mark.parametrize("content", [b"", b"not a jpeg", "truncated"], ids=["empty", "foreign", "truncated"])
def test_a_corrupt_image_is_named_with_its_path(tmp_path, content):
    _write_image_folder(tmp_path)
    bad = tmp_path / "train" / "bee" / "0001.jpg"
    bytes_ = bad.read_bytes()
    bad.write_bytes(bytes_[: len(bytes_) // 2] if content == "truncated" else content)
    with pytest.raises(ValueError) as err:
        load_image_folder(tmp_path)
    message = str(err.value)
    assert message.startswith(f"cannot decode image {bad} (") and ".cpp" not in message  # torchvision's reason
    assert message.endswith("the file is corrupt or not an image (jpeg, png, webp or gif); replace or delete it")


def test_tiny_imagenet_bad_files_are_named(tmp_path):
    base = _write_tiny_imagenet(tmp_path)
    (base / "val" / "images" / "val_1.JPEG").write_bytes(b"\xff\xd8 broken")
    with pytest.raises(ValueError, match=f"cannot decode image {base / 'val' / 'images' / 'val_1.JPEG'}"):
        load_tiny_imagenet(base)
    (base / "val" / "val_annotations.txt").write_text("\n")
    with pytest.raises(ValueError, match="val_annotations.txt lists no validation images"):
        load_tiny_imagenet(base)
    (base / "val" / "val_annotations.txt").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match="val_annotations.txt is not a text file"):
        load_tiny_imagenet(base)
    for image in (base / "train" / "n02000000" / "images").iterdir():
        image.unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_tiny_imagenet(base)
    assert str(err.value).startswith(f"Tiny-ImageNet class folder {base / 'train' / 'n02000000' / 'images'} holds "
                                     f"no images (.JPEG); every class in {base / 'wnids.txt'} needs training images")
    (base / "wnids.txt").write_bytes(b"\x89PNG\xff")
    with pytest.raises(ValueError, match="wnids.txt is not a text file"):
        load_tiny_imagenet(base)


def test_ham10000_bad_metadata_and_images_are_named(tmp_path):
    _write_ham(tmp_path, per_class=5)
    metadata = tmp_path / "HAM10000_metadata.csv"
    bad = tmp_path / "images" / "ISIC_0000005.jpg"
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match=f"cannot decode image {bad} "):
        load_ham10000(tmp_path, image_size=8)
    rows = metadata.read_text().splitlines()
    dropped = {f",ISIC_{n:07d}," for n in range(1, 5)}  # akiec keeps one of its 5 images
    metadata.write_text("\n".join(r for r in rows if not any(d in r for d in dropped)) + "\n")
    for n in range(1, 5):  # an image without its row is refused (a truncated metadata file)
        (tmp_path / "images" / f"ISIC_{n:07d}.jpg").unlink()
    with pytest.raises(ValueError) as err:
        load_ham10000(tmp_path, image_size=8)
    assert str(err.value) == (f"{metadata}: class(es) ['akiec'] have a single image; the split by class needs at "
                              "least 2 images of every class present (one for train, one for test)")
    metadata.write_text(rows[0] + "\n")
    with pytest.raises(ValueError, match="HAM10000_metadata.csv lists no images"):
        load_ham10000(tmp_path)
    metadata.write_text("")
    with pytest.raises(ValueError, match="HAM10000_metadata.csv is empty; expected a header line"):
        load_ham10000(tmp_path)
    metadata.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match="HAM10000_metadata.csv is not a text file"):
        load_ham10000(tmp_path)
    with pytest.raises(ValueError, match=r"test_fraction must lie in \(0, 1\), got nan"):
        load_ham10000(tmp_path, test_fraction=float("nan"))


def test_ham10000_too_few_images_for_the_test_fraction(tmp_path):
    _write_ham(tmp_path, per_class=2)  # 14 images of 7 classes: 10% is 2 test images, fewer than the classes
    with pytest.raises(ValueError, match=r"cannot split the 14 images of .*HAM10000_metadata.csv \(7 classes\) by "
                                         r"class with test_fraction=0.1"):
        load_ham10000(tmp_path, image_size=8, test_fraction=0.1)


def test_mnist_foreign_files_are_a_clear_error(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in readers._MNIST_FILES:
        (raw / name).write_bytes(b"\x00\x00\x20\x01" + bytes(60))  # not an idx magic number
    with pytest.raises(ValueError) as err:
        load_mnist(tmp_path)
    assert str(err.value).startswith(f"MNIST under {tmp_path} is corrupt or not the official files ({raw / readers._MNIST_FILES[0]} "
                                     "starts with 00 00 20 01, not the idx header 00 00 08 03 of 28x28 images). ")
    assert "download=True" in str(err.value)


def _png_header_only(path, width, height):
    """A PNG of a few bytes whose header declares ``width x height`` pixels (a decompression bomb's shape)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


@pytest.mark.parametrize(("width", "height", "shown"), [(60000, 60000, "3,600,000,000 pixels"),
                                                        (10000, 10000, "10000 x 10000 pixels (100,000,000)")])
def test_an_image_whose_header_declares_too_many_pixels_is_refused_before_decoding(tmp_path, width, height, shown):
    from lightning_dfl.datamodules.images import decode_images

    path = tmp_path / "bomb.png"
    _png_header_only(path, width, height)  # 60000 x 60000 segfaulted inside decode_image
    with pytest.raises(ValueError, match=f"image {path} declares {re.escape(shown)} in its header; an image may have "
                                         "at most 89,478,485 pixels"):
        decode_images([path])


def test_an_image_whose_name_is_not_utf8_is_read(tmp_path):
    from torchvision.io import encode_jpeg

    from lightning_dfl.datamodules.images import decode_images

    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9.jpg")  # a Latin-1 name from another system
    with open(path, "wb") as fh:
        fh.write(encode_jpeg(torch.full((3, 8, 8), 100, dtype=torch.uint8)).numpy().tobytes())
    images = decode_images([path])  # torchvision's read_file called it "corrupt or not an image"
    assert images.shape == (1, 3, 8, 8) and abs(int(images.float().mean()) - 100) <= 2
    broken = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xff.jpg")
    with open(broken, "wb") as fh:
        fh.write(b"not an image")
    with pytest.raises(ValueError, match=r"cannot decode image .*bad\\xff\.jpg \("):
        decode_images([broken])


def test_no_shipped_config_names_a_data_root():
    """Every shipped config reads its data from $LIGHTNING_DFL_DATA or the default root (``root: data`` in 26 of
    them hid both: "image folder not found: data")."""
    from pathlib import Path

    import yaml

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(configs) > 40
    named = [p.name for p in configs if "root" in ((yaml.safe_load(p.read_text()) or {}).get("data") or {})]
    assert named == []


# ----------------------------------------------------------------------------- damaged files name the file


def _write_mnist(root, train=6, test=4):
    rng = np.random.default_rng(0)
    raw = root / "MNIST" / "raw"
    for prefix, n in (("train", train), ("t10k", test)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return raw


@pytest.mark.parametrize("case, problem", [
    ("truncated", "{raw}/train-images-idx3-ubyte is 4,704 bytes, but its header declares 6 28x28 images (4,720 "
                  "bytes): truncated"),
    ("empty", "{raw}/t10k-labels-idx1-ubyte starts with nothing (the file is empty), not the idx header 00 00 08 01 "
              "of labels"),
    ("short header", "{raw}/t10k-images-idx3-ubyte is truncated: 10 bytes, shorter than its idx header (16 bytes)"),
    ("counts", "{raw}/train-images-idx3-ubyte holds 6 images but {raw}/train-labels-idx1-ubyte 4 labels"),
    ("label", "{raw}/t10k-labels-idx1-ubyte holds the label 200; MNIST's labels are 0 to 9"),
], ids=["truncated", "empty", "short-header", "counts", "label"])
def test_a_damaged_mnist_file_is_named(tmp_path, case, problem):
    """torchvision's own errors ("shape '[60000, 28, 28]' is invalid for input of size 47039000") name no file; a
    wrong label reached ImageData ("labels must lie in [0, 10)") with neither data set nor file."""
    raw = _write_mnist(tmp_path)
    if case == "truncated":
        data = (raw / "train-images-idx3-ubyte").read_bytes()
        (raw / "train-images-idx3-ubyte").write_bytes(data[:-16])
    elif case == "empty":
        (raw / "t10k-labels-idx1-ubyte").write_bytes(b"")
    elif case == "short header":
        (raw / "t10k-images-idx3-ubyte").write_bytes((raw / "t10k-images-idx3-ubyte").read_bytes()[:10])
    elif case == "counts":
        (raw / "train-labels-idx1-ubyte").write_bytes((raw / "t10k-labels-idx1-ubyte").read_bytes())
    else:
        _write_idx(raw / "t10k-labels-idx1-ubyte", np.array([0, 1, 200, 3]))
    with pytest.raises(ValueError) as err:
        load_mnist(tmp_path, cache=False)
    message = str(err.value)
    assert message.startswith(f"MNIST under {tmp_path} is corrupt or not the official files "
                              f"({problem.format(raw=raw)}). Expected layout: ")
    assert "\n" not in message


def test_a_damaged_cifar_file_is_named_by_its_checksum(tmp_path, monkeypatch):
    """torchvision only says "Dataset not found or corrupted": the message names the file that fails its MD5."""
    import hashlib

    from torchvision.datasets import CIFAR10

    _write_cifar10(tmp_path)
    base = tmp_path / "cifar-10-batches-py"
    md5 = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in base.iterdir()}  # the fixture is "official"
    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5["batches.meta"]})
    assert len(load_cifar10(tmp_path, cache=False).train) == 10
    data = (base / "data_batch_3").read_bytes()
    (base / "data_batch_3").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as err:
        load_cifar10(tmp_path, cache=False)
    assert str(err.value).startswith(f"CIFAR-10 under {tmp_path} is corrupt or not the official files "
                                     "(cifar-10-batches-py/data_batch_3 fails the official MD5 checksum: truncated, "
                                     "damaged or another copy). Expected layout: ")


def test_a_damaged_svhn_file_is_named_by_its_checksum(tmp_path):
    from scipy.io import savemat

    savemat(tmp_path / "train_32x32.mat", {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[1], [2]])})
    (tmp_path / "test_32x32.mat").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"SVHN under {tmp_path} is corrupt or not the official files "
                                                   "(train_32x32.mat fails the official MD5 checksum")):
        load_svhn(tmp_path, cache=False)


def test_a_truncated_png_is_named_without_torchvisions_source_line(tmp_path):
    """decode_png's error came as "operator(), /__w/vision/.../decode_png.cpp:79, Out of bound read ..."."""
    from lightning_dfl.datamodules.images import decode_images

    path = tmp_path / "cut.png"
    data = encode_png(torch.randint(0, 255, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    path.write_bytes(data.numpy().tobytes()[:-200])
    with pytest.raises(ValueError) as err:
        decode_images([path])
    assert str(err.value).startswith(f"cannot decode image {path} (Out of bound read in decode_png")
    assert ".cpp" not in str(err.value)


@pytest.mark.parametrize("kind", ["folder", "fifo", "broken link"])
def test_an_image_that_is_not_a_regular_file_is_named_so(tmp_path, kind):
    """A folder, FIFO or broken link named like an image was "image file not found" though it is there."""
    from lightning_dfl.datamodules.images import decode_images

    path = tmp_path / "0001.jpg"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "absent.jpg")
    with pytest.raises(FileNotFoundError, match=f"^image {re.escape(str(path))} is not a regular file; an image must "
                                                "be one: replace or delete it$"):
        decode_images([path])


@pytest.mark.parametrize("case, error, message", [
    ("wnid twice", ValueError, "{base}/wnids.txt:4: the class 'n01000000' is listed again (first on line 2); every "
                               "wnid must appear once"),
    ("class folder not in wnids", ValueError, "{base}/train holds 1 class folder(s) not listed in {base}/wnids.txt "
                                              "(first: n09000000); add them to wnids.txt or remove them"),
    ("image listed twice", ValueError, "{base}/val/val_annotations.txt:5: val_1.JPEG is listed again (first on line "
                                       "2); every validation image must appear once"),
    ("path outside val/images", ValueError, "{base}/val/val_annotations.txt:5: expected the name of a file in "
                                            "{base}/val/images, got '../../train/n01000000/images/n01000000_0.JPEG'"),
    ("empty file name", ValueError, "{base}/val/val_annotations.txt:5: expected the name of a file in "
                                    "{base}/val/images, got ''"),
    ("image without a label", ValueError, "{base}/val/val_annotations.txt gives no label for 1 image(s) in "
                                          "{base}/val/images (first: val_3.JPEG): the file is truncated or not the "
                                          "official one"),
], ids=["wnid-twice", "class-folder-not-in-wnids", "image-listed-twice", "path-outside-val-images", "empty-file-name",
        "image-without-a-label"])
def test_tiny_imagenet_inconsistent_lists_are_refused(tmp_path, case, error, message):
    """Each was silently accepted: a duplicate wnid dropped, a class folder missing from wnids.txt ignored, a
    validation image counted twice, a training image read as a validation one, an unlabelled image left out."""
    base = _write_tiny_imagenet(tmp_path)
    annotations = base / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    if case == "wnid twice":
        (base / "wnids.txt").write_text("n02000000\nn01000000\nn03000000\nn01000000\n")
    elif case == "class folder not in wnids":
        shutil.copytree(base / "train" / "n01000000", base / "train" / "n09000000")
    elif case == "image listed twice":
        annotations.write_text("\n".join(lines + [lines[1]]) + "\n")
    elif case == "path outside val/images":
        annotations.write_text("\n".join(lines + ["../../train/n01000000/images/n01000000_0.JPEG\tn01000000"]) + "\n")
    elif case == "empty file name":
        annotations.write_text("\n".join(lines + ["\tn01000000"]) + "\n")
    else:
        annotations.write_text("\n".join(lines[:3]) + "\n")  # cut at a line's end
    with pytest.raises(error) as err:
        load_tiny_imagenet(base, cache=False)
    assert str(err.value) == message.format(base=base)


@pytest.mark.parametrize("case, message", [
    ("image twice", "{metadata}: image_id ISIC_0000002 is listed again in data row 36 (first in data row {first}); "
                    "every image must appear once"),
    ("empty image_id", "{metadata}: data row 36 has an empty image_id; expected e.g. ISIC_0024306"),
    ("two files", "HAM10000: image ISIC_0000002 is both {root}/HAM10000_images_part_1/ISIC_0000002.jpg and "
                  "{root}/images/ISIC_0000002.jpg; keep one (in images/ or in the official "
                  "HAM10000_images_part_{{1,2}}/)"),
    ("jpg and png", "HAM10000: image ISIC_0000002 is both {root}/images/ISIC_0000002.jpg and "
                    "{root}/images/ISIC_0000002.png; keep one (in images/ or in the official "
                    "HAM10000_images_part_{{1,2}}/)"),
    ("image without a row", "{metadata} gives no dx for 1 image(s) (first: {root}/images/ISIC_0000099.jpg): the file "
                            "is truncated or not the official one, or the image does not belong to the data set"),
], ids=["image-twice", "empty-image-id", "two-files", "jpg-and-png", "image-without-a-row"])
def test_ham10000_inconsistent_metadata_and_images_are_refused(tmp_path, case, message):
    """Each loaded before: an image twice in the metadata was decoded twice (possibly in train and test, or under two
    labels), which of two files was the image depended on the folders' order, and an image without a row was left
    out."""
    root = tmp_path / "ham"
    _write_ham(root, per_class=5)
    metadata = root / "HAM10000_metadata.csv"
    rows = metadata.read_text().splitlines()
    first = next(i for i, r in enumerate(rows) if ",ISIC_0000002," in r)
    if case == "image twice":
        metadata.write_text("\n".join(rows + [rows[first].replace(",akiec,", ",nv,")]) + "\n")
    elif case == "empty image_id":
        metadata.write_text("\n".join(rows + ["HAM_9,,nv,histo,50.0,male,back"]) + "\n")
    elif case == "two files":
        (root / "HAM10000_images_part_1").mkdir()
        shutil.copy(root / "images" / "ISIC_0000002.jpg", root / "HAM10000_images_part_1")
        os.rename(root / "images", root / "HAM10000_images_part_2")  # the official parts, one image in both
        message = message.replace("{root}/images/", "{root}/HAM10000_images_part_2/")
    elif case == "jpg and png":
        shutil.copy(root / "images" / "ISIC_0000002.jpg", root / "images" / "ISIC_0000002.png")
    else:
        shutil.copy(root / "images" / "ISIC_0000002.jpg", root / "images" / "ISIC_0000099.jpg")
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_ham10000(root, image_size=8, cache=False)
    assert str(err.value) == message.format(metadata=metadata, root=root, first=first)


@pytest.mark.parametrize("name", ["mnist", "cifar10", "svhn"])
def test_a_failed_download_is_one_line(tmp_path, monkeypatch, name):
    """Without network, CIFAR-10 and SVHN raised urllib's URLError (a traceback), MNIST said its files were
    "corrupt or not the official files" and quoted torchvision's message of five lines."""
    from urllib.error import URLError

    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.mnist as tv_mnist
    import torchvision.datasets.svhn as tv_svhn

    def offline(*args, **kwargs):
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", offline)
    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", offline)
    monkeypatch.setattr(tv_svhn, "download_url", offline)
    with pytest.raises(ValueError) as err:
        load_dataset(name, tmp_path, download=True, cache=False)
    message = str(err.value)
    shown = {"mnist": "MNIST", "cifar10": "CIFAR-10", "svhn": "SVHN"}[name]
    assert message.startswith(f"{shown}: download=True could not fetch the official files into {tmp_path} (")
    assert "Name or service not known" in message and "without network access, put them there by hand" in message
    assert "\n" not in message
