"""Bool tensors packed 8 entries a byte, in either bit order: numpy on a CPU, torch operations on an accelerator.

``bitorder="big"`` puts a byte's first entry in its highest bit (``numpy.packbits``' default), ``"little"`` in
its lowest (``numpy.packbits(..., bitorder="little")``); the last byte is padded with zeros. Each saved format
keeps its order: the voting callback's initial masks are big-endian, the compact store's records
(:mod:`~lightning_dfl.federation.store.records`) little-endian.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.deferred import host_reads_are_cheap

__all__ = ["BIT_ORDERS", "pack_bits", "unpack_bits"]

#: the bit orders within a byte, as numpy names them
BIT_ORDERS = ("big", "little")


def _check_order(bitorder: str) -> None:
    if bitorder not in BIT_ORDERS:
        raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")


def _shifts(bitorder: str, device: torch.device) -> Tensor:
    """The shift of each of a byte's 8 entries, in entry order."""
    if bitorder == "little":
        return torch.arange(8, dtype=torch.uint8, device=device)
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack_bits(bits: Tensor, bitorder: str = "big") -> Tensor:
    """A tensor's flattened entries (as bool: nonzero is set) as ``ceil(numel / 8)`` uint8, on its device;
    ``numpy.packbits(bits.ravel(), bitorder=bitorder)``."""
    flat = bits.reshape(-1)
    flat = flat.contiguous() if flat.dtype == torch.bool else flat.bool()
    _check_order(bitorder)
    if host_reads_are_cheap(flat.device):  # numpy is faster on a CPU; the same bytes
        return torch.from_numpy(np.packbits(flat.numpy(), bitorder=bitorder))
    pad = (-flat.numel()) % 8
    b = flat.view(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    # 8 distinct bits: at most 255
    return (b.view(-1, 8) << _shifts(bitorder, flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, count: int, bitorder: str = "big") -> Tensor:
    """The first ``count`` entries :func:`pack_bits` packed into ``packed`` (with the same ``bitorder``), as a
    flat bool tensor on ``packed``'s device (a new tensor); ``numpy.unpackbits(packed, count=count,
    bitorder=bitorder)``."""
    _check_order(bitorder)
    if host_reads_are_cheap(packed.device):
        flat = np.unpackbits(packed.reshape(-1).numpy(), count=count, bitorder=bitorder)
        return torch.from_numpy(flat).view(torch.bool)
    return ((packed.reshape(-1, 1) >> _shifts(bitorder, packed.device)) & 1).reshape(-1)[:count].view(torch.bool)
