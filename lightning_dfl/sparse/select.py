"""Selecting the k smallest or largest entries, ties broken by position, in linear time."""

from __future__ import annotations

import torch
from torch import Tensor


def smallest_k(values: Tensor, k: int) -> Tensor:
    """Positions of the ``k`` smallest entries of a 1-D tensor, as a stable ascending sort would
    pick them (among equal values the lower position first), without sorting everything.

    Returns the positions in ascending order of position.
    """
    n = values.numel()
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=values.device)
    if k >= n:
        return torch.arange(n, device=values.device)
    threshold = torch.kthvalue(values.cpu() if values.device.type == "mps" else values, k).values
    below = values < threshold
    taken = int(below.sum())
    ties = (values == threshold).nonzero().squeeze(1)[: k - taken]
    chosen = below.clone()
    chosen[ties] = True
    return chosen.nonzero().squeeze(1)


def largest_k(values: Tensor, k: int) -> Tensor:
    """Positions of the ``k`` largest entries (among equal values the lower position first)."""
    return smallest_k(-values, k)
