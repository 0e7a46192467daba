"""The federated data module: a data set split over clients, with personal test sets.

Protocol (DisPFL App. B.1, DA-DPFL Sec. VI-A): the official training split is partitioned over
``num_clients`` clients (Dirichlet, pathological, ExDir, IID, or PRISAM's cluster partition:
clients in groups, label skew between groups, IID within); each client's test set holds
``test_samples_per_client`` samples of the official test split drawn with the client's
training label proportions. Clients read mini-batches straight from tensors decoded once: a
client's images are normalised once per :meth:`~FederatedDataModule.client_train_batches`
call, and augmentation runs on whole batches, seeded by a caller's generator. The
normalisation is per data set: the per-channel mean and std of its training split (for
CIFAR-10 and MNIST these are the usual published constants).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_dfl.checks import check_int, check_output_path, check_positive, is_int
from lightning_dfl.seeding import MAX_SEED, derive_seed
from lightning_dfl.transfers import to_device

from .datasets import DATASETS, EMBEDDED, load_dataset, smallest_input
from .images import ImageData, Split
from .partition import (
    PARTITIONERS,
    ClusterPartitioner,
    allocate_counts,
    build_partitioner,
    personal_test_indices,
)
from .transforms import BatchAugment, Normalize

__all__ = ["FederatedDataModule", "TensorBatches"]

#: Data sets trained without augmentation by default (the rest get crop padding 4 + flip).
NO_AUGMENT_BY_DEFAULT = frozenset({"digits", "mnist"})
#: Torchvision data sets that ``download=True`` can fetch.
DOWNLOADABLE = frozenset({"mnist", "cifar10", "cifar100", "svhn"})
_TEST_STREAM = 1  # seed-sequence key of the personal-test-set draws


class TensorBatches:
    """Re-iterable mini-batches ``(x float [B, C, H, W], y int64 [B])`` over in-memory images.

    ``len()`` is the number of batches (the last partial batch is kept). With ``shuffle`` each
    pass draws a fresh permutation from ``generator`` (then the augmentation draws, batch by
    batch), so consecutive passes are consecutive epochs.

    The images are normalised once, here (and padded for the random crop with the normalised
    value of a zero pixel), so a batch costs one gather: crop and flip move pixels and the
    normalisation is per pixel, so every batch equals ``normalize(augment(images[idx]))``. The
    price is a float copy of the images (padded) for the object's lifetime. Unshuffled,
    unaugmented batches are views of that copy: read them, do not modify them in place.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        batch_size: int,
        normalize: Normalize,
        augment: BatchAugment | None = None,
        generator: torch.Generator | None = None,
        shuffle: bool = False,
    ) -> None:
        if (shuffle or (augment is not None and augment.enabled)) and not isinstance(generator, torch.Generator):
            raise TypeError(f"shuffling or augmenting needs a torch.Generator, got {type(generator).__name__}")
        self.labels = labels
        self.batch_size = batch_size
        self.normalize = normalize
        self.augment = augment if augment is not None and augment.enabled else None
        self.generator = generator
        self.shuffle = shuffle
        source = normalize(images)
        if self.augment is not None:
            zero = torch.zeros((1, images.shape[1], 1, 1), dtype=images.dtype, device=images.device)
            source = self.augment.pad(source, fill=normalize(zero)[0])
        self.source = source

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n, size, device = self.num_samples, self.batch_size, self.source.device
        order = None
        if self.shuffle:
            gen = self.generator
            order = to_device(torch.randperm(n, generator=gen, device=gen.device), device)
        elif self.augment is not None:
            order = torch.arange(n, device=device)
        for start in range(0, n, size):
            if order is None:
                yield self.source[start : start + size], self.labels[start : start + size]
                continue
            idx = order[start : start + size]
            if self.augment is not None:
                x = self.augment.crop_flip(self.source, idx, self.generator)
            else:
                x = self.source.index_select(0, idx)
            yield x, self.labels.index_select(0, idx)


