"""Bool tensors packed 8 a byte (lightning_dfl.sparse.bits): both bit orders, as numpy packs them, and the
orders of the formats that keep them (the voting callback's initial masks, the compact store's records)."""

import math

import numpy as np
import pytest
import torch

from lightning_dfl.deferred import device_paths_on_cpu
from lightning_dfl.federation.store import records
from lightning_dfl.sparse.bits import BIT_ORDERS, pack_bits, unpack_bits

#: bits 1 0 0 0 0 0 0 1 | 1: entries 0, 7 and 8 set
BITS = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)


def test_hand_computed_bytes_of_both_orders():
    # big: entry 0 -> 0x80, entry 7 -> 0x01 (0x81); entry 8 -> the next byte's 0x80. little: entry i -> 1 << (i % 8)
    assert pack_bits(BITS, bitorder="big").tolist() == [0x81, 0x80]
    assert pack_bits(BITS, bitorder="little").tolist() == [0x81, 0x01]
    assert pack_bits(BITS).tolist() == [0x81, 0x80]  # numpy's default order
    assert pack_bits(torch.tensor([1, 1, 0, 1], dtype=torch.bool), bitorder="little").tolist() == [0b1011]
    assert pack_bits(torch.tensor([1, 1, 0, 1], dtype=torch.bool), bitorder="big").tolist() == [0b11010000]
    for order in BIT_ORDERS:
        assert unpack_bits(torch.tensor([0x81, 0x80 if order == "big" else 0x01], dtype=torch.uint8), 9,
                           bitorder=order).tolist() == BITS.tolist()


@pytest.mark.parametrize("bitorder", BIT_ORDERS)
def test_round_trip_and_numpys_bytes(bitorder):
    generator = torch.Generator().manual_seed(0)
    for count in (0, 1, 7, 8, 9, 61, 1001):
        bits = torch.rand(count, generator=generator) < 0.5
        packed = pack_bits(bits, bitorder=bitorder)
        assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(count / 8),)
        assert np.array_equal(packed.numpy(), np.packbits(bits.numpy(), bitorder=bitorder))
        unpacked = unpack_bits(packed, count, bitorder=bitorder)
        assert unpacked.dtype == torch.bool and torch.equal(unpacked, bits)
        assert np.array_equal(unpacked.numpy(), np.unpackbits(packed.numpy(), count=count, bitorder=bitorder)
                              .astype(bool))


def test_shapes_strides_and_dtypes_are_flattened():
    generator = torch.Generator().manual_seed(1)
    grid = torch.rand(5, 7, generator=generator) < 0.5
    for order in BIT_ORDERS:
        flat = pack_bits(grid.reshape(-1), bitorder=order)
        assert torch.equal(pack_bits(grid, bitorder=order), flat)  # a 2-D tensor: its flattened entries
        assert torch.equal(pack_bits(grid.T, bitorder=order), pack_bits(grid.T.contiguous(), bitorder=order))
        assert torch.equal(pack_bits(grid.to(torch.uint8), bitorder=order), flat)  # nonzero is set
        assert torch.equal(unpack_bits(flat.view(1, -1), 35, bitorder=order), grid.reshape(-1))


def test_the_compact_stores_records_are_little_endian_on_every_path():
    """The records' bits (``records.BIT_ORDER``) are packed with numpy on a CPU and with torch operations on an
    accelerator (taken here on the CPU): the same bytes, each mask alone or several at once."""
    generator = torch.Generator().manual_seed(2)
    masks = {f"m{count}": torch.rand(count, generator=generator) < 0.3 for count in (1, 8, 13, 64, 1001)}
    eights = {n: m for n, m in masks.items() if m.numel() % 8 == 0}  # packed together on an accelerator
    for bits in masks.values():
        packed = pack_bits(bits, records.BIT_ORDER)
        assert records.BIT_ORDER == "little"
        assert torch.equal(packed, torch.from_numpy(np.packbits(bits.numpy(), bitorder="little")))
        assert torch.equal(unpack_bits(packed, bits.numel(), records.BIT_ORDER), bits)
        with device_paths_on_cpu():
            assert torch.equal(pack_bits(bits, records.BIT_ORDER), packed)
            assert torch.equal(unpack_bits(packed, bits.numel(), records.BIT_ORDER), bits)
    on_cpu = records.pack_bits_all(eights)
    with device_paths_on_cpu():
        together = records.pack_bits_all(eights)
    assert list(together) == list(eights) and all(torch.equal(together[n], on_cpu[n]) for n in eights)


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="bitorder must be 'big' or 'little', got 'middle'"):
        pack_bits(BITS, bitorder="middle")
    with pytest.raises(ValueError, match="bitorder must be 'big' or 'little'"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 9, bitorder="LITTLE")
