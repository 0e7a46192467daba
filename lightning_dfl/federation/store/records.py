"""A node's compact record, the format check of a saved compact store, and its conversions.

A record holds a node's published model as the active values of each masked parameter, its mask as
packed bits (:func:`~lightning_dfl.sparse.bits.pack_bits`: 8 entries per byte, :data:`BIT_ORDER` little-endian), the signs of its
inactive zeros where some are ``-0.0``, and its other parameters dense. The compact store
(:mod:`~lightning_dfl.federation.store.compact`) keeps its nodes this way; a saved compact store
is checked before it loads (:func:`check_compact_state`), expands into the dense store's layout
(:func:`dense_state_dict`) and gives any node's weights (:func:`checkpoint_weights`) without either store
class: both stores, the checkpoints and ``export`` use this module, which imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.federation.store.saved_state import (
    SavedStateError,
    StoreLayout,
    check_fields,
    check_slots,
    named,
    shown_list,
    tensor_of,
)
from lightning_dfl.sparse.bits import pack_bits, unpack_bits
from lightning_dfl.sparse.masks import sums_by_part

__all__ = ["FORMAT", "INT_VIEWS", "bit_range", "check_compact_state", "checkpoint_weights", "dense_state_dict",
           "BIT_ORDER", "pack_bits_all", "record_weights", "scatter_", "select", "select_all", "share_equal_parts",
           "signed_zeros", "unpack_bits_together"]

#: ``state_dict()["format"]`` of a compact store
FORMAT = "compact"
#: the records' bit order within a byte (:mod:`lightning_dfl.sparse.bits`): a byte's first entry in its lowest bit
BIT_ORDER = "little"


def pack_bits_all(masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each mask's packed bits (:data:`BIT_ORDER`), by name. On an accelerator, when every one holds a multiple of 8 entries
    (their bytes then do not straddle two masks), their concatenation is packed at once and each mask's bytes
    copied out: a few kernels and one copy each, where each packing takes several."""
    parts = list(masks.values())
    device = parts[0].device if parts else None
    if device is None or host_reads_are_cheap(device) or len(parts) < 2 \
            or any(m.numel() % 8 or m.device != device for m in parts):
        return {n: pack_bits(m, BIT_ORDER) for n, m in masks.items()}
    packed = pack_bits(torch.cat([m.reshape(-1) if m.dtype == torch.bool else m.reshape(-1).bool()
                                              for m in parts]), BIT_ORDER)
    return {n: part.clone() for n, part in zip(masks, packed.split([m.numel() // 8 for m in parts]))}


def share_equal_parts(old: Mapping[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
    """``new`` packed masks, each part replaced by ``old``'s when equal (records share their bytes); one host
    read for all parts."""
    names = [n for n, b in new.items() if old[n].shape == b.shape]
    if not names:
        equal = []
    elif host_reads_are_cheap(new[names[0]].device) or len(names) < 2 or any(new[n].numel() == 0 for n in names):
        equal = torch.stack([old[n].eq(new[n]).all() for n in names]).tolist()
    else:  # on an accelerator: every part compared in a few kernels
        differ = torch.cat([old[n] for n in names]).ne(torch.cat([new[n] for n in names]))
        equal = sums_by_part(differ, [new[n].numel() for n in names]).eq(0).tolist()
    same = {n for n, e in zip(names, equal) if e}
    return {n: old[n] if n in same else b for n, b in new.items()}


def unpack_bits_together(bits: Mapping[str, Tensor], order: list[str]) -> tuple[Tensor, dict[str, int]]:
    """The packed masks ``bits[n]`` for ``n`` in ``order`` unpacked at once (concatenated; each part is
    byte-padded): the flat bits and where each mask starts in them."""
    packed = [bits[n] for n in order]
    flat = unpack_bits(torch.cat(packed), 8 * sum(p.numel() for p in packed), BIT_ORDER)
    return flat, dict(zip(order, np.cumsum([0] + [8 * p.numel() for p in packed]).tolist()))


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
    """Bits ``[start, stop)`` of a record's packed bits, as a flat bool tensor."""
    first = start // 8
    bits = unpack_bits(packed[first:(stop + 7) // 8].contiguous(), stop - first * 8, BIT_ORDER)
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
        mask = unpack_bits(record["bits"][n].cpu(), numel, BIT_ORDER).to(values.device)
        dense = scatter_(torch.zeros(numel, dtype=values.dtype, device=values.device), mask, values)
        neg = record["neg"].get(n)
        if neg is not None:
            signs = unpack_bits(neg.cpu(), numel - values.numel(), BIT_ORDER).to(values.device)
            scatter_(dense, ~mask, signed_zeros(signs, values.dtype))
        out[n] = dense.reshape(shapes[n])
    return out


def check_compact_state(saved: Mapping[str, Any], layout: StoreLayout) -> None:
    """Refuse a compact store's saved state (``format == "compact"``) that cannot load into a store of
    ``layout`` with one :class:`~lightning_dfl.federation.store.saved_state.SavedStateError`: a missing part,
    names (in order), shapes or node count that differ, a damaged record (mask bits, active values and zero signs
    of the wrong size or dtype, an active count that is not an int), slots or fields that do not fit. Nothing is
    loaded; the values themselves are checked elsewhere."""
    lacking = [k for k in ("names", "masked_names", "shapes", "records", "current_bits", "slot", "fields")
               if k not in saved]
    if lacking:
        raise SavedStateError(f"its compact store has no {lacking}")
    names, masked = list(layout.shapes), layout.masked_names
    for key, mine in (("names", names), ("masked_names", masked)):
        if not isinstance(saved[key], list) or saved[key] != mine:
            theirs = saved[key] if isinstance(saved[key], list) else []
            named(dict.fromkeys(theirs), f"its compact store's {key}", mine)  # names the difference
            raise SavedStateError(f"its compact store's {key} are {shown_list(saved[key])}, this run's "
                                  f"{shown_list(mine)} (in this order)")
    shapes = named(saved["shapes"], "its compact store's shapes", names)
    for n in names:
        if not isinstance(shapes[n], (list, tuple)) or tuple(shapes[n]) != layout.shapes[n]:
            raise SavedStateError(f"its compact store's parameter {n!r} has shape {shapes[n]!r}, this run's model "
                                  f"{layout.shapes[n]}")
    numels = {n: math.prod(s) for n, s in layout.shapes.items()}
    for key in ("records", "current_bits"):
        if not isinstance(saved[key], list):
            raise SavedStateError(f"its compact store's {key} is a {type(saved[key]).__name__}, expected a list")
        if len(saved[key]) != layout.num_nodes:
            raise SavedStateError(f"its compact store holds {key} of {len(saved[key])} nodes, this run has "
                                  f"{layout.num_nodes} (clients plus servers)")

    def bits_of(value: Any, what: str) -> dict[str, Tensor]:
        bits = named(value, what, masked)
        for n in masked:
            tensor_of(bits[n], f"{what} {n!r}", (math.ceil(numels[n] / 8),), (torch.uint8,))
        return bits

    for node, record in enumerate(saved["records"]):
        where = f"its record of node {node}"
        if not isinstance(record, dict) or any(k not in record for k in ("values", "bits", "neg", "active")):
            shown = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise SavedStateError(f"{where} is {shown}, expected a dict of 'values', 'bits', 'neg' and 'active'")
        bits = bits_of(record["bits"], f"{where}: mask bits")
        values = named(record["values"], f"{where}: values", names)
        neg = record["neg"]
        if not isinstance(neg, dict) or not set(neg) <= set(masked):
            raise SavedStateError(f"{where}: zero signs are {neg!r:.80}, expected a dict by masked parameter")
        for n in names:
            value = tensor_of(values[n], f"{where}: values of {n!r}", None, (layout.dtypes[n],))
            full = n not in bits or value.numel() == numels[n]  # kept whole, or the active entries only
            count = numels[n] if full else int(unpack_bits(bits[n], numels[n], BIT_ORDER).sum())
            tensor_of(value, f"{where}: values of {n!r}", (count,), (layout.dtypes[n],))
            if n in neg:
                tensor_of(neg[n], f"{where}: zero signs of {n!r}", (math.ceil((numels[n] - count) / 8),),
                          (torch.uint8,))
        if type(record["active"]) is not int or record["active"] < 0:
            raise SavedStateError(f"{where}: active count {record['active']!r}, expected an int >= 0")
    for node, bits in enumerate(saved["current_bits"]):
        bits_of(bits, f"its current mask bits of node {node}")
    check_slots(saved["slot"], layout.num_nodes)
    check_fields(saved, layout)


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
            published[n][s, k].copy_(unpack_bits(record["bits"][n].cpu(), numel, BIT_ORDER).view(shapes[n]))
            masks[n][k].copy_(unpack_bits(state["current_bits"][k][n].cpu(), numel, BIT_ORDER).view(shapes[n]))
        active[s, k] = int(record["active"])
    return {"weights": weights, "published_masks": published, "masks": masks, "slot": slot, "active": active,
            "fields": state.get("fields", {})}
