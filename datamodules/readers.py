"""The data sets' readers: each returns a :class:`~.images.Split` decoded once into uint8 tensors.

The protocol data sets of DisPFL App. B.1 (CIFAR-10/100, Tiny-ImageNet) and DA-DPFL Sec. VI (CIFAR-10/100,
HAM10000) are read from their official on-disk formats; the torchvision sets go through torchvision's own
dataset classes (and their checksums); digits ships with scikit-learn. A missing, damaged or foreign file is
one error naming the expected layout.

The decoded arrays of every data set read from files are cached on disk (:mod:`.cache`, keyed by the
source files' names, sizes and times): a second start reads one file instead of decoding again. The
readers' ``cache`` option: ``None`` the default folder (``$LIGHTNING_DFL_CACHE`` or
``~/.cache/lightning-dfl/decoded``), ``False`` off, or a folder.
"""

from __future__ import annotations

import csv
import io
import math
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.files import regular_files
from lightning_dfl.seeding import MAX_SEED

from .cache import cached_arrays
from .images import ImageData, Split, check_image_size, decode_images, describe_error

__all__ = [
    "HAM10000_CLASSES",
    "load_cifar10",
    "load_cifar100",
    "load_digits",
    "load_ham10000",
    "load_image_folder",
    "load_mnist",
    "load_svhn",
    "load_tiny_imagenet",
]

#: HAM10000 diagnosis codes (the ``dx`` column) in the fixed label order used here.
HAM10000_CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")

_DOWNLOAD_HINT = "Pass download=True to fetch it with torchvision (needs network access)."
# Errors torchvision's readers raise on truncated or foreign files once the files exist.
_READ_ERRORS = (RuntimeError, ValueError, TypeError, KeyError, IndexError, EOFError, AssertionError,
                pickle.UnpicklingError)


# --------------------------------------------------------------------------- helpers


def _read_text(path: Path) -> str:
    """A text file's contents; a file that is not UTF-8 text raises ValueError naming it."""
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a text file ({err}); replace it with the official one") from err


def _labels(values) -> Tensor:
    return torch.as_tensor(np.asarray(values), dtype=torch.int64).reshape(-1)


def _cached_split(kind: str, root: Path, files: Sequence[str | os.PathLike], build: Callable[[], Split],
                  cache: str | os.PathLike | bool | None, params: dict | None = None) -> Split:
    """``build()``'s split, served from the decoded-data cache while ``files`` (names, sizes, times) are unchanged."""

    def arrays() -> tuple[dict[str, np.ndarray], dict]:
        split = build()
        return ({f"{half}_{part}": getattr(getattr(split, half), part).numpy() for half in ("train", "test")
                 for part in ("images", "labels")},
                {"train_classes": list(split.train.classes), "test_classes": list(split.test.classes)})

    dtypes = {f"{half}_{part}": dtype for half in ("train", "test") for part, dtype in (("images", "uint8"),
                                                                                          ("labels", "int64"))}
    out, meta = cached_arrays(kind, root, files, arrays, params, cache, dtypes)
    return Split(*(ImageData(torch.from_numpy(out[f"{half}_images"]), torch.from_numpy(out[f"{half}_labels"]),
                             list(meta[f"{half}_classes"])) for half in ("train", "test")))


def _cached_decode(kind: str, root: Path, parts: dict[str, Sequence[str | os.PathLike]], image_size: int | None,
                   cache: str | os.PathLike | bool | None) -> dict[str, Tensor]:
    """:func:`decode_images` of each part's paths (``{"train": [...], "test": [...]}``), served from the
    decoded-data cache while the files (names, sizes, times, in this order) are unchanged."""

    def arrays() -> tuple[dict[str, np.ndarray], dict]:
        return {name: decode_images(paths, image_size).numpy() for name, paths in parts.items()}, {}

    files = [path for paths in parts.values() for path in paths]
    out, _ = cached_arrays(kind, root, files, arrays, {"image_size": image_size, "parts": list(parts)}, cache,
                           dict.fromkeys(parts, "uint8"))
    return {name: torch.from_numpy(out[name]) for name in parts}


