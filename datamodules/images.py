"""Decoded images: :class:`ImageData` (``uint8 [N, C, H, W]`` images, labels, class names) and :class:`Split`
(train and test), image files decoded once (:func:`decode_images`, torchvision.io) and batches resized
(:func:`resize_images`), refused before allocation when they would not fit in memory."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dfl import host_memory
from lightning_dfl.checks import is_int

__all__ = ["ImageData", "Split", "check_image_size", "check_images_fit", "decode_images", "describe_error",
           "resize_images", "resize_split"]

# torchvision.io prefixes its errors with the C++ function and source line: "decode_jpeg, /path/x.cpp:171, ", or
# "operator(), /path/decode_png.cpp:79, " from a lambda
_TORCHVISION_IO_PREFIX = re.compile(r"^[\w:<>~]+(?:\(\))?, \S+\.cpp:\d+, ")


@dataclass(frozen=True)
class ImageData:
    """Images ``uint8 [N, C, H, W]``, labels ``int64 [N]`` in ``[0, len(classes))`` and class names."""

    images: Tensor
    labels: Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(
                f"images must be a uint8 tensor [N, C, H, W], got {self.images.dtype} "
                f"with shape {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must be an int64 tensor [N] with N={self.images.shape[0]}, got "
                f"{self.labels.dtype} with shape {tuple(self.labels.shape)}"
            )
        if len(self.labels) and not 0 <= int(self.labels.min()) <= int(self.labels.max()) < len(self.classes):
            raise ValueError(
                f"labels must lie in [0, {len(self.classes)}) for {len(self.classes)} classes, got "
                f"[{int(self.labels.min())}, {int(self.labels.max())}]"
            )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        return tuple(int(s) for s in self.images.shape[1:])  # type: ignore[return-value]


@dataclass(frozen=True)
class Split:
    """The official (or fixed, seeded) train/test split of one data set."""

    train: ImageData
    test: ImageData

    def __post_init__(self) -> None:
        if list(self.train.classes) != list(self.test.classes):
            raise ValueError("train and test splits must share one class list")
        if self.train.input_shape != self.test.input_shape:
            raise ValueError(
                f"train images {self.train.input_shape} and test images {self.test.input_shape} differ in shape"
            )

    @property
    def classes(self) -> list[str]:
        return self.train.classes

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.train.input_shape


def describe_error(err: BaseException) -> str:
    """An exception's message without torchvision.io's C++ location; its type when it has no text."""
    text = _TORCHVISION_IO_PREFIX.sub("", str(err).strip()).rstrip(". ")
    return text or type(err).__name__


def check_image_size(image_size: int | None) -> None:
    """``ValueError`` unless ``image_size`` is ``None`` or an integer >= 1."""
    if image_size is not None and not (is_int(image_size) and image_size >= 1):
        raise ValueError(f"image_size must be None or an integer >= 1, got {image_size!r}")


def check_images_fit(count: int, channels: int, size: int) -> None:
    """Refuse ``count`` ``uint8`` images of ``channels x size x size`` that would not fit in the available memory
    (``MemAvailable``), before allocating them: one line naming ``image_size``, the bytes and the memory."""
    need, available = count * channels * size * size, host_memory.available_bytes()
    if available is not None and need > available:
        largest = max(1, int((available / max(1, count * channels)) ** 0.5))
        raise ValueError(f"image_size={size} would make {count} images of {channels}x{size}x{size} bytes take "
                         f"{host_memory.format_bytes(need)}, more than the {host_memory.format_bytes(available)} of "
                         f"memory available; use an image_size of at most {largest} (and far less leaves room for "
                         "training)")


def resize_images(images: Tensor, size: int, chunk: int = 4096) -> Tensor:
    """Resize a ``uint8 [N, C, H, W]`` batch to ``size x size`` (bilinear, antialiased)."""
    from torchvision.transforms.v2 import functional as TF

    check_image_size(size)
    if tuple(images.shape[-2:]) == (size, size):
        return images
    check_images_fit(images.shape[0], images.shape[1], size)
    out = torch.empty((images.shape[0], images.shape[1], size, size), dtype=torch.uint8)
    for start in range(0, images.shape[0], chunk):
        out[start : start + chunk] = TF.resize(images[start : start + chunk], [size, size], antialias=True)
    return out


def resize_split(split: Split, size: int) -> Split:
    """Both halves of ``split`` resized to ``size x size``."""
    return Split(
        ImageData(resize_images(split.train.images, size), split.train.labels, split.train.classes),
        ImageData(resize_images(split.test.images, size), split.test.labels, split.test.classes),
    )


#: the most pixels an image file may declare (width x height in its header): PIL's own decompression-bomb limit
MAX_IMAGE_PIXELS = 89_478_485


def shown_path(path: str) -> str:
    """``path`` for a message: as it is, its bytes that are not UTF-8 (a file name from another system) as
    ``\\xNN`` escapes, which any terminal prints."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _as_tensor(data: bytes) -> Tensor:
    """A file's bytes as the ``uint8`` tensor torchvision decodes."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def check_image_header(data: bytes, path: str) -> None:
    """Refuse an image whose header declares more than :data:`MAX_IMAGE_PIXELS` pixels before it is decoded (a
    crafted 60000 x 60000 PNG of a few KB crashed the decoder): PIL reads the header only. A header PIL cannot read
    is left to the decoder, which names the file."""
    import io
    import warnings

    from PIL import Image

    pixels = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                pixels = f"{width} x {height} pixels ({width * height:,})" if width * height > MAX_IMAGE_PIXELS \
                    else None
        except Image.DecompressionBombError as err:  # PIL's own limit (twice ours) refused it at once
            found = re.search(r"\((\d+) pixels\)", str(err))
            pixels = f"{int(found.group(1)):,} pixels" if found else "more pixels than PIL's limit"
        except Exception:  # not an image PIL knows (or damaged): the decoder's error names it
            return
    if pixels is not None:
        raise ValueError(f"image {shown_path(path)} declares {pixels} in its header; an image may have at most "
                         f"{MAX_IMAGE_PIXELS:,} pixels (a decompression bomb, or not a data set image): replace or "
                         "delete it")


def decode_images(paths: Sequence[str | os.PathLike], image_size: int | None = None) -> Tensor:
    """Decode image files once into one RGB ``uint8 [N, 3, H, W]`` tensor (torchvision.io).

    Grayscale images are replicated to three channels, 16-bit images scaled to 8 bits. With
    ``image_size`` every image is resized to ``image_size x image_size``; without it all images
    must already share one size.
    """
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as TF

    check_image_size(image_size)
    out: Tensor | None = None
    for i, path in enumerate(paths):
        path = os.fspath(path)
        if not os.path.isfile(path):
            if os.path.lexists(path):  # a folder, a FIFO (reading it would block), a device, a broken link
                raise FileNotFoundError(f"image {shown_path(path)} is not a regular file; an image must be one: "
                                        "replace or delete it")
            raise FileNotFoundError(f"image file not found: {shown_path(path)}")
        with open(path, "rb") as fh:  # by Python: any file name (torchvision's read_file cannot open non-UTF-8 ones)
            data = fh.read()
        check_image_header(data, path)
        try:
            img = decode_image(_as_tensor(data), mode=ImageReadMode.RGB)
        except RuntimeError as err:
            raise ValueError(f"cannot decode image {shown_path(path)} ({describe_error(err)}): the file is corrupt or "
                             "not an image "
                             "(jpeg, png, webp or gif); replace or delete it") from err
        if img.dtype != torch.uint8:  # 16-bit PNGs decode as uint16: scale, do not wrap modulo 256
            img = TF.to_dtype(img, torch.uint8, scale=True)
        if image_size is not None and tuple(img.shape[-2:]) != (image_size, image_size):
            img = TF.resize(img, [image_size, image_size], antialias=True)
        if out is None:
            if image_size is not None:
                check_images_fit(len(paths), img.shape[0], image_size)
            out = torch.empty((len(paths), *img.shape), dtype=torch.uint8)
        elif img.shape != out.shape[1:]:
            raise ValueError(
                f"image {path} is {img.shape[1]}x{img.shape[2]} but earlier images are "
                f"{out.shape[2]}x{out.shape[3]}; pass image_size=<int> to resize all images to one size"
            )
        out[i] = img
    if out is None:
        return torch.empty((0, 3, image_size or 0, image_size or 0), dtype=torch.uint8)
    return out
