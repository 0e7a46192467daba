"""Whether a federation's client store fits in this machine's memory, checked before it is allocated.

The dense store takes, per node, two float slots of the model and three boolean masks (100 CIFAR
ResNet18 clients: 11.44 GiB): a run that cannot hold it should say so before the first allocation
(rather than be ended by the kernel's out-of-memory killer mid set-up) and point to ``store:
compact``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

GIB = 2**30


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (``None`` where there is none: not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def dense_store_bytes(template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int) -> int:
    """The dense store's weights and masks: per node two slots of ``template`` and three bool masks."""
    weights = sum(t.numel() * t.element_size() for t in template.values())
    masked = sum(template[n].numel() for n in masked_names)
    return num_nodes * (2 * weights + 3 * masked)


def compact_store_bytes(template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                        density: float) -> int:
    """About what the compact store holds between rounds: per node the active values at ``density``, the
    unmasked tensors and two packed masks (within a round, up to twice the records)."""
    masked = set(masked_names)
    values = sum(t.numel() * t.element_size() * (density if n in masked else 1.0) for n, t in template.items())
    bits = sum(template[n].numel() for n in masked_names) // 4
    return int(num_nodes * (values + bits))


def check_store_fits(kind: str, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                     density: float, device: torch.device | str, processes: int = 1) -> None:
    """Raise ``MemoryError`` when the dense store on the CPU, once per process of this machine
    (``processes``: sharded runs hold a copy each), needs more than the available memory, naming the sizes
    and the compact store's estimate; nothing for the compact store, a GPU or an unknown size."""
    if kind != "dense" or torch.device(device).type != "cpu":
        return
    need, available = processes * dense_store_bytes(template, masked_names, num_nodes), available_bytes()
    if available is None or need <= available:
        return
    compact = processes * compact_store_bytes(template, masked_names, num_nodes, density)
    copies = f" ({processes} processes, a copy each)" if processes > 1 else ""
    raise MemoryError(
        f"the dense client store of {num_nodes} nodes needs {_size(need)}{copies} but only {_size(available)} of "
        f"memory are available: set trainer.store: compact (about {_size(compact)} between rounds at density "
        f"{density:.2f}, up to twice that within a round), or use fewer clients")
