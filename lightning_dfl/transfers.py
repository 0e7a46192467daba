"""Copies between host and device memory that overlap where they can and are all done when they return.

A copy between pinned (page-locked) host memory and a CUDA device can be queued (``non_blocking=True``)
while the host goes on; :func:`copy_all_` queues every such copy of a batch and waits for them once, so
that no caller reads a destination or overwrites a source before its copy is done. The client store
(:mod:`lightning_dfl.federation.store`) and the worker's mask (:mod:`lightning_dfl.sparse.masks`) copy
through it.

A copy from ordinary (pageable) host memory to a CUDA device is the opposite: PyTorch waits for everything
queued on the device before it returns (``cudaStreamSynchronize``). :func:`to_device` stages such uploads
(a client's data, a batch's random draws, a few indices) in pinned memory and queues them, so the host never
waits for the device to upload.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

#: device types whose copies from and to pinned host memory run asynchronously
ASYNC_DEVICE_TYPES = ("cuda",)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (the asynchronous copies among it)."""
    getattr(torch, device.type).current_stream(device).synchronize()


def to_device(tensor: Tensor, device: torch.device | str | None) -> Tensor:
    """``tensor.to(device)`` (``None``: where it is), without waiting for the device: a host tensor bound for a
    CUDA device is copied into pinned memory and its upload queued (``non_blocking``; PyTorch's pinned-memory
    allocator keeps that buffer until the upload is done, and later work on the device's stream sees it done)."""
    if device is None:
        return tensor
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type in ASYNC_DEVICE_TYPES:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _asynchronous(dst: Tensor, src: Tensor) -> torch.device | None:
    """The accelerator of a copy that may run asynchronously (between pinned host memory and a CUDA device),
    else ``None``."""
    if dst.device.type == "cpu" and src.device.type in ASYNC_DEVICE_TYPES and dst.is_pinned():
        return src.device
    if src.device.type == "cpu" and dst.device.type in ASYNC_DEVICE_TYPES and src.is_pinned():
        return dst.device
    return None


def copy_all_(pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, each finished when this returns.

    A copy between pinned host memory and a GPU (either way) is queued with ``non_blocking=True`` and the
    GPU's stream is synchronized once after the last: the copies overlap, and no caller reads a destination
    or overwrites a source (a pinned one the host could change) before its copy is done. Every other copy is
    ``copy_``'s ordinary one (synchronous across devices); the copies within one device run together
    (``torch._foreach_copy_``: on a CPU the same ``copy_`` per pair). The destinations must not overlap the
    sources.
    """
    pending: set[torch.device] = set()
    local: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
    for dst, src in pairs:
        if dst.device == src.device:  # copied together below, per device (one multi-tensor copy on a GPU)
            dsts, srcs = local.setdefault(dst.device, ([], []))
            dsts.append(dst)
            srcs.append(src)
            continue
        device = _asynchronous(dst, src)
        if device is None:
            dst.copy_(src)
        else:
            dst.copy_(src, non_blocking=True)
            pending.add(device)
    for dsts, srcs in local.values():
        torch._foreach_copy_(dsts, srcs)
    for device in pending:
        synchronize(device)
