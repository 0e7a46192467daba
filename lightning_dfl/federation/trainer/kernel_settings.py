"""How the worker's kernels run: the memory format of its model and batches, float32 matmul precision and
cuDNN's algorithm search.

Memory format: convolutions and pooling are faster with channels-last (NHWC) tensors on today's CPUs
(oneDNN's blocked kernels; measured on a 2-core AVX-512 CPU: a ``cnn_cifar`` training step 1.2x and a
512-image evaluation 1.9x faster, docs/performance.md) and on GPUs with tensor cores. ``"auto"`` chooses
channels-last for a model with 2-D convolutions, on every device, and leaves models without them alone.
It changes float rounding (other kernels), never the mathematics; ``"contiguous"`` keeps PyTorch's
default NCHW layout.

Float32 matmul precision: on an NVIDIA GPU with tensor cores (compute capability 8.0 and newer) ``"auto"``
sets ``torch.set_float32_matmul_precision("high")`` (TF32 matrix products), as Lightning recommends; on
other devices it leaves PyTorch's setting as it is.

cuDNN benchmark (``torch.backends.cudnn.benchmark``), as Lightning's ``Trainer(benchmark=...)``: ``None`` leaves
PyTorch's setting as it is (off unless set); ``True`` lets cuDNN time its convolution algorithms for every new
input shape and keep the fastest (the first batch of each size runs slower; the choice may differ between runs,
and with it float rounding); ``False`` uses its heuristics. Only cuDNN (NVIDIA GPUs) reads it.

The matmul precision and cuDNN's search are process-wide in PyTorch.

bfloat16 on a CPU: an x86 CPU without bfloat16 instructions (``avx512_bf16``, AMX) converts every bfloat16
operation in software; ``bf16-mixed`` ran about 9.5x slower than ``32-true`` on a 2-core avx2-only CPU, and
1.6x faster on one with ``avx512_bf16``. :func:`slow_bfloat16` says so before a run starts.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

MEMORY_FORMATS = ("auto", "channels_last", "contiguous")
MATMUL_PRECISIONS = ("auto", "highest", "high", "medium")


def check_memory_format(value: object) -> str:
    """``value`` if it is one of :data:`MEMORY_FORMATS`; else ValueError naming it and the allowed ones."""
    if value not in MEMORY_FORMATS:
        raise ValueError(f"memory_format must be one of {', '.join(MEMORY_FORMATS)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_matmul_precision(value: object) -> str:
    """``value`` if it is one of :data:`MATMUL_PRECISIONS`; else ValueError naming it and the allowed ones."""
    if value not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_benchmark(value: object) -> bool | None:
    """``value`` if it is ``None``, ``True`` or ``False``; else ValueError naming it and the allowed ones."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"benchmark must be true, false or null (None: leave cuDNN's setting as it is), got {value!r}")
    return value


def apply_benchmark(requested: bool | None) -> bool | None:
    """Set ``torch.backends.cudnn.benchmark`` to ``requested`` (process-wide); ``None`` leaves it as it is.
    Returns what was set."""
    check_benchmark(requested)
    if requested is not None:
        torch.backends.cudnn.benchmark = requested
    return requested


def resolve_memory_format(requested: str, model: nn.Module) -> torch.memory_format:
    """The layout for ``model``'s 4-D weights and input batches: ``"auto"`` is channels-last when the
    model has a 2-D convolution, else contiguous."""
    check_memory_format(requested)
    if requested == "auto":
        has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
        return torch.channels_last if has_conv else torch.contiguous_format
    return torch.channels_last if requested == "channels_last" else torch.contiguous_format


def apply_memory_format(model: nn.Module, memory_format: torch.memory_format) -> None:
    """Lay out ``model``'s 4-D parameters and buffers in ``memory_format``, in place (same Parameter objects,
    so masks, optimizers and views of the state dict stay bound)."""
    if memory_format is not torch.contiguous_format:
        model.to(memory_format=memory_format)


def input_converter(precision_convert: Callable[[Any], Any] | None,
                    memory_format: torch.memory_format) -> Callable[[Any], Any] | None:
    """What turns a batch ``(x, y, ...)`` into the worker's input: the precision plugin's dtype conversion
    (``None``: none) and a 4-D ``x`` in ``memory_format``; ``None`` when there is nothing to do."""
    if memory_format is torch.contiguous_format:
        return precision_convert

    def convert(batch: Any) -> Any:
        if precision_convert is not None:
            batch = precision_convert(batch)
        x = batch[0]
        if isinstance(x, Tensor) and x.dim() == 4:
            batch = (x.contiguous(memory_format=memory_format), *batch[1:])
        return batch

    return convert


def apply_matmul_precision(requested: str, device: torch.device) -> str | None:
    """Set float32 matmul precision for ``device`` (process-wide); return what was set (``None``: left as is).

    ``"auto"``: ``"high"`` (TF32) on a CUDA GPU with tensor cores (compute capability >= 8.0), else nothing.
    """
    check_matmul_precision(requested)
    if requested == "auto":
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
            return None
        requested = "high"
    torch.set_float32_matmul_precision(requested)
    return requested


def slow_bfloat16(precision: str, device: torch.device) -> str | None:
    """A warning when ``precision`` computes in bfloat16 (``bf16-mixed``, ``bf16-true``) on an x86 CPU whose
    instructions lack bfloat16 (neither ``avx512_bf16`` nor AMX, as PyTorch detects them), else ``None``."""
    if "bf16" not in str(precision) or device.type != "cpu":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None
    detectors = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(d is None for d in detectors) or any(d() for d in detectors):
        return None
    return (f"precision {precision!r} on this CPU, which has no bfloat16 instructions (avx512_bf16 or AMX): PyTorch "
            "converts every bfloat16 operation in software there (bf16-mixed ran about 9.5x slower than 32-true "
            "on such a CPU); precision '32-true' is the fast choice here")