def _find_base(root: str | os.PathLike, marker: str, subdir: str | None) -> Path | None:
    """``root`` if it holds ``marker``, else ``root/subdir`` if that does, else None."""
    base = Path(root).expanduser()
    if (base / marker).exists():
        return base
    if subdir is not None and (base / subdir / marker).exists():
        return base / subdir
    return None


def _require_files(
    name: str, root: Path, files: Sequence[str], layout: str, download: bool, hint: str = ""
) -> None:
    """Raise FileNotFoundError naming ``root`` and the expected layout when files are missing."""
    if download:
        return
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{name} not found under {root}: missing {', '.join(missing)}. Expected layout: {layout}. "
            + _DOWNLOAD_HINT
            + hint
        )


def _corrupt(name: str, root: Path, layout: str, problem: str) -> ValueError:
    return ValueError(
        f"{name} under {root} is corrupt or not the official files ({problem}). Expected layout: {layout}. "
        "Delete the files and pass download=True to fetch the official copy (needs network access)."
    )


def _torchvision_call(name: str, root: Path, layout: str, factory: Callable[[], object],
                      checksums: Sequence[tuple[Path, str]] = (), download: bool = False):
    """Build a torchvision data set; a failed checksum or unreadable file becomes a ValueError, naming the files of
    ``checksums`` (path, official MD5) that fail their MD5 (torchvision's own message names none); with
    ``download``, a download that fails (no network) is one too."""
    from urllib.error import URLError

    try:
        return factory()
    except Exception as err:
        if download and (isinstance(err, (URLError, ConnectionError, TimeoutError))
                         or str(err).startswith("Error downloading")):
            raise ValueError(f"{name}: download=True could not fetch the official files into {root} "
                             f"({' '.join(describe_error(err).split())}); without network access, put them there by "
                             f"hand. Expected layout: {layout}") from err
        if not isinstance(err, _READ_ERRORS):
            raise
        from torchvision.datasets.utils import check_integrity

        failed = [os.path.relpath(path, root) for path, md5 in checksums
                  if path.is_file() and not check_integrity(str(path), md5)]
        problem = (f"{', '.join(failed)} {'fails' if len(failed) == 1 else 'fail'} the official MD5 checksum: "
                   "truncated, damaged or another copy") if failed else f"torchvision: {describe_error(err)}"
        raise _corrupt(name, root, layout, problem) from err


def _idx_items(path: Path, item_shape: tuple[int, ...], what: str) -> int:
    """The number of ``uint8`` items of ``item_shape`` in the idx file ``path`` (MNIST's format: bytes 00 00 08
    <ndim>, ndim big-endian sizes, the data); a header or size that is not so is a one-line problem naming the
    file (raised as ``_IdxError``), before torchvision reads it (its errors name no file)."""
    ndim = 1 + len(item_shape)
    with open(path, "rb") as fh:
        head = fh.read(4 + 4 * ndim)
    if len(head) < 4 or head[:3] != b"\x00\x00\x08" or head[3] != ndim:
        start = head[:4].hex(" ") or "nothing (the file is empty)"
        raise _IdxError(f"{path} starts with {start}, not the idx header 00 00 08 {ndim:02x} of {what}")
    if len(head) < 4 + 4 * ndim:
        raise _IdxError(f"{path} is truncated: {len(head)} bytes, shorter than its idx header ({4 + 4 * ndim} bytes)")
    shape = struct.unpack(f">{ndim}I", head[4:])
    if tuple(shape[1:]) != item_shape:
        raise _IdxError(f"{path} holds {what} of {'x'.join(map(str, shape[1:]))}, not {'x'.join(map(str, item_shape))}")
    need, size = len(head) + math.prod(shape), path.stat().st_size
    if size != need:
        raise _IdxError(f"{path} is {size:,} bytes, but its header declares {shape[0]:,} {what} ({need:,} bytes): "
                        f"{'truncated' if size < need else 'trailing bytes'}")
    return shape[0]


