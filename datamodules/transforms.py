"""Batched, generator-driven augmentation and normalisation on ``[B, C, H, W]`` tensors.

The per-sample transforms of the papers' pipelines (DisPFL's CIFAR code: ``RandomCrop(32,
padding=4)``, ``RandomHorizontalFlip()``, ``Normalize(mean, std)``) applied to a whole batch at
once, every random draw taken from an explicit ``torch.Generator`` so a seed fixes the result
on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_dfl.checks import check_int
from lightning_dfl.transfers import to_device

__all__ = ["BatchAugment", "Normalize", "channel_stats", "to_float"]


def to_float(x: Tensor) -> Tensor:
    """``uint8`` images in 0..255 -> ``float32`` in [0, 1]; floating tensors pass unchanged."""
    if x.dtype == torch.uint8:
        return x.to(torch.float32).div_(255.0)
    if not x.is_floating_point():
        raise TypeError(f"expected uint8 or floating images, got {x.dtype}")
    return x


def channel_stats(images: Tensor, chunk: int = 8192, chunk_values: int = 1 << 27) -> tuple[list[float], list[float]]:
    """Per-channel mean and (population) std of ``[N, C, H, W]`` images, in [0, 1] units, converted to float
    ``chunk`` images at a time, fewer where they hold over ``chunk_values`` values (1 GiB of float64: 891 images of
    3 x 224 x 224; at least one image)."""
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"expected a non-empty [N, C, H, W] tensor, got shape {tuple(images.shape)}")
    chunk = max(1, min(chunk, chunk_values // max(1, images[0].numel())))
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, images.shape[0], chunk):
        x = to_float(images[start : start + chunk]).to(torch.float64)
        total += x.sum(dim=(0, 2, 3))
        squares += x.square().sum(dim=(0, 2, 3))
    count = images.shape[0] * images.shape[2] * images.shape[3]
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(0).sqrt()
    return mean.tolist(), std.tolist()


class BatchAugment:
    """Random crop with zero padding and horizontal flip for a whole batch.

    Per sample (as torchvision's ``RandomCrop(size, padding=p)`` then ``RandomHorizontalFlip()``):
    the image is zero-padded by ``p`` on every side and an ``H x W`` window is cut at a random
    offset ``(dy, dx)`` in ``[0, 2p]^2``; then it is mirrored with probability 1/2. Draws, in
    order, from ``generator``: ``dy`` and ``dx`` for the batch (when ``p > 0``), then the flip
    mask (when flipping). Works on ``uint8`` or float tensors, returns the same dtype.

    ``augment(x, g)`` equals ``augment.crop_flip(augment.pad(x), arange(B), g)``; the two steps
    let a caller pad a whole data set once (with any per-channel fill) and cut batches from it.
    """

    def __init__(self, random_crop_padding: int = 0, horizontal_flip: bool = False) -> None:
        check_int("random_crop_padding", random_crop_padding, 0)
        self.random_crop_padding = random_crop_padding
        self.horizontal_flip = bool(horizontal_flip)

    @property
    def enabled(self) -> bool:
        return self.random_crop_padding > 0 or self.horizontal_flip

    def __repr__(self) -> str:
        return f"BatchAugment(random_crop_padding={self.random_crop_padding}, horizontal_flip={self.horizontal_flip})"

    def pad(self, x: Tensor, fill: Tensor | None = None) -> Tensor:
        """``[N, C, H, W]`` images padded by ``p`` on every side with zeros, or with ``fill`` (``[C, 1, 1]``)."""
        p = self.random_crop_padding
        if p == 0:
            return x
        if fill is None:
            return F.pad(x, (p, p, p, p))
        out = torch.empty((*x.shape[:-2], x.shape[-2] + 2 * p, x.shape[-1] + 2 * p), dtype=x.dtype, device=x.device)
        out.copy_(fill.to(x.dtype).expand_as(out))
        out[..., p:-p, p:-p] = x
        return out

    def crop_flip(self, padded: Tensor, index: Tensor, generator: torch.Generator) -> Tensor:
        """The augmented samples ``index`` (int64 ``[B]``) of ``[N, C, H + 2p, W + 2p]`` images padded by :meth:`pad`.

        One gather per batch: the crop windows are a view of ``padded`` indexed per sample; the flipped samples
        are taken from the batch's mirror image. The draws reach ``padded``'s device in one upload that the host
        does not wait for. A new ``[B, C, H, W]`` tensor.
        """
        p = self.random_crop_padding
        batch = index.shape[0]
        if not self.enabled:
            return padded.index_select(0, index)
        draws = []  # on the generator's device, in this order: dy, dx, the flips
        if p:
            draws += [torch.randint(0, 2 * p + 1, (batch,), generator=generator, device=generator.device)
                      for _ in range(2)]
        if self.horizontal_flip:
            draws.append((torch.rand(batch, generator=generator, device=generator.device) < 0.5).long())
        drawn = to_device(torch.stack(draws), padded.device)  # one upload, not waited for
        if p:
            # [N, C, 2p + 1, 2p + 1, H, W]: every window of every image, without a copy
            windows = padded.unfold(2, padded.shape[2] - 2 * p, 1).unfold(3, padded.shape[3] - 2 * p, 1)
            x = windows[index, :, drawn[0], drawn[1]]
        else:
            x = padded.index_select(0, index)
        if self.horizontal_flip:
            x = torch.where(drawn[-1].bool().view(-1, *[1] * (x.dim() - 1)), x.flip(-1), x)
        return x

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        if x.ndim != 4:
            raise ValueError(f"expected a [B, C, H, W] batch, got shape {tuple(x.shape)}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if not self.enabled:
            return x
        return self.crop_flip(self.pad(x), torch.arange(x.shape[0], device=x.device), generator)


class Normalize:
    """``(to_float(x) - mean) / std`` per channel; ``mean`` and ``std`` in [0, 1] units."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        if self.mean.shape != self.std.shape or self.mean.numel() == 0:
            raise ValueError(f"mean and std need one value per channel, got {list(mean)} and {list(std)}")
        if not bool((self.std > 0).all()):
            raise ValueError(f"std must be positive in every channel, got {self.std.tolist()}")
        self._cache: dict[torch.device, tuple[Tensor, Tensor]] = {}

    @classmethod
    def from_images(cls, images: Tensor) -> Normalize:
        """Statistics of ``images`` (e.g. a training split); a zero std is replaced by 1."""
        mean, std = channel_stats(images)
        return cls(mean, [s if s > 0 else 1.0 for s in std])

    def __repr__(self) -> str:
        mean = [round(m, 4) for m in self.mean.tolist()]
        std = [round(s, 4) for s in self.std.tolist()]
        return f"Normalize(mean={mean}, std={std})"

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim < 3 or x.shape[-3] != self.mean.numel():
            raise ValueError(f"expected [..., {self.mean.numel()}, H, W] images, got shape {tuple(x.shape)}")
        if x.device not in self._cache:
            self._cache[x.device] = (
                self.mean.to(x.device)[:, None, None],
                self.std.to(x.device)[:, None, None],
            )
        mean, std = self._cache[x.device]
        out = x.to(torch.float32).div_(255.0) if x.dtype == torch.uint8 else to_float(x).to(torch.float32, copy=True)
        return out.sub_(mean).div_(std)
