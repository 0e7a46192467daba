"""Numbers that stay on the device until the round reads them.

Reading a tensor's value on the host (``float(t)``, ``t.item()``, ``bool(t)``) waits until the device
has run everything queued before it; on a GPU, one such read per batch keeps the GPU idle between
batches. The local loop and the evaluations therefore accumulate their sums as 0-dim tensors on the
device, and the accounting reads all of a round's values at once (:func:`read_values`).

Sums are accumulated in float64 (float32 on Apple's MPS, which has no float64): the same IEEE
operations as Python's float arithmetic, so the values read are bit-identical to host-side sums.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

_device_paths_on_cpu = False


def host_reads_are_cheap(device: torch.device) -> bool:
    """Whether code may read values of tensors on ``device`` on the host without stalling anything (the
    CPU: its tensors are already there). Code with a host-side shortcut (e.g. NumPy's selection) takes it
    only then; on an accelerator it takes the path that never waits for the device."""
    return device.type == "cpu" and not _device_paths_on_cpu


@contextmanager
def device_paths_on_cpu() -> Iterator[None]:
    """Within this block, take the accelerators' paths on the CPU too: to test on a CPU that they give the
    same results and never read the device."""
    global _device_paths_on_cpu
    before, _device_paths_on_cpu = _device_paths_on_cpu, True
    try:
        yield
    finally:
        _device_paths_on_cpu = before


def accumulator_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a running sum on ``device``: float64, or float32 where the device has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def read_values(values: Sequence[object]) -> list[object]:
    """``values`` with every tensor replaced by its Python number (one transfer per device); other
    values are returned as they are."""
    out = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(out):
        if isinstance(value, Tensor):
            by_device.setdefault(value.device, []).append(i)
    for positions in by_device.values():
        stacked = torch.stack([out[i].detach().reshape(()).to(accumulator_dtype(out[i].device)) for i in positions])
        for i, number in zip(positions, stacked.tolist()):
            out[i] = number
    return out
