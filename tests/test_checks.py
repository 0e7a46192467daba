from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest

from lightning_dfl.checks import check_int, check_positive, is_int, is_number
from lightning_dfl.stats import mean_std

# ----------------------------------------------------------------------------- checks


@pytest.mark.parametrize("value", [0, -3, 10**20, np.int64(5), np.uint8(1)])
def test_integers(value):
    assert is_int(value) and is_number(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, "1", None, np.float64(2.0)])
def test_not_integers(value):
    assert not is_int(value)


def test_numbers_bool_and_non_finite():
    assert is_number(0.5) and is_number(np.float32(0.5)) and is_number(Fraction(1, 3))
    assert not is_number(True) and not is_number("0.5") and not is_number(None) and not is_number(1j)
    for value in (math.nan, math.inf, -math.inf, np.float64("nan")):
        assert not is_number(value)
        assert is_number(value, finite=False)


def test_check_int_returns_a_plain_int():
    assert check_int("k", np.int64(3), 1) == 3 and type(check_int("k", np.int64(3), 1)) is int
    assert check_int("k", 5) == 5 and check_int("k", 0, 0, 0) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("batch_size", 0, 1), "batch_size must be an integer >= 1, got 0"),
        (("batch_size", 2.5, 1), "batch_size must be an integer >= 1, got 2.5"),
        (("seed", True, 0), "seed must be an integer >= 0, got True"),
        (("verbose", 3, 0, 2), r"verbose must be an integer in \[0, 2\], got 3"),
        (("depth", 9, None, 8), "depth must be an integer <= 8, got 9"),
        (("k", "3"), "k must be an integer, got '3'"),
    ],
)
def test_check_int_names_the_value_and_the_range(args, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_int(*args)


# ----------------------------------------------------------------------------- stats


def test_mean_std_by_hand():
    assert mean_std([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) == (5.0, 2.0)
    assert mean_std([3.0]) == (3.0, 0.0)
    mean, std = mean_std([0.1, 0.2, 0.3])
    assert mean == (0.1 + 0.2 + 0.3) / 3  # plain left-to-right sum, as the golden runs were recorded
    assert std == pytest.approx(math.sqrt(2 / 300))


def test_mean_std_of_nothing_is_nan():
    mean, std = mean_std([])
    assert math.isnan(mean) and math.isnan(std)


def test_check_positive_names_the_value():
    assert check_positive("alpha", 2) == 2.0 and isinstance(check_positive("alpha", 2), float)
    for bad in (0, -1.5, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match=f"alpha must be a finite number > 0, got {re.escape(repr(bad))}"):
            check_positive("alpha", bad)
