"""Data for lightning-dfl: data sets decoded once, client partitions, the federated data module."""

from .datasets import DATASETS, default_data_root, load_dataset
from .federated import FederatedDataModule, TensorBatches
from .images import ImageData, Split, decode_images, resize_images, resize_split
from .partition import (
    PARTITIONERS,
    DirichletPartitioner,
    EqualDirichletPartitioner,
    ExDirPartitioner,
    IIDPartitioner,
    Partitioner,
    PathologicalPartitioner,
    allocate_counts,
    build_partitioner,
    personal_test_indices,
    register_partitioner,
)
from .readers import (
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
from .transforms import BatchAugment, Normalize, channel_stats, to_float

__all__ = [
    "DATASETS",
    "HAM10000_CLASSES",
    "PARTITIONERS",
    "BatchAugment",
    "DirichletPartitioner",
    "EqualDirichletPartitioner",
    "ExDirPartitioner",
    "FederatedDataModule",
    "IIDPartitioner",
    "ImageData",
    "Normalize",
    "PathologicalPartitioner",
    "Partitioner",
    "Split",
    "TensorBatches",
    "allocate_counts",
    "build_partitioner",
    "channel_stats",
    "decode_images",
    "default_data_root",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_ham10000",
    "load_image_folder",
    "load_mnist",
    "load_svhn",
    "load_tiny_imagenet",
    "personal_test_indices",
    "register_partitioner",
    "resize_images",
    "resize_split",
    "to_float",
]