class _SplitDataset(Dataset):
    """Map-style view of one split; ``__getitems__`` returns a whole stacked batch at once."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return self.images.index_select(0, idx), self.labels.index_select(0, idx)


class _BatchCollate:
    """DataLoader ``collate_fn``: augment (with its own seeded generator) and normalise a batch."""

    def __init__(self, normalize: Normalize, augment: BatchAugment | None = None, seed: int = 0) -> None:
        self.normalize = normalize
        self.augment = augment if augment is not None and augment.enabled else None
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s augmentations from a generator of their own (``(seed, epoch)``)."""
        self.generator = torch.Generator().manual_seed(derive_seed(self.seed, "augment", epoch))

    def __call__(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch  # a whole batch: _SplitDataset.__getitems__
        if self.augment is not None:
            x = self.augment(x, self.generator)
        return self.normalize(x), y


class _EpochShuffle(RandomSampler):
    """A shuffle drawn afresh each epoch from ``(seed, epoch)`` (Lightning calls :meth:`set_epoch` before every
    epoch), so that an epoch's order and augmentations do not depend on the epochs before it: a fit resumed from
    a checkpoint, or one whose loaders are built again each epoch, sees the orders of an uninterrupted one.
    Under DDP Lightning replaces it with its ``DistributedSampler`` (a ``RandomSampler``: shuffled), as before."""

    def __init__(self, data: Dataset, seed: int, collate: _BatchCollate) -> None:
        super().__init__(data, generator=torch.Generator())
        self.seed, self.collate = seed, collate
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(derive_seed(self.seed, "shuffle", epoch))
        self.collate.set_epoch(epoch)


class FederatedDataModule(L.LightningDataModule):
    """A data set partitioned over clients, each with a personal test set (DisPFL App. B.1).

    Args:
        dataset: one of :data:`~lightning_dfl.datamodules.datasets.DATASETS`.
        root: data root (default ``$LIGHTNING_DFL_DATA`` or ``~/.cache/lightning-dfl``).
        num_clients: number of clients K.
        partition: one of :data:`~lightning_dfl.datamodules.partition.PARTITIONERS`.
        alpha: Dirichlet concentration (``partition="dirichlet"``, ``"dirichlet_equal"`` or ``"exdir"``; with
            ``"cluster"`` and ``between="dirichlet"``, over the groups; PRISAM: 0.2 or 1).
        classes_per_client: classes per client (``partition="pathological"``; at most, ``"exdir"``).
        num_groups: number of client groups k (``partition="cluster"``, where it is required; PRISAM: 5).
            Client c is in group ``c * k // num_clients`` (contiguous blocks); see :attr:`client_groups`.
        between: how ``partition="cluster"`` splits the classes between groups: ``"dirichlet"`` (per class,
            ``Dir(alpha)`` over the groups) or ``"pathological"`` (``classes_per_group`` disjoint classes per group).
        classes_per_group: classes per group (``partition="cluster"`` with ``between="pathological"``).
        min_size: least training samples per client (``partition="dirichlet"`` or ``"exdir"``).
        test_samples_per_client: each client's personal test set size, 1 to the test split's (DisPFL: 100).
        batch_size: training batch size (DisPFL: 128).
        eval_batch_size: evaluation batch size.
        augment: random crop (padding 4) + horizontal flip; ``None``: on except for digits/mnist.
        image_size: resize images to ``image_size x image_size`` (``None``: the data set's size).
        seed: seeds the partition and the personal test sets (0 to 2**32 - 1).
        download: let torchvision download mnist/cifar10/cifar100/svhn (needs network access).
        cache: where the decoded data set is cached on disk, keyed by its source files' names, sizes and times
            (``None``: ``$LIGHTNING_DFL_CACHE`` or ``~/.cache/lightning-dfl/decoded``; ``false``: no cache; a
            folder). Not part of the run's identity: resuming with another cache is the same run.
        max_train_samples: if set, a stratified, seeded subset of this many training samples is
            partitioned instead of the whole training split (quick runs on large data sets); at least
            ``num_clients`` and the number of classes, at most the split's size.
    """

    def __init__(
        self,
        dataset: str = "digits",
        root: str | None = None,
        num_clients: int = 10,
        partition: str = "dirichlet",
        alpha: float = 0.3,
        classes_per_client: int = 2,
        min_size: int = 10,
        test_samples_per_client: int = 100,
        batch_size: int = 128,
        eval_batch_size: int = 512,
        augment: bool | None = None,
        image_size: int | None = None,
        seed: int = 0,
        download: bool = False,
        max_train_samples: int | None = None,
        num_groups: int | None = None,
        between: str = "dirichlet",
        classes_per_group: int = 2,
        cache: bool | str | None = None,
    ) -> None:
        super().__init__()
        DATASETS.get(dataset)  # an unknown name raises ValueError listing the allowed ones
        partitioner_class = PARTITIONERS.get(partition)
        if root is not None and not isinstance(root, (str, Path)):
            raise ValueError(f"root must be a path or None, got {root!r}")
        if root is not None and dataset in EMBEDDED:
            raise ValueError(f"root={str(root)!r} is not read: the data set {dataset!r} ships with its package and "
                             "reads no files; remove data.root (or choose a data set that reads it, e.g. image_folder)")
        check_int("num_clients", num_clients, 1)
        check_positive("alpha", alpha)
        check_int("classes_per_client", classes_per_client, 1)
        check_int("min_size", min_size, 0)
        if num_groups is not None:
            check_int("num_groups", num_groups, 1)
            if partition != "cluster":  # else the groups asked for would silently not exist
                raise ValueError(f"num_groups={num_groups} is read by partition='cluster' only, got partition="
                                 f"{partition!r}: set --data.partition=cluster, or remove num_groups")
            if is_int(num_clients) and num_groups > num_clients:
                raise ValueError(f"num_groups={num_groups} exceeds num_clients={num_clients}: every group needs a "
                                 f"client; use at most {num_clients} groups")
        elif partition == "cluster":
            raise ValueError("partition='cluster' needs num_groups (the number of client groups k, an integer >= 1; "
                             "PRISAM: 5), got None")
        if between not in ClusterPartitioner.BETWEEN:
            raise ValueError(f"between must be one of {', '.join(repr(b) for b in ClusterPartitioner.BETWEEN)} (how "
                             f"partition='cluster' splits classes between groups), got {between!r}")
        check_int("classes_per_group", classes_per_group, 1)
        if not (is_int(test_samples_per_client) and test_samples_per_client >= 1):
            raise ValueError(
                f"test_samples_per_client must be an integer >= 1 (each client's accuracy, the run's headline "
                f"number, is measured on its personal test set), got {test_samples_per_client!r}"
            )
        check_int("batch_size", batch_size, 1)
        check_int("eval_batch_size", eval_batch_size, 1)
        if augment is not None and not isinstance(augment, bool):
            raise ValueError(f"augment must be True, False or None, got {augment!r}")
        if image_size is not None:
            check_int("image_size", image_size, 1)
        check_int("seed", seed, 0, MAX_SEED)
        if not isinstance(download, bool):
            raise ValueError(f"download must be a bool, got {download!r}")
        if download and dataset not in DOWNLOADABLE:
            raise ValueError(
                f"download=True is only supported for {', '.join(sorted(DOWNLOADABLE))}, not {dataset!r}"
            )
        if cache is not None and not isinstance(cache, (bool, str, Path)):
            raise ValueError(f"cache must be a folder, true/null (the default folder) or false (off), got {cache!r}")
        if isinstance(cache, (str, Path)):
            check_output_path("cache (a folder, true/null: the default one, false: off)", cache)
        self.save_hyperparameters(ignore=["cache"])  # where decoded data is cached does not change the run
        self.cache = cache
        self.dataset, self.root, self.num_clients = dataset, root, num_clients
        self.partition, self.alpha, self.classes_per_client = partition, float(alpha), classes_per_client
        self.min_size, self.test_samples_per_client = min_size, test_samples_per_client
        self.num_groups, self.between, self.classes_per_group = num_groups, between, classes_per_group
        if max_train_samples is not None and not (is_int(max_train_samples) and max_train_samples >= num_clients):
            raise ValueError(
                f"max_train_samples must be None (the whole training split) or an integer >= num_clients={num_clients} "
                f"(a sample per client at least), got {max_train_samples!r}"
            )
        self.max_train_samples = max_train_samples
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.augment = dataset not in NO_AUGMENT_BY_DEFAULT if augment is None else augment
        self.image_size_override, self.seed, self.download = image_size, seed, download
        self.batch_augment = BatchAugment(random_crop_padding=4 if self.augment else 0, horizontal_flip=self.augment)
        options = {"alpha": self.alpha, "classes_per_client": classes_per_client, "min_size": min_size,
                   "num_groups": num_groups, "between": between, "classes_per_group": classes_per_group}
        accepted = inspect.signature(partitioner_class).parameters
        self.partitioner = build_partitioner(partition, **{k: v for k, v in options.items() if k in accepted})
        self._split: Split | None = None
        self._downloaded = False

    # ------------------------------------------------------------------ setup

    def prepare_data(self) -> None:
        """With ``download=True``, fetch the torchvision data set once (Lightning calls this on one process)."""
        if self.download and not self._downloaded:
            load_dataset(self.dataset, self.root, download=True, cache=self.cache)
            self._downloaded = True

    def smallest_input(self) -> tuple[int, int] | None:
        """The channels and image size the model will get, at their least, known before :meth:`setup` loads the
        data (:func:`~lightning_dfl.datamodules.datasets.smallest_input`); ``None`` where the files decide."""
        return smallest_input(self.dataset, self.image_size_override)

    def setup(self, stage: str | None = None) -> None:
        """Load the data once, partition it, draw the personal test sets (idempotent)."""
        if self._split is not None:
            return
        kwargs: dict[str, Any] = {"download": self.download and not self._downloaded, "cache": self.cache}
        if self.image_size_override is not None:
            kwargs["image_size"] = self.image_size_override
        split = load_dataset(self.dataset, self.root, **kwargs)
        if self.max_train_samples is not None:
            self._check_max_train_samples(split.train)
            if self.max_train_samples < len(split.train):
                split = Split(train=self._stratified_subset(split.train), test=split.test)
        if hasattr(self.partitioner, "classes_per_client") and self.classes_per_client > split.num_classes:
            raise ValueError(
                f"classes_per_client={self.classes_per_client} exceeds the {split.num_classes} classes of "
                f"dataset {self.dataset!r}"
            )
        train_labels = split.train.labels.numpy()
        test_labels = split.test.labels.numpy()
        if self.test_samples_per_client > len(test_labels):  # no client could get them: refused, not cut short
            raise ValueError(
                f"test_samples_per_client={self.test_samples_per_client} exceeds the {len(test_labels)} samples of "
                f"the test split of dataset {self.dataset!r}; allowed: an integer from 1 to {len(test_labels)}"
            )
        parts = self.partitioner(train_labels, self.num_clients, self.seed)
        empty = [k for k, p in enumerate(parts) if len(p) == 0]
        if empty:  # a client without data can neither train nor be tested
            hint = "raise min_size to >= 1 or use fewer clients" if hasattr(self.partitioner, "min_size") else (
                f"use fewer clients (at most {len(train_labels)}, the number of training samples)")
            raise ValueError(
                f"{len(empty)} of {self.num_clients} clients (first: client {empty[0]}) received no training samples "
                f"from {self.partitioner!r} on dataset {self.dataset!r}; {hint}"
            )
        counts = [np.bincount(train_labels[p], minlength=split.num_classes) for p in parts]
        tests = [
            personal_test_indices(
                c, test_labels, self.test_samples_per_client, np.random.default_rng([self.seed, _TEST_STREAM, k])
            )
            for k, c in enumerate(counts)
        ]
        untested = [k for k, t in enumerate(tests) if len(t) == 0]
        if untested:  # its accuracy (and with it the run's headline number) could not be measured
            k = untested[0]
            held = [split.classes[c] for c in np.flatnonzero(counts[k])]
            raise ValueError(
                f"{len(untested)} of {self.num_clients} clients (first: client {k}) would get an empty personal test "
                f"set: the test split of dataset {self.dataset!r} ({len(test_labels)} samples) holds no samples of "
                f"their classes (client {k}: {held}); add test samples of these classes or change the partition"
            )
        self._warn_if_skewed(counts, tests, test_labels, split)
        self._train_parts = [torch.from_numpy(p) for p in parts]
        self._test_parts = [torch.from_numpy(t) for t in tests]
        self._label_counts = counts
        self.normalizer = Normalize.from_images(split.train.images)
        self._split = split

    def _check_max_train_samples(self, data: ImageData) -> None:
        """``max_train_samples`` must lie between the number of classes present and the split's size."""
        n, present = len(data), len(np.unique(data.labels.numpy()))
        low = max(present, self.num_clients)
        allowed = f"allowed: an integer from {low} to {n}, or None for the whole split"
        if self.max_train_samples > n:
            raise ValueError(f"max_train_samples={self.max_train_samples} exceeds the {n} training samples of dataset "
                             f"{self.dataset!r}; {allowed}")
        if self.max_train_samples < present:
            raise ValueError(f"max_train_samples={self.max_train_samples} is fewer than the {present} classes of "
                             f"dataset {self.dataset!r}: a stratified subset needs a sample of every class; {allowed}")

    def _stratified_subset(self, data: ImageData) -> ImageData:
        """``max_train_samples`` samples with the training split's class proportions (seeded)."""
        from sklearn.model_selection import train_test_split

        labels = data.labels.numpy()
        try:
            keep, _ = train_test_split(np.arange(len(labels)), train_size=self.max_train_samples,
                                       stratify=labels, random_state=self.seed)
        except ValueError as err:  # e.g. fewer left-out samples than classes, or a class with one sample
            raise ValueError(
                f"max_train_samples={self.max_train_samples} cannot be drawn stratified from the {len(labels)} "
                f"training samples of dataset {self.dataset!r} (scikit-learn: {err}); choose a smaller value, "
                f"{len(labels)} or None"
            ) from err
        idx = torch.from_numpy(np.sort(keep))
        return ImageData(data.images.index_select(0, idx), data.labels.index_select(0, idx), data.classes)

    def _warn_if_skewed(self, counts, tests, test_labels, split: Split) -> None:
        """Warn when the test split holds too few samples of a class to follow a client's proportions."""
        short = []
        for k, (c, t) in enumerate(zip(counts, tests)):
            if c.sum() == 0:
                continue
            wanted = allocate_counts(c, self.test_samples_per_client)
            got = np.bincount(test_labels[t], minlength=split.num_classes)
            if (wanted != got).any():
                worst = int(np.argmax(wanted - got))
                short.append(f"client {k} wanted {wanted[worst]} of class {split.classes[worst]!r}, got {got[worst]}")
        if short:
            warnings.warn(
                f"{len(short)} of {self.num_clients} personal test sets deviate from their training label "
                f"proportions because the test split of {self.dataset!r} holds too few samples of some classes "
                f"(the shortfall went to the client's other classes; a client of one class gets fewer test samples); "
                f"e.g. {short[0]}. Lower "
                f"test_samples_per_client={self.test_samples_per_client} to avoid this.",
                stacklevel=3,
            )

    def _ready(self) -> Split:
        if self._split is None:
            self.setup()
        assert self._split is not None
        return self._split

    def _client(self, k: int) -> int:
        if not is_int(k) or not 0 <= k < self.num_clients:
            raise IndexError(f"client index must be in [0, {self.num_clients}), got {k!r}")
        return int(k)

    # ------------------------------------------------------------------ properties

    @property
    def split(self) -> Split:
        """The loaded :class:`~lightning_dfl.datamodules.images.Split` (loads on first use)."""
        return self._ready()

    @property
    def classes(self) -> list[str]:
        return list(self._ready().classes)

    @property
    def num_classes(self) -> int:
        return self._ready().num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self._ready().input_shape

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    @property
    def image_size(self) -> int:
        """Image height H."""
        return self.input_shape[1]

    @property
    def client_groups(self) -> tuple[int, ...] | None:
        """The true group of each client for a partition with groups (``partition="cluster"``), else ``None``.

        Fixed by ``num_clients`` and ``num_groups`` alone (client c: ``c * num_groups // num_clients``); needs no setup.
        """
        groups = getattr(self.partitioner, "groups", None)
        return None if groups is None else tuple(int(g) for g in groups(self.num_clients))

    # ------------------------------------------------------------------ per client

    def client_train_indices(self, k: int) -> np.ndarray:
        """Sorted indices of client ``k``'s samples in the training split."""
        self._ready()
        return self._train_parts[self._client(k)].numpy().copy()

    def client_test_indices(self, k: int) -> np.ndarray:
        """Sorted indices of client ``k``'s personal test samples in the test split."""
        self._ready()
        return self._test_parts[self._client(k)].numpy().copy()

    def client_train_size(self, k: int) -> int:
        self._ready()
        return int(self._train_parts[self._client(k)].numel())

    def client_test_size(self, k: int) -> int:
        self._ready()
        return int(self._test_parts[self._client(k)].numel())

    def client_label_counts(self, k: int) -> np.ndarray:
        """Training samples of client ``k`` per class, shape ``[num_classes]``."""
        self._ready()
        return self._label_counts[self._client(k)].copy()

    def client_test_label_counts(self, k: int) -> np.ndarray:
        """Personal test samples of client ``k`` per class, shape ``[num_classes]``."""
        split = self._ready()
        return np.bincount(split.test.labels.numpy()[self.client_test_indices(k)], minlength=split.num_classes)

    def client_train_batches(
        self, k: int, generator: torch.Generator, device: torch.device | str | None = None
    ) -> TensorBatches:
        """Client ``k``'s training batches: shuffled by ``generator``, augmented, normalised.

        The client's images are copied to ``device`` (default: CPU) and normalised there once,
        when this is called (see :class:`TensorBatches`); batches are cut there, the random
        draws come from ``generator`` wherever it lives.
        """
        split = self._ready()
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        idx = self._train_parts[self._client(k)]
        return TensorBatches(
            to_device(split.train.images.index_select(0, idx), device),
            to_device(split.train.labels.index_select(0, idx), device),
            self.batch_size,
            self.normalizer,
            augment=self.batch_augment,
            generator=generator,
            shuffle=True,
        )

    def client_test_batches(self, k: int, device: torch.device | str | None = None) -> TensorBatches:
        """Client ``k``'s personal test set in a fixed order, normalised, not augmented."""
        split = self._ready()
        idx = self._test_parts[self._client(k)]
        return TensorBatches(
            to_device(split.test.images.index_select(0, idx), device),
            to_device(split.test.labels.index_select(0, idx), device),
            self.eval_batch_size,
            self.normalizer,
        )

    # ------------------------------------------------------------------ Lightning hooks

    def train_dataloader(self) -> DataLoader:
        """All training samples, shuffled and augmented anew each epoch from (seed, epoch) (a plain, centralised
        Trainer: an epoch does not depend on the ones before, so a resumed fit sees what an uninterrupted one does)."""
        split = self._ready()
        data = _SplitDataset(split.train.images, split.train.labels)
        collate = _BatchCollate(self.normalizer, self.batch_augment, seed=self.seed)
        return DataLoader(data, batch_size=self.batch_size, sampler=_EpochShuffle(data, self.seed, collate),
                          collate_fn=collate)

    def _eval_dataloader(self) -> DataLoader:
        split = self._ready()
        return DataLoader(
            _SplitDataset(split.test.images, split.test.labels),
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=_BatchCollate(self.normalizer),
        )

    def val_dataloader(self) -> DataLoader:
        """The official test split (the papers keep no separate validation split)."""
        return self._eval_dataloader()

    def test_dataloader(self) -> DataLoader:
        """The official test split."""
        return self._eval_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The official test split, in order (``trainer.predict(model, data)``: the logits of each batch)."""
        return self._eval_dataloader()

    # ------------------------------------------------------------------ checkpoints

    def _identity(self) -> dict[str, Any]:
        keys = ("dataset", "num_clients", "partition", "alpha", "classes_per_client", "min_size",
                "test_samples_per_client", "image_size", "seed", "max_train_samples")
        if self.hparams["partition"] == "cluster":  # other partitions' checkpoints stay as they were
            keys += ("num_groups", "between", "classes_per_group")
        return {key: self.hparams[key] for key in keys}

    def state_dict(self) -> dict[str, Any]:
        """The hyper-parameters that fix the partition and the test sets (both are re-derived)."""
        return self._identity()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that a checkpoint's partition matches this module's; raise if it does not."""
        mine = self._identity()
        differ = {k: (v, mine.get(k)) for k, v in state_dict.items() if k in mine and mine[k] != v}
        if differ:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in differ.items())
            raise ValueError(f"checkpoint was made with a different data partition ({detail})")
