"""Decoded data sets cached on disk: served from the cache on the second load (no decoding), bit-identical,
invalidated by a changed, added or removed source file, written atomically, a corrupt entry rebuilt."""

from __future__ import annotations

import csv
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg, write_file

from lightning_dfl.datamodules import cache as cache_module
from lightning_dfl.datamodules import readers
from lightning_dfl.datamodules.cache import CACHE_ENV, cache_dir, default_cache_dir
from lightning_dfl.datamodules.datasets import load_dataset
from lightning_dfl.datamodules.readers import HAM10000_CLASSES

COLOURS = [(230, 20, 20), (20, 230, 20), (20, 20, 230), (230, 230, 20), (20, 230, 230), (230, 20, 230), (120, 120, 120)]


@pytest.fixture
def accept_fixture_checksums(monkeypatch):
    """Fixture files cannot match the official MD5s: let torchvision's check test existence only."""
    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.svhn as tv_svhn

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    monkeypatch.setattr(tv_svhn, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


# ----------------------------------------------------------------------------- fixtures in the official formats


def _jpeg(path, colour, size=(8, 8)) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image = torch.tensor(colour, dtype=torch.uint8)[:, None, None].expand(3, *size).contiguous()
    write_file(str(path), encode_jpeg(image, quality=95))


def _pickle(path, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _cifar10(root):
    rng = np.random.default_rng(0)
    base = root / "cifar-10-batches-py"
    for i in range(1, 6):
        _pickle(base / f"data_batch_{i}", {"data": rng.integers(0, 256, (2, 3072)).astype(np.uint8),
                                           "labels": rng.integers(0, 10, 2).tolist()})
    _pickle(base / "test_batch", {"data": rng.integers(0, 256, (3, 3072)).astype(np.uint8), "labels": [1, 2, 3]})
    _pickle(base / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    return base / "data_batch_1"


def _cifar100(root):
    rng = np.random.default_rng(1)
    base = root / "cifar-100-python"
    _pickle(base / "train", {"data": rng.integers(0, 256, (4, 3072)).astype(np.uint8), "fine_labels": [0, 99, 42, 7]})
    _pickle(base / "test", {"data": rng.integers(0, 256, (2, 3072)).astype(np.uint8), "fine_labels": [5, 6]})
    _pickle(base / "meta", {"fine_label_names": [f"class{i:02d}" for i in range(100)]})
    return base / "test"


def _svhn(root):
    from scipy.io import savemat

    rng = np.random.default_rng(2)
    root.mkdir(parents=True, exist_ok=True)
    savemat(root / "train_32x32.mat", {"X": rng.integers(0, 256, (32, 32, 3, 5)).astype(np.uint8),
                                       "y": np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)})
    savemat(root / "test_32x32.mat", {"X": rng.integers(0, 256, (32, 32, 3, 2)).astype(np.uint8),
                                      "y": np.array([[3], [10]], dtype=np.uint8)})
    return root / "test_32x32.mat"


def _mnist(root):
    rng = np.random.default_rng(3)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, shape in [("train-images-idx3-ubyte", (6, 28, 28)), ("train-labels-idx1-ubyte", (6,)),
                        ("t10k-images-idx3-ubyte", (4, 28, 28)), ("t10k-labels-idx1-ubyte", (4,))]:
        array = rng.integers(0, 10 if len(shape) == 1 else 256, shape).astype(np.uint8)
        header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in shape)
        (raw / name).write_bytes(header + array.tobytes())
    return raw / "train-images-idx3-ubyte"


def _image_folder(root):
    for half, count in (("train", 3), ("test", 1)):
        for c, name in enumerate(("ant", "bee", "cat")):
            for i in range(count):
                _jpeg(root / half / name / f"{i:04d}.jpg", COLOURS[c])
    return root / "train" / "bee" / "0001.jpg"


def _tiny_imagenet(root):
    base = root / "tiny-imagenet-200"
    wnids = ["n01000000", "n02000000"]
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for c, wnid in enumerate(wnids):
        for i in range(2):
            _jpeg(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", COLOURS[c], (16, 16))
        _jpeg(base / "val" / "images" / f"val_{c}.JPEG", COLOURS[c], (16, 16))
    (base / "val" / "val_annotations.txt").write_text("".join(f"val_{c}.JPEG\t{w}\t0\t0\t15\t15\n"
                                                              for c, w in enumerate(wnids)))
    return base / "val" / "images" / "val_1.JPEG"


def _ham10000(root):
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for c, dx in enumerate(HAM10000_CLASSES):
        for i in range(2):
            image_id = f"ISIC_{2 * c + i:07d}"
            _jpeg(root / "images" / f"{image_id}.jpg", COLOURS[c], (12, 10))
            rows.append([f"HAM_{2 * c + i:07d}", image_id, dx])
    with open(root / "HAM10000_metadata.csv", "w", newline="") as f:
        csv.writer(f).writerows([["lesion_id", "image_id", "dx"], *rows])
    return root / "images" / "ISIC_0000003.jpg"


#: name -> (writer returning a source file to change, options, the decoder a cache hit must not call)
SETS = {
    "cifar10": (_cifar10, {}, "_torchvision_call"),
    "cifar100": (_cifar100, {}, "_torchvision_call"),
    "svhn": (_svhn, {}, "_torchvision_call"),
    "mnist": (_mnist, {}, "_torchvision_call"),
    "image_folder": (_image_folder, {}, "decode_images"),
    "tiny_imagenet": (_tiny_imagenet, {"image_size": 8}, "decode_images"),
    "ham10000": (_ham10000, {"image_size": 8, "test_fraction": 0.5}, "decode_images"),
}


def _count_calls(monkeypatch, name):
    """Count the calls of the readers module's ``name`` (the decoder), still calling it."""
    original = getattr(readers, name)
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(readers, name, spy)
    return calls


def _same(a, b):
    for half in ("train", "test"):
        x, y = getattr(a, half), getattr(b, half)
        assert x.images.dtype == y.images.dtype == torch.uint8 and x.labels.dtype == y.labels.dtype == torch.int64
        assert torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels) and x.classes == y.classes


def _entries(folder):
    return sorted(p.name for p in folder.glob("*.decoded"))


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(SETS))
def test_second_load_is_served_from_the_cache_bit_identical(tmp_path, monkeypatch, accept_fixture_checksums, name):
    writer, options, decoder = SETS[name]
    writer(tmp_path / "data")
    folder = tmp_path / "cache"
    calls = _count_calls(monkeypatch, decoder)
    first = load_dataset(name, tmp_path / "data", cache=str(folder), **options)
    assert calls and len(_entries(folder)) == 1
    decoded = len(calls)

    second = load_dataset(name, tmp_path / "data", cache=str(folder), **options)
    assert len(calls) == decoded, "the second load decoded again instead of reading the cache"
    _same(first, second)
    uncached = load_dataset(name, tmp_path / "data", cache=False, **options)
    _same(first, uncached)


