"""How far apart the clients are: their published models (the consensus distances, read from the store in
bounded column blocks), their masks (packed 64 entries per int64 word: Jaccard similarity and flip fractions by
popcount) and their accuracies (:func:`personal_spread`). The store is only read: every tensor is gathered into
a copy. :mod:`~lightning_dfl.federation.metrics.diagnostics` logs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["BLOCK_ELEMENTS", "DEVICE_BLOCK_ELEMENTS", "block_elements", "consensus_distances", "flip_fractions",
           "jaccard_matrix", "jaccard_pairs", "pack_words", "packed_masks", "personal_spread", "popcount"]

#: elements of one gathered block (rows x a slice of one parameter) on a CPU: 4 MB of float32; measured fastest
#: on a 2-core CPU for both stores (the compact store decodes a block's rows together: fewer, larger blocks)
BLOCK_ELEMENTS = 1 << 20
#: the same on an accelerator (64 MB of float32): a block costs a few dozen kernel launches and one read of
#: its mask counts (the compact store) whatever its size, so fewer, larger blocks
DEVICE_BLOCK_ELEMENTS = 1 << 24


# -- gathering published tensors in bounded blocks -------------------------------------------------------


def block_elements(device: torch.device | str) -> int:
    """Elements of one gathered block on ``device``: :data:`BLOCK_ELEMENTS` on a CPU, else
    :data:`DEVICE_BLOCK_ELEMENTS`."""
    return BLOCK_ELEMENTS if torch.device(device).type == "cpu" else DEVICE_BLOCK_ELEMENTS


def _step(rows: int, device: torch.device | str, multiple: int = 1) -> int:
    """Columns per block when ``rows`` rows are read at once on ``device``: at most :func:`block_elements` /
    ``rows`` elements, a multiple of ``multiple`` (the store's
    :meth:`~lightning_dfl.federation.store.protocol.ClientStore.column_blocks`)."""
    return max(multiple, (block_elements(device) // max(rows, 1)) // multiple * multiple)


def consensus_distances(store: Any, clients: Sequence[int], names: Sequence[str],
                        pairs: Sequence[tuple[int, int]], packed: dict[str, list[Tensor]] | None = None
                        ) -> tuple[float, float]:
    """``(dense, masked)`` consensus distances of the clients' current published models as stored (the engine
    publishes them zero outside their masks; see the module docstring); ``pairs`` index into ``clients``.
    Masked is NaN without pairs. Float32 blocks: the pair differences taken from the stored values, the dense
    distance from the block centred on its column means; float64 sums, read once at the end. ``packed``: a dict
    that receives, per masked name read, the mask blocks packed by :func:`pack_words` (what
    :func:`packed_masks` gives, without reading the masks again)."""
    k = len(clients)
    masked_names = set(store.masked_names)
    pi = torch.as_tensor([p[0] for p in pairs], dtype=torch.long, device=store.device)
    pj = torch.as_tensor([p[1] for p in pairs], dtype=torch.long, device=store.device)
    dense = torch.zeros((), dtype=torch.float64, device=store.device)
    pairwise = torch.zeros(len(pairs), dtype=torch.float64, device=store.device)
    step = _step(k, store.device, 64)
    for name in names:
        weights = store.column_blocks(clients, name, False, step)
        masks = store.column_blocks(clients, name, True, step) if name in masked_names else None
        for (_, x), mask in zip(weights, masks if masks is not None else iter(lambda: None, 0)):
            if mask is not None and packed is not None:
                packed.setdefault(name, []).append(pack_words(mask[1]))
            x = x.float()
            chunk = max(1, block_elements(x.device) // max(x.shape[1], 1))  # pair differences of at most a block at once
            for lo in range(0, len(pairs), chunk):  # from the stored values: one rounding per difference
                a, b = pi[lo:lo + chunk], pj[lo:lo + chunk]
                diff = x.index_select(0, a).sub_(x.index_select(0, b))
                if mask is not None:
                    m = mask[1]
                    diff.mul_(m.index_select(0, a).logical_and_(m.index_select(0, b)))
                pairwise[lo:lo + chunk] += torch.linalg.vector_norm(diff, dim=1, dtype=torch.float64).square()
            x.sub_(x.mean(dim=0))  # centred on the mean
            dense += torch.linalg.vector_norm(x, dtype=torch.float64).square()
    dense_value = float(dense) / k if k else float("nan")
    masked_value = (k - 1) / (2 * k) * float(pairwise.mean()) if pairs else float("nan")
    return dense_value, masked_value


# masks as packed bits: 64 mask entries per int64 word


def _shift(n: int, like: Tensor) -> Tensor:
    # a 0-dim tensor shift is vectorized on CPU; a Python int shift of int64 is several times slower
    return torch.tensor(n, dtype=like.dtype, device=like.device)


def pack_words(bits: Tensor) -> Tensor:
    """A ``(rows, n)`` bool tensor as ``(rows, ceil(n / 64))`` int64 words (bit order is fixed, so two packings
    compare bit for bit; padding bits are 0)."""
    rows, n = bits.shape
    pad = (-n) % 64
    b = bits.contiguous().view(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    eight = b.view(torch.int64)  # 8 entries (bytes 0/1) per word
    packed = (eight * 0x0102040810204080).bitwise_right_shift_(_shift(56, eight))  # those 8 entries as 8 bits
    return packed.bitwise_and_(0xFF).to(torch.uint8).view(torch.int64).view(rows, -1)


def popcount(words: Tensor) -> Tensor:
    """Set bits per row of an int64 tensor, summed over its last dimension (int64)."""
    one, two, four = _shift(1, words), _shift(2, words), _shift(4, words)
    x = words - (words >> one).bitwise_and_(0x5555555555555555)
    x = (x >> two).bitwise_and_(0x3333333333333333).add_(x.bitwise_and_(0x3333333333333333))
    x = x.add_(x >> four).bitwise_and_(0x0F0F0F0F0F0F0F0F)  # one count per byte, every word now >= 0
    for n in (8, 16, 32):
        x = x.add_(x >> _shift(n, x))
    return x.bitwise_and_(0x7F).sum(dim=-1)


def packed_masks(store: Any, clients: Sequence[int]) -> Tensor:
    """The clients' current published masks (prunable weights), packed: ``(K, words)`` int64 (a store that
    keeps its masks packed, the compact one, gives its own packing: the popcounts are the same)."""
    own = getattr(store, "packed_published_masks", None)
    if own is not None:
        return own(clients)
    parts = [pack_words(m) for name in store.masked_names
             for _, m in store.column_blocks(clients, name, True, _step(len(clients), store.device, 64))]
    return torch.cat(parts, dim=1) if parts else torch.zeros((len(clients), 0), dtype=torch.int64)


def jaccard_pairs(packed: Tensor, pairs: Sequence[tuple[int, int]]) -> Tensor:
    """Jaccard similarity ``|m_i & m_j| / |m_i | m_j|`` of packed masks for each pair (float64; two empty
    masks: 1), in blocks of pairs."""
    counts = popcount(packed)
    out = torch.empty(len(pairs), dtype=torch.float64)
    step = max(1, block_elements(packed.device) // 2 // max(packed.shape[1], 1))
    for lo in range(0, len(pairs), step):
        chunk = pairs[lo:lo + step]
        pi = torch.as_tensor([p[0] for p in chunk], dtype=torch.long, device=packed.device)
        pj = torch.as_tensor([p[1] for p in chunk], dtype=torch.long, device=packed.device)
        inter = popcount(packed[pi] & packed[pj]).double()
        union = counts[pi].double() + counts[pj].double() - inter
        out[lo:lo + len(chunk)] = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(inter)).cpu()
    return out


def jaccard_matrix(store: Any, clients: Sequence[int]) -> Tensor:
    """The full K x K Jaccard matrix of the clients' published masks (float64; O(K^2 P) by blocks of
    exact float32 products)."""
    k = len(clients)
    gram = torch.zeros((k, k), dtype=torch.float64, device=store.device)
    for name in store.masked_names:
        # a block row holds at most 2^24 entries: every float32 dot product is an exact integer
        for _, m in store.column_blocks(clients, name, True, _step(k, store.device, 64)):
            a = m.to(torch.float32)
            gram += (a @ a.T).to(torch.float64)
    counts = gram.diagonal()
    union = counts[:, None] + counts[None, :] - gram
    return torch.where(union > 0, gram / union.clamp_min(1), torch.ones_like(gram)).cpu()


def flip_fractions(previous: Tensor, current: Tensor, masked_size: int) -> Tensor:
    """Per row, the fraction of mask bits that differ between two :func:`packed_masks`."""
    return popcount(previous ^ current).double().cpu() / max(masked_size, 1)


# -- per-client accuracy spread ----------------------------------------------------------------------------


def personal_spread(accuracies: Sequence[float], family: str = "acc/personal") -> dict[str, float]:
    """``acc/personal_min``, ``acc/personal_p10`` (10th percentile, linear interpolation) and
    ``acc/personal_max`` of the clients' accuracies (empty without any); ``family`` names them otherwise
    (``"acc/finetune"``: ``acc/finetune_min``, ...)."""
    values = [float(a) for a in accuracies if a is not None]
    if not values:
        return {}
    return {f"{family}_min": min(values), f"{family}_p10": float(np.percentile(values, 10)),
            f"{family}_max": max(values)}

