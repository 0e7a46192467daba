"""Model builders by name: ``build_model("resnet18", num_classes=10)``.

Every builder takes ``(num_classes, in_channels, image_size)`` plus its own keyword-only
options (``norm``, ``num_groups``, ``dropout``, ``hidden``); see :data:`MODELS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from lightning_dfl.checks import check_int
from lightning_dfl.models.alexnet import alexnet
from lightning_dfl.models.cnn import cnn_cifar, cnn_digits, cnn_ham
from lightning_dfl.models.resnet import resnet18, resnet20
from lightning_dfl.models.vgg import vgg11
from lightning_dfl.registry import Registry

#: name -> builder(num_classes, in_channels, image_size, **options).
MODELS: Registry[Callable[..., nn.Module]] = Registry("model", {
    "resnet18": resnet18,    # DisPFL / DA-DPFL CIFAR-10 (GroupNorm)
    "vgg11": vgg11,          # DisPFL / DA-DPFL CIFAR-100 (GroupNorm); norm="batch" for PRISAM
    "alexnet": alexnet,      # DA-DPFL HAM10000 (64x64)
    "resnet20": resnet20,    # PRISAM SVHN (BatchNorm)
    "cnn_cifar": cnn_cifar,  # PSFL CIFAR-10/100
    "cnn_ham": cnn_ham,      # PSFL HAM10000
    "cnn_digits": cnn_digits,  # the embedded 8x8 digits (the CPU default)
})

__all__ = ["MODELS", "available_models", "build_model", "model_options"]


def available_models() -> list[str]:
    """The names :func:`build_model` accepts, sorted."""
    return sorted(MODELS)


def model_options(name: str) -> dict[str, object]:
    """A builder's keyword-only options and their defaults."""
    builder = MODELS.get(name)
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_model(name: str, num_classes: int, in_channels: int | None = None,
                image_size: int | None = None, **kwargs: object) -> nn.Module:
    """Build model ``name`` for ``num_classes`` classes and square ``image_size`` inputs.

    ``in_channels`` and ``image_size`` default to the model's own setting (3 and 32 for the
    CIFAR models, 3 and 64 for ``alexnet``/``cnn_ham``, 1 and 8 for ``cnn_digits``).
    ``kwargs`` are the builder's options (:func:`model_options`). Raises ``ValueError`` for an
    unknown name or an incompatible size, ``TypeError`` for an option the builder lacks.
    """
    builder = MODELS.get(name)
    num_classes = check_int("num_classes", num_classes, 2)
    params = inspect.signature(builder).parameters
    if in_channels is None:
        in_channels = params["in_channels"].default
    if image_size is None:
        image_size = params["image_size"].default
    in_channels = check_int("in_channels", in_channels, 1)
    image_size = check_int("image_size", image_size, 1)
    options = model_options(name)
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise TypeError(f"model {name!r} has no option(s) {unknown}; its options are {options}")
    return builder(num_classes, in_channels, image_size, **kwargs)
