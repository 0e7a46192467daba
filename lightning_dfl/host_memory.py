"""The host's available memory, as the checks before large allocations read it (data sets, client stores,
checkpoints): below every layer, so data modules and the federation share one reading."""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_bytes"]


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (``None`` where there is none: not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
