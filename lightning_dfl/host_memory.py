"""The host's available memory, as the checks before large allocations read it (data sets, client stores,
checkpoints), and the one way their messages write a size: below every layer, so data modules and the
federation share one reading."""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_bytes", "format_bytes"]


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (``None`` where there is none: not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in words: ``'812 B'``, ``'5.3 KiB'``, ``'512.0 MiB'``, ``'11.44 GiB'``."""
    nbytes = int(nbytes)
    if nbytes < 1024:
        return f"{nbytes} B"
    power = min(3, (nbytes.bit_length() - 1) // 10)
    return f"{nbytes / 1024**power:.{2 if power == 3 else 1}f} {('KiB', 'MiB', 'GiB')[power - 1]}"
