"""The process's memory allocator, set up for training's allocation pattern.

Every training step and evaluation batch allocates the same large activation buffers and frees them
again. glibc's ``malloc`` serves a block above its mmap threshold (dynamic, at most 32 MiB on 64-bit
Linux) with a fresh ``mmap`` and unmaps it on ``free``, and gives the heap's free top back to the OS
above its trim threshold; the next batch then faults every page in again. On a 2-core CPU this was
41 million minor page faults and 90 s of system time in three ``cnn_cifar`` rounds, a third of the
round (docs/performance.md, "On by default"). :func:`tune_allocator` raises both thresholds with ``mallopt`` (what
the environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` do, set from inside
the process), so freed buffers stay in the heap and are reused.

:class:`~lightning_dfl.federation.trainer.trainer.FederatedTrainer` calls it when ``fit`` starts (``lightning-dfl
fit`` too), unless ``tune_allocator=False``. The setting is process-wide and cannot be undone; it has
no effect where the C library is not glibc (macOS, Windows, musl) or where malloc has been replaced
(jemalloc, tcmalloc through ``LD_PRELOAD``: those keep freed memory themselves).

:func:`release_heap` does the opposite, once: it gives the heap's free pages back to the OS (glibc's
``malloc_trim``), for the compact client store, whose small records lie between large temporaries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from dataclasses import dataclass
from typing import Any

#: ``mallopt`` parameters of glibc's ``<malloc.h>``
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: blocks up to this size come from the heap (activations of a 512-image evaluation batch are ~100 MB);
#: larger ones (the client store's stacked tensors) are still mapped and returned to the OS when freed
MMAP_THRESHOLD = 1 << 30
#: free memory at the heap's top kept for reuse before it is returned to the OS
TRIM_THRESHOLD = 1 << 30


@dataclass(frozen=True)
class AllocatorSetting:
    """What :func:`tune_allocator` did: ``applied`` and, when not, why."""

    applied: bool
    reason: str


_applied: AllocatorSetting | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or ``None`` where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_allocator(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> AllocatorSetting:
    """Keep freed buffers up to ``mmap_threshold`` bytes in the heap, and up to ``trim_threshold`` bytes
    of free heap top, instead of returning them to the OS (glibc only; idempotent, process-wide).

    Call it before the first large allocation for the full effect (later allocations are served by the
    new thresholds from then on). Returns what was done.
    """
    global _applied
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise ValueError(f"{name} must be a number of bytes in [1, 2^31 - 1], got {value!r}")
    libc = _glibc()
    if libc is None:
        return AllocatorSetting(False, f"the C library is {platform.libc_ver()[0] or platform.system()}, not glibc")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, mmap_threshold):
        return AllocatorSetting(False, f"glibc refused an mmap threshold of {mmap_threshold} bytes")
    if not mallopt(M_TRIM_THRESHOLD, trim_threshold):
        return AllocatorSetting(False, f"glibc refused a trim threshold of {trim_threshold} bytes")
    _applied = AllocatorSetting(True, f"glibc: mmap threshold {mmap_threshold} B, trim threshold {trim_threshold} B")
    return _applied


def _load_malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl, Windows)
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_heap() -> None:
    """Give freed heap pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere). A compact store's
    record is allocated between a task's temporaries, which glibc then keeps: without this the process's RSS
    grows by about the temporaries of every write (tens of MB per ResNet18 model) although the store is small."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def allocator_setting() -> AllocatorSetting | None:
    """What the last successful :func:`tune_allocator` set in this process (``None``: never called or failed)."""
    return _applied
