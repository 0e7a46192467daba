"""A node's compact record, and the conversions of a saved compact store.

A record holds a node's published model as the active values of each masked parameter, its mask as
packed bits (:func:`pack_bits`: 8 entries per byte, little-endian within a byte), the signs of its
inactive zeros where some are ``-0.0``, and its other parameters dense. The compact store
(:mod:`~lightning_dfl.federation.store.compact`) keeps its nodes this way; a saved compact store
expands into the dense store's layout (:func:`dense_state_dict`) and gives any node's weights
(:func:`checkpoint_weights`) without either store class: both stores, the checkpoints and ``export``
use this module, which imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.deferred import host_reads_are_cheap

__all__ = ["FORMAT", "INT_VIEWS", "bit_range", "checkpoint_weights", "dense_state_dict", "pack_bits", "pack_bits_all",
           "record_weights", "scatter_", "select", "select_all", "signed_zeros", "unpack_bits"]

#: ``state_dict()["format"]`` of a compact store
FORMAT = "compact"


def pack_bits(bits: Tensor) -> Tensor:
    """A bool tensor as ``ceil(numel / 8)`` uint8, flattened, little-endian within a byte (numpy's
    ``packbits(..., bitorder="little")``); on the tensor's device."""
    flat = bits.reshape(-1)
    if flat.dtype != torch.bool:
        flat = flat.bool()
    if host_reads_are_cheap(flat.device):
        return torch.from_numpy(np.packbits(flat.contiguous().numpy(), bitorder="little"))
    return _pack_torch(flat)