class _IdxError(ValueError):
    """An MNIST idx file that is not as its header says."""


# --------------------------------------------------------------------------- loaders


def load_digits(root: str | os.PathLike | None = None) -> Split:
    """scikit-learn's bundled 8x8 digits (1,797 images): values 0..16 scaled to 0..255.

    A stratified split, ``train_test_split(test_size=0.25, random_state=0)``: 1,347 train and
    450 test images. ``root`` is ignored: the data ships with scikit-learn.
    """
    from sklearn.datasets import load_digits as _sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = _sk_load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # [N, 1, 8, 8]
    labels = bunch.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=0.25, random_state=0, stratify=labels
    )
    classes = [str(c) for c in range(10)]

    def part(idx):
        return ImageData(torch.from_numpy(images[idx]), _labels(labels[idx]), classes)

    return Split(part(train_idx), part(test_idx))


_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def load_mnist(root: str | os.PathLike, download: bool = False,
               cache: str | os.PathLike | bool | None = None) -> Split:
    """MNIST through ``torchvision.datasets.MNIST``: ``root/MNIST/raw/*-ubyte`` (the idx files).

    ``cache``: where the decoded arrays are cached (see :mod:`.cache`; False: not cached).
    """
    from torchvision.datasets import MNIST

    root = Path(root).expanduser()
    layout = f"{root}/MNIST/raw/{{{','.join(_MNIST_FILES)}}} (torchvision's MNIST layout, idx files unzipped)"
    _require_files("MNIST", root, [f"MNIST/raw/{f}" for f in _MNIST_FILES], layout, download)

    def part(train: bool) -> ImageData:
        raw = root / "MNIST" / "raw"
        images, labels = (raw / name for name in (_MNIST_FILES[:2] if train else _MNIST_FILES[2:]))
        if images.is_file() and labels.is_file():  # else download=True fetches them
            try:
                count, labelled = _idx_items(images, (28, 28), "28x28 images"), _idx_items(labels, (), "labels")
            except _IdxError as err:
                raise _corrupt("MNIST", root, layout, str(err)) from None
            if count != labelled:
                raise _corrupt("MNIST", root, layout, f"{images} holds {count:,} images but {labels} {labelled:,} "
                                                      "labels")
        ds = _torchvision_call("MNIST", root, layout, lambda: MNIST(str(root), train=train, download=download),
                               download=download)
        if len(ds.targets) and int(ds.targets.max()) >= len(ds.classes):
            raise _corrupt("MNIST", root, layout, f"{labels} holds the label {int(ds.targets.max())}; MNIST's labels "
                                                  f"are 0 to {len(ds.classes) - 1}")
        return ImageData(ds.data.to(torch.uint8).unsqueeze(1).contiguous(), _labels(ds.targets), list(ds.classes))

    return _cached_split("mnist", root, [root / "MNIST" / "raw" / f for f in _MNIST_FILES],
                         lambda: Split(part(True), part(False)), cache)


def _load_cifar(cls, name: str, folder: str, files: Sequence[str], root, download: bool, hint: str = "",
                cache: str | os.PathLike | bool | None = None) -> Split:
    root = Path(root).expanduser()
    layout = f"{root}/{folder}/{{{','.join(files)}}} (the official python pickles, torchvision's layout)"
    _require_files(name, root, [f"{folder}/{f}" for f in files], layout, download, hint)

    official = [*cls.train_list, *cls.test_list, [cls.meta["filename"], cls.meta["md5"]]]
    checksums = [(root / folder / file, md5) for file, md5 in official]

    def part(train: bool) -> ImageData:
        ds = _torchvision_call(name, root, layout, lambda: cls(str(root), train=train, download=download), checksums,
                               download)
        images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()  # HWC -> CHW
        return ImageData(images, _labels(ds.targets), list(ds.classes))

    return _cached_split(cls.__name__.lower(), root, [root / folder / f for f in files],
                         lambda: Split(part(True), part(False)), cache)