@pytest.mark.parametrize("name", list(SETS))
def test_a_touched_or_changed_source_file_invalidates_the_entry(tmp_path, monkeypatch, accept_fixture_checksums,
                                                                name):
    writer, options, decoder = SETS[name]
    source = writer(tmp_path / "data")
    folder = tmp_path / "cache"
    calls = _count_calls(monkeypatch, decoder)
    load_dataset(name, tmp_path / "data", cache=str(folder), **options)
    old_entry = _entries(folder)
    decoded = len(calls)

    st = os.stat(source)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))  # touched: same bytes, a new time
    load_dataset(name, tmp_path / "data", cache=str(folder), **options)
    assert len(calls) > decoded
    assert len(_entries(folder)) == 1 and _entries(folder) != old_entry  # the stale entry is replaced
    decoded = len(calls)
    load_dataset(name, tmp_path / "data", cache=str(folder), **options)
    assert len(calls) == decoded


def test_changed_added_and_removed_images_give_the_new_contents(tmp_path, monkeypatch):
    _image_folder(tmp_path / "data")
    folder = tmp_path / "cache"
    first = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert len(first.train) == 9

    image = tmp_path / "data" / "train" / "ant" / "0000.jpg"
    before = os.stat(image)
    _jpeg(image, COLOURS[4], (8, 8))  # same name, new pixels (maybe the same size): its time tells
    os.utime(image, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))
    changed = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    _same(changed, load_dataset("image_folder", tmp_path / "data", cache=False))
    assert not torch.equal(changed.train.images[0], first.train.images[0])

    _jpeg(tmp_path / "data" / "train" / "cat" / "0009.jpg", COLOURS[2])  # added
    added = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert len(added.train) == 10 and added.train.labels.tolist()[-1] == 2

    os.remove(tmp_path / "data" / "train" / "bee" / "0000.jpg")  # removed
    removed = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert len(removed.train) == 9 and removed.train.labels.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    _same(removed, load_dataset("image_folder", tmp_path / "data", cache=False))
    assert len(_entries(folder)) == 1


def test_options_and_the_format_version_are_part_of_the_key(tmp_path, monkeypatch):
    _image_folder(tmp_path / "data")
    folder = tmp_path / "cache"
    calls = _count_calls(monkeypatch, "decode_images")
    load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert load_dataset("image_folder", tmp_path / "data", cache=str(folder), image_size=4).input_shape == (3, 4, 4)
    assert len(_entries(folder)) == 2  # one entry per image size
    decoded = len(calls)
    monkeypatch.setattr(cache_module, "FORMAT_VERSION", cache_module.FORMAT_VERSION + 1)
    load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert len(calls) > decoded


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "flipped"])
def test_a_corrupt_entry_is_ignored_and_rebuilt(tmp_path, monkeypatch, damage):
    _image_folder(tmp_path / "data")
    folder = tmp_path / "cache"
    first = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    (entry,) = folder.glob("*.decoded")
    data = entry.read_bytes()
    flipped = data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]  # one bit of the last array's data
    entry.write_bytes({"garbage": b"not a cache file" * 10, "truncated": data[: len(data) - 100], "empty": b"",
                       "flipped": flipped}[damage])

    calls = _count_calls(monkeypatch, "decode_images")
    rebuilt = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert calls  # decoded again
    _same(first, rebuilt)
    decoded = len(calls)
    _same(first, load_dataset("image_folder", tmp_path / "data", cache=str(folder)))  # the entry was written whole
    assert len(calls) == decoded and _entries(folder) == [entry.name]