def pack_bits_all(masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """:func:`pack_bits` of each mask, by name. On an accelerator, when every one holds a multiple of 8 entries
    (their bytes then do not straddle two masks), their concatenation is packed at once and each mask's bytes
    copied out: a few kernels and one copy each, where each packing takes several."""
    parts = list(masks.values())
    device = parts[0].device if parts else None
    if device is None or host_reads_are_cheap(device) or len(parts) < 2 \
            or any(m.numel() % 8 or m.device != device for m in parts):
        return {n: pack_bits(m) for n, m in masks.items()}
    packed = _pack_torch(torch.cat([m.reshape(-1) if m.dtype == torch.bool else m.reshape(-1).bool() for m in parts]))
    return {n: part.clone() for n, part in zip(masks, packed.split([m.numel() // 8 for m in parts]))}


def _pack_torch(flat: Tensor) -> Tensor:
    """:func:`pack_bits` with torch operations (any device)."""
    pad = (-flat.numel()) % 8
    b = flat.view(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    return (b.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)  # bit i of a byte: entry i (at most 255)


def unpack_bits(packed: Tensor, count: int) -> Tensor:
    """The first ``count`` bits of :func:`pack_bits`'s output as a flat bool tensor (a new tensor)."""
    if host_reads_are_cheap(packed.device):
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=count, bitorder="little")).view(torch.bool)
    return _unpack_torch(packed, count)


def _unpack_torch(packed: Tensor, count: int) -> Tensor:
    """:func:`unpack_bits` with torch operations (any device)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:count].view(torch.bool)


_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


#: the integer dtype of each item size: bit-exact views of any tensor
INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy integer array of its item size (bit-exact, any dtype)."""
    return t.view(INT_VIEWS[t.element_size()]).numpy()


def select(values: Tensor, mask: Tensor, count: int | None = None) -> Tensor:
    """``values.masked_select(mask)`` for flat tensors (numpy's ``compress`` on a CPU: several times faster). On
    an accelerator, given ``count`` (the mask's set bits), without waiting for the device: the positions of the
    set bits are the first ``count`` of a stable sort of the inverted mask."""
    if not host_reads_are_cheap(values.device):
        if count is None:
            return values.masked_select(mask)
        order = torch.sort((~mask).view(torch.uint8), stable=True).indices[:count]
        return values.index_select(0, order)
    return torch.from_numpy(np.compress(mask.numpy(), _raw(values))).view(values.dtype)


def select_all(values: list[Tensor], masks: list[Tensor], counts: list[int]) -> list[Tensor]:
    """:func:`select` of each ``(values, mask, count)``. On an accelerator, for values of one dtype, at once: the
    set positions of all masks in order are the first ``sum(counts)`` of one stable sort of the inverted,
    concatenated masks (each mask's its own, in order), so one gather of the concatenated values gives every
    tensor's selection, copied out each."""
    device = values[0].device if values else None
    if device is None or host_reads_are_cheap(device) or len(values) < 2 \
            or any(v.dtype != values[0].dtype or v.device != device for v in values):
        return [select(v, m, c) for v, m, c in zip(values, masks, counts)]
    total = sum(counts)
    order = torch.sort((~torch.cat(masks)).view(torch.uint8), stable=True).indices[:total]
    chosen = torch.cat(values).index_select(0, order)
    return [part.clone() for part in chosen.split(counts)]


def scatter_(out: Tensor, mask: Tensor, values: Tensor) -> Tensor:
    """``out.masked_scatter_(mask, values)`` for flat tensors (by indices on a CPU: several times faster)."""
    if not host_reads_are_cheap(out.device):
        return out.masked_scatter_(mask, values)
    _raw(out)[np.flatnonzero(mask.numpy())] = _raw(values)
    return out


def signed_zeros(negative: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeros of a floating ``dtype``, ``-0.0`` (the sign bit alone) where ``negative`` is set."""
    if not host_reads_are_cheap(negative.device):
        return torch.zeros(negative.shape, dtype=dtype, device=negative.device).masked_fill_(negative, -0.0)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(negative.numpy().astype(_INTS[size]) << (8 * size - 1)).view(dtype)


def bit_range(packed: Tensor, start: int, stop: int) -> Tensor:
    """Bits ``[start, stop)`` of a :func:`pack_bits` output, as a flat bool tensor."""
    first = start // 8
    bits = unpack_bits(packed[first:(stop + 7) // 8].contiguous(), stop - first * 8)
    return bits[start - first * 8:]


def record_weights(state: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Tensor]:
    shapes = {n: tuple(s) for n, s in state["shapes"].items()}
    out = {}
    for n in state["names"]:
        values = record["values"][n]
        numel = math.prod(shapes[n])
        if values.numel() == numel:
            out[n] = values.reshape(shapes[n])
            continue
        mask = unpack_bits(record["bits"][n].cpu(), numel).to(values.device)
        dense = scatter_(torch.zeros(numel, dtype=values.dtype, device=values.device), mask, values)
        neg = record["neg"].get(n)
        if neg is not None:
            signs = unpack_bits(neg.cpu(), numel - values.numel()).to(values.device)
            scatter_(dense, ~mask, signed_zeros(signs, values.dtype))
        out[n] = dense.reshape(shapes[n])
    return out


def checkpoint_weights(store_state: Mapping[str, Any], node: int) -> dict[str, Tensor]:
    """Node ``node``'s published weights in a saved store (``state_dict()`` of either store), dense."""
    if store_state.get("format") == FORMAT:
        return record_weights(store_state, store_state["records"][node])
    slot = int(store_state["slot"][node])
    return {n: t[slot, node] for n, t in store_state["weights"].items()}


def dense_state_dict(state: Mapping[str, Any], store: Any) -> dict[str, Any]:
    """A compact store's ``state_dict`` expanded into the dense store's layout (for ``store``)."""
    names, masked = list(state["names"]), list(state["masked_names"])
    if names != store.names or masked != store.masked_names:
        raise ValueError(f"the checkpoint's compact store holds {names} (masked {masked}); this store "
                         f"{store.names} (masked {store.masked_names})")
    slot = state["slot"]
    weights = {n: torch.zeros_like(t) for n, t in store.weights.items()}
    published = {n: torch.ones_like(t) for n, t in store.published_masks.items()}
    masks = {n: torch.ones_like(t) for n, t in store.masks.items()}
    active = torch.zeros_like(store.active)
    shapes = {n: tuple(s) for n, s in state["shapes"].items()}
    if len(state["records"]) != store.num_nodes or any(shapes[n] != tuple(weights[n].shape[2:]) for n in names):
        raise ValueError(f"the checkpoint's compact store ({len(state['records'])} nodes of {shapes}) does "
                         f"not fit this store ({store.num_nodes} nodes)")
    for k, record in enumerate(state["records"]):
        s = int(slot[k])
        for n, t in record_weights(state, record).items():
            weights[n][s, k].copy_(t)
        for n in masked:
            numel = math.prod(shapes[n])
            published[n][s, k].copy_(unpack_bits(record["bits"][n].cpu(), numel).view(shapes[n]))
            masks[n][k].copy_(unpack_bits(state["current_bits"][k][n].cpu(), numel).view(shapes[n]))
        active[s, k] = int(record["active"])
    return {"weights": weights, "published_masks": published, "masks": masks, "slot": slot, "active": active,
            "fields": state.get("fields", {})}