def load_cifar10(root: str | os.PathLike, download: bool = False,
                 cache: str | os.PathLike | bool | None = None) -> Split:
    """CIFAR-10 through ``torchvision.datasets.CIFAR10``: ``root/cifar-10-batches-py/``.

    For the offline JPEG copy (``cifar10-jpg/{train,test}/<class>/``) use :func:`load_image_folder`.
    ``cache``: where the decoded arrays are cached (see :mod:`.cache`; False: not cached).
    """
    from torchvision.datasets import CIFAR10

    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    hint = " A JPEG copy unpacked as cifar10-jpg/{train,test}/<class>/ is read with dataset='image_folder'."
    return _load_cifar(CIFAR10, "CIFAR-10", "cifar-10-batches-py", files, root, download, hint, cache)


def load_cifar100(root: str | os.PathLike, download: bool = False,
                  cache: str | os.PathLike | bool | None = None) -> Split:
    """CIFAR-100 (100 fine labels) through ``torchvision.datasets.CIFAR100``: ``root/cifar-100-python/``.

    ``cache``: where the decoded arrays are cached (see :mod:`.cache`; False: not cached).
    """
    from torchvision.datasets import CIFAR100

    return _load_cifar(CIFAR100, "CIFAR-100", "cifar-100-python", ["train", "test", "meta"], root, download,
                       cache=cache)


def load_svhn(root: str | os.PathLike, download: bool = False,
              cache: str | os.PathLike | bool | None = None) -> Split:
    """SVHN (cropped digits, label 10 read as 0) through ``torchvision.datasets.SVHN``:
    ``root/train_32x32.mat`` and ``root/test_32x32.mat``. ``cache``: where the decoded arrays are cached
    (see :mod:`.cache`; False: not cached)."""
    from torchvision.datasets import SVHN

    root = Path(root).expanduser()
    files = ["train_32x32.mat", "test_32x32.mat"]
    layout = f"{root}/{{{','.join(files)}}} (the official .mat files, torchvision's layout)"
    _require_files("SVHN", root, files, layout, download)
    classes = [str(c) for c in range(10)]

    def part(split: str) -> ImageData:
        _, file, md5 = SVHN.split_list[split]
        ds = _torchvision_call("SVHN", root, layout, lambda: SVHN(str(root), split=split, download=download),
                               [(root / file, md5)], download)
        return ImageData(torch.from_numpy(np.ascontiguousarray(ds.data)), _labels(ds.labels), classes)

    return _cached_split("svhn", root, [root / f for f in files], lambda: Split(part("train"), part("test")), cache)


