"""Where a federation's client store lives and whether it fits there, decided before it is allocated.

The dense store takes, per node, two float slots of the model and three boolean masks (100 CIFAR
ResNet18 clients: 11.44 GiB): a run that cannot hold it should say so before the first allocation
(rather than be ended by the kernel's out-of-memory killer mid set-up) and point to ``store:
compact``.

``FederatedTrainer(store_device=...)`` places the store (:func:`resolve_store_device`): on the CPU, on
the worker's device, or (``"auto"``, the default) on the worker's GPU when the store fits in its free
memory with room left for training, else on the CPU. A CPU store serving a GPU worker is allocated in
pinned memory (:func:`pin_store_memory`), and the copies between the two go through :func:`copy_all_`:
asynchronous where that is safe, every copy finished when it returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from math import prod
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.host_memory import available_bytes, format_bytes
from lightning_dfl.transfers import ASYNC_DEVICE_TYPES

GIB = 2**30

#: the values of ``FederatedTrainer(store_device=...)``
STORE_DEVICES = ("auto", "cpu", "worker")
#: ``store_device="auto"`` leaves this share of the GPU's free memory to the worker (activations, optimizer
#: state, the aggregation's and the compact store's temporaries, the allocator's fragmentation) ...
AUTO_KEEP_FRACTION = 0.25
#: ... and at least this much (a small GPU's 25% would not hold a ResNet18's activations at batch 128)
AUTO_KEEP_MIN_BYTES = 2 * GIB


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


def check_least_store_fits(kind: str, on_cpu: bool, parameters: int, num_nodes: int, machines: int = 1) -> None:
    """Before the data is loaded and the model built: raise ``MemoryError`` when the dense store on the CPU could
    not fit even at its least, two float32 copies of a model of ``parameters`` parameters per node (masks and
    other dtypes left out) for this machine's share of ``num_nodes`` nodes; :func:`check_store_fits` checks the
    exact size once the model is built."""
    if kind != "dense" or not on_cpu:
        return
    nodes = -(-num_nodes // machines)
    need, available = nodes * 2 * 4 * parameters, available_bytes()
    if available is None or need <= available:
        return
    raise MemoryError(
        f"the dense client store of {nodes} nodes needs at least {format_bytes(need)} (two float32 copies of the "
        f"model's {parameters:,} parameters per node) but only {format_bytes(available)} of memory are available: "
        "set trainer.store: compact for a sparse model, or choose a smaller model (model_options, image_size) or "
        "fewer clients; refused before the data is loaded")


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
        f"the dense client store of {num_nodes} nodes needs {format_bytes(need)}{copies} but only "
        f"{format_bytes(available)} of "
        f"memory are available: set trainer.store: compact (about {format_bytes(compact)} between rounds at density "
        f"{density:.2f}, up to twice that within a round), or use fewer clients")


# -- where the store lives ------------------------------------------------------------------------


def check_store_device(value: Any) -> str:
    """``value`` if it is a ``store_device``, else ``ValueError`` naming it and the allowed values."""
    if value not in STORE_DEVICES:
        raise ValueError(f"store_device must be one of {', '.join(repr(d) for d in STORE_DEVICES)}, got {value!r}")
    return value


def fields_bytes(fields: Iterable[Any], template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int) -> int:
    """The declared per-node fields (:class:`~lightning_dfl.federation.store.fields.StateField`), as the store
    allocates them: one tensor per floating entry (``like="weights"``) or per masked one (``like="mask"``), else
    one of ``shape``; two slots when published."""
    total = 0
    for spec in fields:
        if spec.like == "weights":
            parts = [(t.numel(), spec.dtype or t.dtype) for t in template.values() if t.is_floating_point()]
        elif spec.like == "mask":
            parts = [(template[n].numel(), spec.dtype) for n in masked_names]
        else:
            parts = [(prod(spec.shape), spec.dtype)]
        total += (2 if spec.published else 1) * num_nodes * sum(numel * dtype.itemsize for numel, dtype in parts)
    return total


def store_bytes(kind: str, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int, density: float,
                fields: Iterable[Any] = ()) -> int:
    """The most a store of ``kind`` holds: the dense store's slots and masks, or the compact store's records
    within a round (twice those between rounds), plus the declared fields."""
    if kind == "dense":
        records = dense_store_bytes(template, masked_names, num_nodes)
    else:
        records = 2 * compact_store_bytes(template, masked_names, num_nodes, density)
    return records + fields_bytes(fields, template, masked_names, num_nodes)


def accelerator_free_bytes(device: torch.device | str) -> int:
    """Free memory of a CUDA ``device`` (``torch.cuda.mem_get_info``); with several processes, the least
    any of them has, so that every process places its store alike (a sharded run broadcasts between stores)."""
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        least = torch.tensor([free], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        free = int(least.item())
    return free


def resolve_store_device(requested: str, worker_device: torch.device | str, estimate_bytes: int,
                         free_bytes: int | None = None) -> tuple[torch.device, str]:
    """Where the client store lives, and why in one line.

    ``"cpu"``: the CPU. ``"worker"``: the worker's device. ``"auto"``: the worker's device when it is a CUDA
    GPU and the store (``estimate_bytes``, see :func:`store_bytes`) fits in its free memory (``free_bytes``;
    measured with :func:`accelerator_free_bytes` when ``None``) less what is kept for training: a quarter of
    the free memory (:data:`AUTO_KEEP_FRACTION`), at least 2 GiB (:data:`AUTO_KEEP_MIN_BYTES`); else the
    CPU. Another value raises ``ValueError``.
    """
    check_store_device(requested)
    worker = torch.device(worker_device)
    if requested == "cpu":
        return torch.device("cpu"), "store_device is 'cpu'"
    if requested == "worker":
        return worker, "store_device is 'worker'"
    if worker.type != "cuda":
        return torch.device("cpu"), f"the worker is on the {worker.type}, not a GPU"
    free = accelerator_free_bytes(worker) if free_bytes is None else free_bytes
    keep = max(AUTO_KEEP_FRACTION * free, AUTO_KEEP_MIN_BYTES)
    sizes = (f"{format_bytes(estimate_bytes)} for {format_bytes(free)} free, {format_bytes(keep)} of it kept for "
             "training")
    if estimate_bytes <= free - keep:
        return worker, f"the client store fits in {worker}'s memory ({sizes})"
    return torch.device("cpu"), f"the client store does not fit in {worker}'s memory ({sizes})"


def pin_store_memory(store_device: torch.device | str, worker_device: torch.device | str, estimate_bytes: int,
                     processes: int = 1) -> bool:
    """Whether a store on the CPU serving a GPU worker is allocated in pinned (page-locked) memory, so that
    :func:`copy_all_` runs its copies asynchronously. Pinned memory cannot be swapped and torch's host
    allocator rounds each block up to a power of two: only when twice the estimate, once per process of this
    machine, fits in the available memory (or that is unknown); else pageable (the copies are then synchronous)."""
    if torch.device(store_device).type != "cpu" or torch.device(worker_device).type not in ASYNC_DEVICE_TYPES:
        return False
    available = available_bytes()
    return available is None or 2 * processes * estimate_bytes <= available
