"""The data sets by name: :data:`DATASETS` (name -> reader) and :func:`load_dataset`.

Every reader (:mod:`.readers`) returns a :class:`~.images.Split` of two :class:`~.images.ImageData` records
(train and test) whose images are one ``uint8`` tensor ``[N, C, H, W]``: decoding happens once, never per
sample at training time. Data sets are read from :func:`default_data_root` unless a root is given.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path

from lightning_dfl.errors import ConfigurationError
from lightning_dfl.registry import Registry

from .images import Split, check_image_size, resize_split
from .readers import (
    load_cifar10,
    load_cifar100,
    load_digits,
    load_ham10000,
    load_image_folder,
    load_mnist,
    load_svhn,
    load_tiny_imagenet,
)

__all__ = ["DATASETS", "EMBEDDED", "default_data_root", "load_dataset"]


def default_data_root() -> Path:
    """``$LIGHTNING_DFL_DATA`` if set, else ``~/.cache/lightning-dfl``."""
    return Path(os.environ.get("LIGHTNING_DFL_DATA", "~/.cache/lightning-dfl")).expanduser()


#: the data sets that ship with a package and read no files: a ``root`` is refused for them
EMBEDDED = ("digits",)

#: Name -> loader. Every loader takes the data root as its first argument.
DATASETS: Registry[Callable[..., Split]] = Registry("dataset", {
    "digits": load_digits,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "svhn": load_svhn,
    "tiny_imagenet": load_tiny_imagenet,
    "ham10000": load_ham10000,
    "image_folder": load_image_folder,
})


#: Name -> (channels, image size) of what the loader returns without an ``image_size`` (fixed by the official format
#: or the loader's default); the sets of any size (tiny_imagenet's files, image_folder) are not named
INPUTS: dict[str, tuple[int, int]] = {
    "digits": (1, 8), "mnist": (1, 28), "cifar10": (3, 32), "cifar100": (3, 32), "svhn": (3, 32),
    "ham10000": (3, 64),
}


def smallest_input(name: str, image_size: int | None = None) -> tuple[int, int] | None:
    """The channels and image size data set ``name`` gives its model, known before it is loaded, at their least
    (one channel where the set's images may be gray or colour), or ``None`` where the size depends on its files:
    a set-up checks the model against it before loading (a model too large is refused at once, not after the
    data set is decoded)."""
    channels, size = INPUTS.get(name, (1, None))
    size = image_size if image_size is not None else size
    return None if size is None else (channels, size)


def load_dataset(name: str, root: str | os.PathLike | None = None, **kwargs) -> Split:
    """Load data set ``name`` from ``root`` (default :func:`default_data_root`).

    ``kwargs`` go to the loader (e.g. ``download`` for the torchvision sets, ``image_size``, ``cache``).
    An ``image_size`` for a loader without one resizes the loaded split, ``image_size=None``
    keeps the loader's size, and every loader accepts ``download=False``.
    """
    loader = DATASETS.get(name)
    params = inspect.signature(loader).parameters
    if kwargs.get("download") is False and "download" not in params:
        kwargs.pop("download")
    if "cache" in kwargs and "cache" not in params:
        kwargs.pop("cache")  # digits: nothing decoded from files, nothing to cache
    if "image_size" in kwargs and kwargs["image_size"] is None:
        kwargs.pop("image_size")  # None: the loader's own size
    resize_to = None
    if "image_size" in kwargs and "image_size" not in params:
        resize_to = kwargs.pop("image_size")
        check_image_size(resize_to)
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        allowed = [p for p in params if p != "root"]
        raise ConfigurationError(f"dataset {name!r} does not take {unknown}; its options: {allowed}")
    split = loader(default_data_root() if root is None else root, **kwargs)
    return split if resize_to is None else resize_split(split, resize_to)