def test_a_whole_entry_of_other_dtypes_is_named_and_rebuilt(tmp_path, monkeypatch):
    """An entry with a valid key and checksums but float64 images (written by other code or by hand) is not
    served: a warning names it and the images are decoded again (it was refused later as "images must be uint8",
    naming no file)."""
    _image_folder(tmp_path / "data")
    folder = tmp_path / "cache"
    first = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    (entry,) = folder.glob("*.decoded")
    arrays, header = cache_module.read_entry(entry)
    cache_module.write_entry(entry, {n: a.astype(np.float64) for n, a in arrays.items()}, header)
    calls = _count_calls(monkeypatch, "decode_images")
    with pytest.warns(UserWarning, match=rf"cache entry '{entry}' holds train as float64, not uint8: it is decoded"):
        rebuilt = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert calls
    _same(first, rebuilt)
    assert cache_module.read_entry(entry)[0]["train"].dtype == np.uint8  # replaced


def test_a_killed_write_leaves_no_entry(tmp_path, monkeypatch):
    _image_folder(tmp_path / "data")
    folder = tmp_path / "cache"
    real_fsync = os.fsync
    seen = []

    def killed(fd):
        seen.append(os.fstat(fd).st_size)  # the data are written, not yet renamed into place
        raise KeyboardInterrupt  # the run is stopped

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert seen and seen[0] > 0 and list(folder.iterdir()) == []  # neither an entry nor the temporary file
    monkeypatch.setattr(os, "fsync", real_fsync)

    (folder / ".left-by-a-killed-run.decoded.tmp").write_bytes(b"partial")
    calls = _count_calls(monkeypatch, "decode_images")
    split = load_dataset("image_folder", tmp_path / "data", cache=str(folder))
    assert calls and len(split.train) == 9 and len(_entries(folder)) == 1


def test_the_cache_folder_option_environment_and_off(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_dir() == default_cache_dir() == cache_dir(True)
    assert str(default_cache_dir()).endswith(os.path.join(".cache", "lightning-dfl", "decoded"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env" and cache_dir(str(tmp_path / "x")) == tmp_path / "x"
    assert cache_dir(False) is None and cache_dir("off") is None
    with pytest.raises(ValueError, match="cache must be"):
        cache_dir(3)

    _image_folder(tmp_path / "data")
    load_dataset("image_folder", tmp_path / "data")
    assert len(_entries(tmp_path / "env")) == 1  # the environment's folder by default

    monkeypatch.setenv(CACHE_ENV, "off")
    calls = _count_calls(monkeypatch, "decode_images")
    load_dataset("image_folder", tmp_path / "data")
    load_dataset("image_folder", tmp_path / "data", cache=False)
    assert len(calls) == 2 * 2 and len(_entries(tmp_path / "env")) == 1  # train and test decoded on each load


def test_digits_are_not_cached_and_accept_the_option(tmp_path):
    split = load_dataset("digits", cache=str(tmp_path / "cache"))
    assert len(split.train) == 1347 and not (tmp_path / "cache").exists()


def test_an_unwritable_cache_only_warns(tmp_path):
    _image_folder(tmp_path / "data")
    (tmp_path / "file").write_text("a file where the cache folder should be")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = load_dataset("image_folder", tmp_path / "data", cache=str(tmp_path / "file" / "cache"))
    assert len(split.train) == 9 and any("could not cache" in str(w.message) for w in caught)


def test_the_datamodule_cache_option(tmp_path, monkeypatch):
    from lightning_dfl.datamodules import FederatedDataModule

    _image_folder(tmp_path / "data")
    dm = FederatedDataModule("image_folder", root=str(tmp_path / "data"), num_clients=2, min_size=1,
                             test_samples_per_client=1, cache=str(tmp_path / "cache"))
    dm.setup()
    assert len(_entries(tmp_path / "cache")) == 1 and "cache" not in dm.hparams  # not part of the run's identity
    calls = _count_calls(monkeypatch, "decode_images")
    FederatedDataModule("image_folder", root=str(tmp_path / "data"), num_clients=2, min_size=1,
                        test_samples_per_client=1, cache=False).setup()
    assert len(calls) == 2  # train and test decoded: not served from the cache
    with pytest.raises(ValueError, match="cache must be"):
        FederatedDataModule(cache=3)
