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

__all__ = ["BatchAugment", "Normalize", "channel_stats", "to_float"]


def to_float(x: Tensor) -> Tensor:
    """``uint8`` images in 0..255 -> ``float32`` in [0, 1]; floating tensors pass unchanged."""
    if x.dtype == torch.uint8:
        return x.to(torch.float32).div_(255.0)
    if not x.is_floating_point():
        raise TypeError(f"expected uint8 or floating images, got {x.dtype}")
    return x


def channel_stats(images: Tensor, chunk: int = 8192) -> tuple[list[float], list[float]]:
    """Per-channel mean and (population) std of ``[N, C, H, W]`` images, in [0, 1] units."""
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"expected a non-empty [N, C, H, W] tensor, got shape {tuple(images.shape)}")
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
    """

    def __init__(self, random_crop_padding: int = 0, horizontal_flip: bool = False) -> None:
        if isinstance(random_crop_padding, bool) or not isinstance(random_crop_padding, int) or random_crop_padding < 0:
            raise ValueError(f"random_crop_padding must be an integer >= 0, got {random_crop_padding!r}")
        self.random_crop_padding = random_crop_padding
        self.horizontal_flip = bool(horizontal_flip)

    @property
    def enabled(self) -> bool:
        return self.random_crop_padding > 0 or self.horizontal_flip

    def __repr__(self) -> str:
        return f"BatchAugment(random_crop_padding={self.random_crop_padding}, horizontal_flip={self.horizontal_flip})"

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        if x.ndim != 4:
            raise ValueError(f"expected a [B, C, H, W] batch, got shape {tuple(x.shape)}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        batch, _, height, width = x.shape
        p = self.random_crop_padding
        if p > 0:
            dy = torch.randint(0, 2 * p + 1, (batch,), generator=generator, device=generator.device).to(x.device)
            dx = torch.randint(0, 2 * p + 1, (batch,), generator=generator, device=generator.device).to(x.device)
            padded = F.pad(x, (p, p, p, p)).flatten(2)  # [B, C, (H + 2p) (W + 2p)]
            rows = dy[:, None] + torch.arange(height, device=x.device)  # [B, H]
            cols = dx[:, None] + torch.arange(width, device=x.device)  # [B, W]
            flat = (rows[:, :, None] * (width + 2 * p) + cols[:, None, :]).reshape(batch, 1, height * width)
            x = padded.gather(2, flat.expand(-1, x.shape[1], -1)).reshape(x.shape)
        if self.horizontal_flip:
            flip = torch.rand(batch, generator=generator, device=generator.device) < 0.5
            x = torch.where(flip.to(x.device)[:, None, None, None], x.flip(-1), x)
        return x


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
