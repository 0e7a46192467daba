"""The host's available memory, as the checks before large allocations read it (data sets, client stores,
checkpoints), and the one way their messages write a size: below every layer, so data modules and the
federation share one reading."""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_bytes", "cgroup_headroom", "format_bytes"]


MEMINFO = Path("/proc/meminfo")
#: the cgroup's limit and use, v2 then v1 (a container's or a batch job's: the kernel kills past the limit, whatever
#: the host has free)
CGROUP_FILES = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
#: a v1 cgroup without a limit reports about this much (the largest page-aligned signed 64-bit value)
_NO_LIMIT = 1 << 60


def _meminfo() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom() -> int | None:
    """Bytes the process's cgroup may still use (its limit less its use), ``None`` without a limit."""
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= _NO_LIMIT:
                return None
            return max(0, int(limit) - int(usage_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_bytes() -> int | None:
    """The memory a large allocation may take now: ``MemAvailable`` of ``/proc/meminfo``, or the cgroup's headroom
    (:func:`cgroup_headroom`) where that is less; ``None`` where neither is known (not Linux)."""
    known = [b for b in (_meminfo(), cgroup_headroom()) if b is not None]
    return min(known) if known else None


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in words: ``'812 B'``, ``'5.3 KiB'``, ``'512.0 MiB'``, ``'11.44 GiB'``."""
    nbytes = int(nbytes)
    if nbytes < 1024:
        return f"{nbytes} B"
    power = min(3, (nbytes.bit_length() - 1) // 10)
    return f"{nbytes / 1024**power:.{2 if power == 3 else 1}f} {('KiB', 'MiB', 'GiB')[power - 1]}"
