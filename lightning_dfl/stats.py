"""Summary statistics of logged per-client values."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["mean_std"]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation of ``values`` (NaN, NaN for none).

    Plain left-to-right sums (not ``math.fsum``): the logged metrics of the golden runs depend on
    this exact arithmetic, so pass the values in a fixed order (e.g. by client).
    """
    if len(values) == 0:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