def load_image_folder(root: str | os.PathLike, image_size: int | None = None,
                      cache: str | os.PathLike | bool | None = None) -> Split:
    """``root/train/<class>/*`` and ``root/test/<class>/*`` (torchvision ImageFolder conventions).

    Classes are the sorted sub-folder names and must be the same in both halves; images are
    decoded once as RGB, resized to ``image_size`` when given. The offline CIFAR-10 copy
    unpacks to such a folder (``cifar10-jpg``). ``cache``: where the decoded images are cached (see
    :mod:`.cache`; False: decoded on every load).
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS

    check_image_size(image_size)
    root = Path(root).expanduser()
    layout = f"{root}/train/<class>/<image> and {root}/test/<class>/<image> (ImageFolder layout)"
    if not root.is_dir():
        problem = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"image folder not found: {root} {problem}. Expected layout: {layout}")
    for half in ("train", "test"):
        if not (root / half).is_dir():
            raise FileNotFoundError(f"image folder not found: {root / half} is missing. Expected layout: {layout}")
    halves = {half: sorted(e.name for e in os.scandir(root / half) if e.is_dir()) for half in ("train", "test")}
    for half, names in halves.items():
        if not names:
            raise FileNotFoundError(f"no class folders in {root / half}: images must sit in one sub-folder per class. "
                                    f"Expected layout: {layout}")
    classes = halves["train"]
    if halves["test"] != classes:
        only_train = sorted(set(classes) - set(halves["test"]))
        only_test = sorted(set(halves["test"]) - set(classes))
        raise ValueError(
            f"class folders differ between {root / 'train'} and {root / 'test'}: only in train {only_train}, "
            f"only in test {only_test}; every class needs a folder with images in both train/ and test/"
        )
    class_to_idx = {c: i for i, c in enumerate(classes)}

    def listing(half: str) -> list[tuple[str, int]]:
        samples: list[tuple[str, int]] = []
        for c in classes:  # one class at a time: an empty class folder is named here
            # torchvision's make_dataset order, each real folder walked once (a link loop would never end)
            files = regular_files(root / half / c, IMG_EXTENSIONS)
            if not files:
                raise FileNotFoundError(
                    f"class folder {root / half / c} holds no images "
                    f"(allowed extensions: {', '.join(IMG_EXTENSIONS)}); "
                    f"every class needs images in both train/ and test/"
                )
            samples += [(path, class_to_idx[c]) for path in files]
        return samples

    halves = {"train": listing("train"), "test": listing("test")}
    images = _cached_decode("image_folder", root, {h: [p for p, _ in s] for h, s in halves.items()}, image_size, cache)
    return Split(*(ImageData(images[h], _labels([c for _, c in s]), list(classes)) for h, s in halves.items()))


_TINY_EXTENSIONS = (".jpeg", ".jpg", ".png")


def load_tiny_imagenet(root: str | os.PathLike, image_size: int | None = None,
                       cache: str | os.PathLike | bool | None = None) -> Split:
    """Tiny-ImageNet-200 in its official layout; the test split is the official validation set.

    ``root`` is the ``tiny-imagenet-200`` folder (or its parent): ``wnids.txt``,
    ``train/<wnid>/images/*.JPEG``, ``val/images/*.JPEG`` and ``val/val_annotations.txt``
    (``<file>\\t<wnid>\\t...``). Classes are the sorted wnids; grayscale images become RGB.
    ``cache``: where the decoded images are cached (see :mod:`.cache`; False: decoded on every load).
    """
    check_image_size(image_size)
    base = _find_base(root, "wnids.txt", "tiny-imagenet-200")
    layout = (
        "tiny-imagenet-200/{wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG, "
        "val/val_annotations.txt}"
    )
    if base is None:
        raise FileNotFoundError(
            f"Tiny-ImageNet not found under {Path(root).expanduser()}: no wnids.txt there or in its "
            f"tiny-imagenet-200/ sub-folder. Expected layout: {layout}"
        )
    listed: dict[str, int] = {}
    for lineno, line in enumerate(_read_text(base / "wnids.txt").splitlines(), 1):
        wnid = line.strip()
        if wnid and listed.setdefault(wnid, lineno) != lineno:
            raise ValueError(f"{base / 'wnids.txt'}:{lineno}: the class {wnid!r} is listed again (first on line "
                             f"{listed[wnid]}); every wnid must appear once")
    wnids = sorted(listed)
    if not wnids:
        raise ValueError(f"{base / 'wnids.txt'} lists no classes")
    class_to_idx = {w: i for i, w in enumerate(wnids)}
    if (base / "train").is_dir():
        unlisted = sorted(e.name for e in os.scandir(base / "train") if e.is_dir() and e.name not in class_to_idx)
        if unlisted:
            raise ValueError(f"{base / 'train'} holds {len(unlisted)} class folder(s) not listed in "
                             f"{base / 'wnids.txt'} (first: {unlisted[0]}); add them to wnids.txt or remove them")

    train_paths, train_labels = [], []
    for wnid in wnids:
        folder = base / "train" / wnid / "images"
        if not folder.is_dir():
            raise FileNotFoundError(f"Tiny-ImageNet class folder missing: {folder}. Expected layout: {layout}")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in _TINY_EXTENSIONS)
        if not files:
            raise FileNotFoundError(f"Tiny-ImageNet class folder {folder} holds no images (.JPEG); every class in "
                                    f"{base / 'wnids.txt'} needs training images. Expected layout: {layout}")
        train_paths += files
        train_labels += [class_to_idx[wnid]] * len(files)

    annotations = base / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise FileNotFoundError(f"Tiny-ImageNet validation labels missing: {annotations}. Expected layout: {layout}")
    test_paths, test_labels, seen = [], [], {}
    for lineno, line in enumerate(_read_text(annotations).splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in class_to_idx:
            raise ValueError(f"{annotations}:{lineno}: expected '<file>\\t<wnid in wnids.txt>\\t...', got {line!r}")
        if fields[0] in ("", ".", "..") or "/" in fields[0] or os.sep in fields[0]:
            raise ValueError(f"{annotations}:{lineno}: expected the name of a file in {base / 'val' / 'images'}, "
                             f"got {fields[0]!r}")
        if seen.setdefault(fields[0], lineno) != lineno:
            raise ValueError(f"{annotations}:{lineno}: {fields[0]} is listed again (first on line {seen[fields[0]]}); "
                             "every validation image must appear once")
        test_paths.append(base / "val" / "images" / fields[0])
        test_labels.append(class_to_idx[fields[1]])
    if not test_paths:
        raise ValueError(f"{annotations} lists no validation images; expected one line '<file>\\t<wnid>\\t...' per "
                         f"image in {base / 'val' / 'images'}")
    if (base / "val" / "images").is_dir():
        unlabelled = sorted(e.name for e in os.scandir(base / "val" / "images")
                            if os.path.splitext(e.name)[1].lower() in _TINY_EXTENSIONS and e.name not in seen)
        if unlabelled:
            raise ValueError(f"{annotations} gives no label for {len(unlabelled)} image(s) in "
                             f"{base / 'val' / 'images'} (first: {unlabelled[0]}): the file is truncated or not the "
                             "official one")

    images = _cached_decode("tiny_imagenet", base, {"train": train_paths, "test": test_paths}, image_size, cache)
    return Split(
        ImageData(images["train"], _labels(train_labels), wnids),
        ImageData(images["test"], _labels(test_labels), list(wnids)),
    )


_HAM_IMAGE_DIRS = ("images", "HAM10000_images_part_1", "HAM10000_images_part_2")


def load_ham10000(
    root: str | os.PathLike, image_size: int = 64, test_fraction: float = 0.2, seed: int = 0,
    cache: str | os.PathLike | bool | None = None,
) -> Split:
    """HAM10000 skin lesions: ``HAM10000_metadata.csv`` plus ``ISIC_*.jpg`` images.

    Images live in ``images/`` or the official ``HAM10000_images_part_1/`` and ``_part_2/``;
    ``root`` is that folder (or its parent holding ``ham10000/``). Labels follow
    :data:`HAM10000_CLASSES`; images are resized to ``image_size x image_size``; the split is
    stratified by label, ``train_test_split(test_size=test_fraction, random_state=seed)``, per
    image (several images of one lesion may land on both sides, as in the papers' splits).
    ``cache``: where the decoded images are cached (see :mod:`.cache`; False: decoded on every load).
    """
    from sklearn.model_selection import train_test_split

    check_image_size(image_size)
    if not (is_number(test_fraction) and 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction!r}")
    check_int("seed", seed, 0, MAX_SEED)  # scikit-learn's random_state
    base = _find_base(root, "HAM10000_metadata.csv", "ham10000")
    layout = "HAM10000_metadata.csv (lesion_id,image_id,dx,...) and images/ISIC_*.jpg or HAM10000_images_part_{1,2}/"
    if base is None:
        raise FileNotFoundError(
            f"HAM10000 not found under {Path(root).expanduser()}: no HAM10000_metadata.csv there or in its "
            f"ham10000/ sub-folder. Expected layout: {layout}"
        )
    metadata = base / "HAM10000_metadata.csv"
    reader = csv.DictReader(io.StringIO(_read_text(metadata), newline=""))
    if reader.fieldnames is None:
        raise ValueError(f"{metadata} is empty; expected a header line with the columns image_id and dx. "
                         f"Expected layout: {layout}")
    missing = {"image_id", "dx"} - set(reader.fieldnames)
    if missing:
        raise ValueError(f"{metadata} lacks the column(s) {sorted(missing)}; found {reader.fieldnames}")
    rows = [((r["image_id"] or "").strip(), (r["dx"] or "").strip()) for r in reader]
    if not rows:
        raise ValueError(f"{metadata} lists no images (a header line only). Expected layout: {layout}")
    class_to_idx = {c: i for i, c in enumerate(HAM10000_CLASSES)}
    unknown = sorted({dx for _, dx in rows} - set(class_to_idx))
    if unknown:
        raise ValueError(f"{metadata}: unknown dx value(s) {unknown}; allowed {list(HAM10000_CLASSES)}")
    row_of: dict[str, int] = {}
    for row, (image_id, _) in enumerate(rows, 1):  # row 1: the first line after the header
        if not image_id:
            raise ValueError(f"{metadata}: data row {row} has an empty image_id; expected e.g. ISIC_0024306")
        if row_of.setdefault(image_id, row) != row:
            raise ValueError(f"{metadata}: image_id {image_id} is listed again in data row {row} (first in data row "
                             f"{row_of[image_id]}); every image must appear once")

    located: dict[str, str] = {}
    for sub in _HAM_IMAGE_DIRS:
        if (base / sub).is_dir():
            for entry in sorted(os.scandir(base / sub), key=lambda e: e.name):
                stem, ext = os.path.splitext(entry.name)
                if ext.lower() in (".jpg", ".jpeg", ".png"):
                    if stem in located:  # which of the two is the image would depend on the folders' order
                        raise ValueError(f"HAM10000: image {stem} is both {located[stem]} and {entry.path}; keep one "
                                         "(in images/ or in the official HAM10000_images_part_{1,2}/)")
                    located[stem] = entry.path
    absent = [image_id for image_id, _ in rows if image_id not in located]
    if absent:
        raise FileNotFoundError(
            f"HAM10000: {len(absent)} image(s) listed in {metadata} not found in "
            f"{', '.join(str(base / s) for s in _HAM_IMAGE_DIRS)} (first: {absent[0]}.jpg)"
        )
    unlisted = sorted(set(located) - set(row_of))
    if unlisted:
        raise ValueError(f"{metadata} gives no dx for {len(unlisted)} image(s) (first: {located[unlisted[0]]}): the "
                         "file is truncated or not the official one, or the image does not belong to the data set")
    labels = np.array([class_to_idx[dx] for _, dx in rows], dtype=np.int64)
    counts = np.bincount(labels, minlength=len(HAM10000_CLASSES))
    lonely = [HAM10000_CLASSES[c] for c in np.flatnonzero(counts == 1)]
    if lonely:
        raise ValueError(f"{metadata}: class(es) {lonely} have a single image; the split by class needs at least 2 "
                         "images of every class present (one for train, one for test)")
    try:
        train_idx, test_idx = train_test_split(
            np.arange(len(labels)), test_size=test_fraction, random_state=seed, stratify=labels
        )
    except ValueError as err:  # too few images for test_fraction to hold every class on both sides
        raise ValueError(
            f"cannot split the {len(labels)} images of {metadata} ({int((counts > 0).sum())} classes) by class with "
            f"test_fraction={test_fraction}: {err}"
        ) from err
    images = _cached_decode("ham10000", base, {"images": [located[image_id] for image_id, _ in rows]}, image_size,
                            cache)["images"]
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    classes = list(HAM10000_CLASSES)
    return Split(
        ImageData(images[torch.from_numpy(train_idx)], _labels(labels[train_idx]), classes),
        ImageData(images[torch.from_numpy(test_idx)], _labels(labels[test_idx]), list(classes)),
    )
