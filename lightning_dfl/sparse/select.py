"""Selecting the k smallest or largest entries, ties broken by position, in linear time."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.transfers import to_device


def smallest_k_mask(values: Tensor, k: int) -> Tensor:
    """A boolean mask of the ``k`` smallest entries of a 1-D tensor, as a stable ascending sort
    would pick them (among equal values the lower position first; NaN ranks after every number,
    as in ``torch.sort``), without sorting everything on the CPU; on an accelerator, by that stable sort
    itself, which never waits for the device."""
    n = values.numel()
    if k <= 0:
        return torch.zeros(n, dtype=torch.bool, device=values.device)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=values.device)
    if not host_reads_are_cheap(values.device):  # no data-dependent read: the stable sort's first k
        chosen = torch.zeros(n, dtype=torch.bool, device=values.device)
        return chosen.index_fill_(0, torch.sort(values, stable=True).indices[:k], True)
    return _host_mask(n, _smallest_k_positions(_host_array(values), k))


def smallest_k_mask_among(values: Tensor, among: Tensor, k: int) -> Tensor:
    """The ``k`` smallest of the finite ``values`` where the boolean ``among`` is true (``k`` at most their
    count), ties by position: ``smallest_k_mask(values.masked_fill(~among, inf), k)``, which the accelerators
    compute (RigL's drop among the active weights and regrowth among the rest, by magnitudes made finite). On the
    CPU it selects among the candidates alone in NumPy: filling a scattered half of a layer costs more there than
    selecting."""
    if not host_reads_are_cheap(values.device):
        return smallest_k_mask(values.masked_fill(~among, math.inf), k)
    candidates = np.flatnonzero(among.detach().reshape(-1).numpy())
    if k > candidates.size:
        raise ValueError(f"k={k} exceeds the {candidates.size} candidate entries")
    return _host_mask(values.numel(), candidates[_smallest_k_positions(_host_array(values)[candidates], k)])


def largest_k_mask_among(values: Tensor, among: Tensor, k: int) -> Tensor:
    """The ``k`` largest where ``among`` is true (see :func:`smallest_k_mask_among`)."""
    return smallest_k_mask_among(-values, among, k)


def _host_array(values: Tensor) -> np.ndarray:
    """A 1-D tensor on the CPU as a NumPy array (bfloat16, which NumPy lacks, as float32: every value exact)."""
    return (values.float() if values.dtype == torch.bfloat16 else values).detach().reshape(-1).numpy()


def _host_mask(n: int, positions: np.ndarray) -> Tensor:
    chosen = np.zeros(n, dtype=bool)
    chosen[positions] = True
    return torch.from_numpy(chosen)


def _smallest_k_positions(values: np.ndarray, k: int) -> np.ndarray:
    """Positions (unordered) of the ``k`` smallest entries of a 1-D array as a stable ascending sort with NaN
    last would pick them: NumPy's introselect finds the k-th value in linear time, then the entries below it
    and the first ties by position."""
    n = values.size
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k >= n:
        return np.arange(n)
    if values.dtype.kind == "f":
        nan = np.isnan(values)
        if nan.any():  # select among the numbers; NaNs only fill up, by position
            numbers = np.flatnonzero(~nan)
            if k >= numbers.size:
                return np.concatenate([numbers, np.flatnonzero(nan)[:k - numbers.size]])
            return numbers[_smallest_k_positions(values[numbers], k)]
    threshold = _kth_smallest(values, k)
    below = np.flatnonzero(values < threshold)
    return np.concatenate([below, np.flatnonzero(values == threshold)[:k - below.size]])


#: float32 arrays at least this long find their k-th value by :func:`_kth_smallest`'s counting pass
RADIX_MIN_SIZE = 1 << 16


def _kth_smallest(values: np.ndarray, k: int) -> np.generic:
    """The k-th smallest (1-based) of a 1-D array without NaN. A float32 array of :data:`RADIX_MIN_SIZE` entries
    or more is mapped to unsigned keys in the order of its values (-0.0 just below +0.0: the k-th value is the
    same number), counted by their top 16 bits (one pass), and only the bucket holding the k-th is partitioned:
    1.5-3x faster than NumPy's introselect over the whole array, which every other array takes."""
    if values.dtype != np.float32 or values.size < RADIX_MIN_SIZE:
        return np.partition(values, k - 1)[k - 1]
    bits = values.view(np.uint32)
    keys = bits ^ ((np.uint32(0) - (bits >> np.uint32(31))) | np.uint32(0x80000000))  # negatives: all bits flipped
    top = keys >> np.uint32(16)
    below = np.cumsum(np.bincount(top, minlength=1 << 16))
    bucket = int(np.searchsorted(below, k))  # the first bucket whose running count reaches k
    inside = values[top == bucket]
    rank = k - (int(below[bucket - 1]) if bucket else 0)
    return np.partition(inside, rank - 1)[rank - 1]


def smallest_k(values: Tensor, k: int) -> Tensor:
    """Positions (ascending) of the ``k`` smallest entries; see :func:`smallest_k_mask`."""
    return smallest_k_mask(values, k).nonzero().squeeze(1)


def largest_k_mask(values: Tensor, k: int) -> Tensor:
    """A boolean mask of the ``k`` largest entries (among equal values the lower position first;
    NaN ranks after every number here too, so it is picked last)."""
    return smallest_k_mask(-values, k)


def largest_k(values: Tensor, k: int) -> Tensor:
    """Positions (ascending) of the ``k`` largest entries; see :func:`largest_k_mask`."""
    return largest_k_mask(values, k).nonzero().squeeze(1)


def smallest_k_masks_together(values: Tensor, sizes: Sequence[int], ks: Sequence[int] | Tensor) -> Tensor:
    """:func:`smallest_k_mask` of each part of a 1-D tensor at once: ``values`` is the concatenation of parts of
    ``sizes`` entries, the i-th choosing its ``ks[i]`` smallest (ties by position, NaN last, as there); one flat
    boolean mask. A few kernels for all parts, without reading the device: a stable sort of every value, then a
    stable sort of the result by part (each part's entries in value order, ties by position), of which each part
    keeps its first ``ks[i]``. ``ks`` may be an int64 tensor on ``values``' device (counts never read)."""
    if len(sizes) != len(ks) or sum(sizes) != values.numel():
        shown = ks if not isinstance(ks, Tensor) else f"of {len(ks)} entries"
        raise ValueError(f"sizes {list(sizes)} must add up to the {values.numel()} values and match ks {shown}")
    n, device = values.numel(), values.device
    if not sizes:
        return torch.zeros(0, dtype=torch.bool, device=device)
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    # each part's first position after the sorts and its end of chosen entries, on the device
    if isinstance(ks, Tensor):
        host = to_device(torch.tensor([*starts, *sizes], dtype=torch.long), device)
        first, size = host[:len(sizes)], host[len(sizes):]
        bounds = torch.cat([first[1:], first + ks.to(device=device, dtype=torch.long).clamp(min=0).minimum(size)])
    else:
        bounds = torch.tensor([*starts[1:], *[s + min(max(k, 0), size) for s, k, size in zip(starts, ks, sizes)]],
                              dtype=torch.long)
        bounds = to_device(bounds, device)
    order = torch.sort(values, stable=True).indices
    part = torch.bucketize(order, bounds[:len(sizes) - 1], right=True)  # the part of each sorted entry
    by_part = torch.sort(part, stable=True)
    chosen = torch.arange(n, device=device) < bounds[len(sizes) - 1:].index_select(0, by_part.values)
    return torch.empty(n, dtype=torch.bool, device=device).scatter_(0, order.index_select(0, by_part.indices), chosen)


def largest_k_masks_together(values: Tensor, sizes: Sequence[int], ks: Sequence[int] | Tensor) -> Tensor:
    """:func:`largest_k_mask` of each part at once (see :func:`smallest_k_masks_together`)."""
    return smallest_k_masks_together(-values, sizes, ks)
