"""Model builders by name: ``build_model("resnet18", num_classes=10)``.

Every builder takes ``(num_classes, in_channels, image_size)`` plus its own keyword-only
options (``norm``, ``num_groups``, ``dropout``, ``hidden``); see :data:`MODELS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from lightning_dfl.checks import check_int, is_int, is_number
from lightning_dfl.errors import ConfigurationError
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

__all__ = ["MODELS", "available_models", "build_model", "check_model", "model_options"]


def available_models() -> list[str]:
    """The names :func:`build_model` accepts, sorted."""
    return sorted(MODELS)


def model_options(name: str) -> dict[str, object]:
    """A builder's keyword-only options and their defaults."""
    builder = MODELS.get(name)
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def check_model(name: str, num_classes: int, in_channels: int | None = None, image_size: int | None = None,
                **kwargs: object) -> int | None:
    """What :func:`build_model` checks before it builds (the name, the sizes, the options, the parameter count and
    the weights' memory, counted on the meta device), without building: a run calls it before its data is loaded.
    Returns the parameter count (``None`` for a builder that cannot be counted on the meta device)."""
    return _checked(name, num_classes, in_channels, image_size, kwargs)[2]


def _parameter_count(builder: Callable[..., nn.Module], args: tuple, kwargs: dict) -> int | None:
    import torch

    try:
        with torch.device("meta"):
            return sum(p.numel() for p in builder(*args, **kwargs).parameters())
    except Exception:  # a builder that needs real tensors: built as it is (its own errors name the problem)
        return None


def _checked(name: str, num_classes: int, in_channels: int | None, image_size: int | None,
             kwargs: dict[str, object]) -> tuple[Callable[..., nn.Module], tuple[int, int, int], int | None]:
    """The builder, the sizes with their defaults, and the parameter count (:func:`_check_size_of`), checked."""
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
        raise ConfigurationError(f"model {name!r} has no option(s) {unknown}; its options are {options}")
    for option, value in kwargs.items():  # an option takes its default's kind: hidden=1.5 is not a layer width
        default = options[option]
        if is_int(default) and not is_int(value):
            raise ValueError(f"model option {option} of {name!r} must be an integer, got {value!r}")
        if isinstance(default, float) and not is_number(value):
            raise ValueError(f"model option {option} of {name!r} must be a finite number, got {value!r}")
    count = _check_size_of(name, builder, (num_classes, in_channels, image_size), kwargs)
    return builder, (num_classes, in_channels, image_size), count


def build_model(name: str, num_classes: int, in_channels: int | None = None,
                image_size: int | None = None, **kwargs: object) -> nn.Module:
    """Build model ``name`` for ``num_classes`` classes and square ``image_size`` inputs.

    ``in_channels`` and ``image_size`` default to the model's own setting (3 and 32 for the
    CIFAR models, 3 and 64 for ``alexnet``/``cnn_ham``, 1 and 8 for ``cnn_digits``).
    ``kwargs`` are the builder's options (:func:`model_options`). Raises ``ValueError`` for an
    unknown name or an incompatible size, ``ConfigurationError`` (a ``TypeError``) for an option the builder lacks.
    """
    builder, (num_classes, in_channels, image_size), _ = _checked(name, num_classes, in_channels, image_size, kwargs)
    try:
        return builder(num_classes, in_channels, image_size, **kwargs)
    except RuntimeError as err:  # the allocator's "can't allocate memory" / CUDA's "out of memory"
        if "allocate" not in str(err) and "out of memory" not in str(err):
            raise
        raise MemoryError(f"model {name!r} with options {kwargs} and image_size={image_size} does not fit in the "
                          f"available memory ({str(err).splitlines()[0][:160]}); choose smaller options") from None


#: the most parameters a model may have (8 GiB in float32 per copy; the package's largest, ResNet18, has 11.2M)
MAX_PARAMETERS = 2**31


def _check_size_of(name: str, builder: Callable[..., nn.Module], args: tuple, kwargs: dict) -> int | None:
    """Refuse a model of more than :data:`MAX_PARAMETERS` parameters, or one whose float32 weights alone exceed the
    available memory, counted on the meta device (no memory, milliseconds) before it is built; returns the count
    (None for a builder that cannot be counted there)."""
    from lightning_dfl.host_memory import available_bytes, format_bytes

    count = _parameter_count(builder, args, kwargs)
    if count is None:
        return None
    described = f"model {name!r} with options {kwargs} and image_size={args[2]}"
    if count > MAX_PARAMETERS:
        raise ValueError(f"{described} has {count:,} parameters; allowed: at most {MAX_PARAMETERS:,} (choose smaller "
                         "options)")
    available = available_bytes()
    if available is not None and 4 * count > available:
        raise MemoryError(f"{described} needs {format_bytes(4 * count)} for its weights alone, more than the "
                          f"{format_bytes(available)} of memory available; choose smaller options")
    return count
