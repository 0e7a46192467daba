"""PSFL's optimal training structure: Eq. 8, Eq. 21 solved globally, the integer (W, S) (psfl-notes 1-4, 8)."""

import math

import numpy as np
import pytest

from lightning_dfl.federation.algorithms.psfl_structure import (
    optimal_parallel_width,
    psfl_constants,
    psfl_objective,
    training_structure,
)

# psfl-notes errata 4: the constants that reproduce Table I's W column.
TABLE_I = dict(sigma2=1.0, B=0.4255, t_mean=2.5, kappa2=1.0, c0=0.1)
TABLE_I_W = {10: 4.597, 20: 5.744, 50: 7.649, 100: 9.476, 200: 11.730}
# Table I's experimental (S, W): S W = 9, 20, 49, 100, 200.
TABLE_I_EXPERIMENT = {10: (3, 3), 20: (4, 5), 50: (7, 7), 100: (10, 10), 200: (25, 8)}
# psfl-notes errata 3: an interior local minimum that is not the global one.
COUNTEREXAMPLE = dict(n0=20, sigma2=1.0, B=0.0, t_mean=0.3, kappa2=1.0, c0=0.1)


def test_constants_eq8():
    c0, sigma2, B, n0 = 0.1, 1.0, 0.4255, 20
    alpha, beta = psfl_constants(sigma2, B, n0, c0)
    assert alpha == pytest.approx((4 * c0 * (1 + 2 * c0) * (sigma2 + B) / (1 - 2 * c0**2) + 4 * B) / n0)
    assert beta == pytest.approx(4 * sigma2 / n0)
    assert psfl_constants(0.0, 0.0, 5, 0.1) == (0.0, 0.0)


def test_objective_eq21_by_hand():
    alpha, beta = psfl_constants(1.0, 0.4255, 20, 0.1)
    w = 5.0
    by_hand = alpha * math.sqrt(2 * 20 * w * math.log(w)) + beta * (20 * 2.5 / w + math.sqrt(2 * 20 * math.log(w) / w))
    assert psfl_objective(w, 20, **TABLE_I) == pytest.approx(by_hand, rel=1e-12)
    # J(1) = beta N0 tbar: both square roots vanish.
    assert psfl_objective(1.0, 20, **TABLE_I) == pytest.approx(beta * 20 * 2.5)


@pytest.mark.parametrize("n0", sorted(TABLE_I_W))
def test_table_i_oracle(n0):
    assert optimal_parallel_width(n0, **TABLE_I) == pytest.approx(TABLE_I_W[n0], abs=0.01)


def test_solution_is_a_stationary_minimum():
    n0 = 50
    w = optimal_parallel_width(n0, **TABLE_I)
    j = psfl_objective(w, n0, **TABLE_I)
    for dw in (1e-3, 1e-2, 1e-1):
        assert psfl_objective(w - dw, n0, **TABLE_I) >= j
        assert psfl_objective(w + dw, n0, **TABLE_I) >= j


def test_counterexample_interior_local_minimum_is_not_global():
    params = {k: v for k, v in COUNTEREXAMPLE.items() if k != "n0"}
    n0 = COUNTEREXAMPLE["n0"]
    grid = np.linspace(1.0, n0, 1_901)
    values = np.array([psfl_objective(w, n0, **params) for w in grid])
    interior = np.flatnonzero((values[1:-1] < values[:-2]) & (values[1:-1] < values[2:])) + 1
    assert len(interior) == 1
    assert grid[interior[0]] == pytest.approx(5.30, abs=0.01)
    assert values[interior[0]] == pytest.approx(1.396, abs=1e-3)
    assert values[0] == pytest.approx(1.2)  # J(1) < J(5.30): W = 1 is the global minimum
    assert optimal_parallel_width(**COUNTEREXAMPLE) == 1.0


def test_w_one_is_always_a_local_minimum():
    # J'(1+) = +inf (errata 3): J rises just right of 1 even where W* is interior.
    assert psfl_objective(1.0 + 1e-6, 20, **TABLE_I) > psfl_objective(1.0, 20, **TABLE_I)


@pytest.mark.parametrize("B", [10.0, 1e3, 1e6])
def test_large_heterogeneity_gives_sequential(B):
    # Case 1 (Eq. 22): B -> inf makes alpha / beta -> inf, W* = 1 (SFL).
    assert optimal_parallel_width(50, 1.0, B, 2.5, 1.0) == 1.0


def test_zero_noise_and_heterogeneity_ties_to_one():
    assert optimal_parallel_width(50, 0.0, 0.0, 2.5, 1.0) == 1.0  # J == 0: the smallest minimiser


def test_pure_noise_prefers_width():
    # B = 0, slow mean time and little spread: the beta N0 tbar / W term dominates, W* grows.
    assert optimal_parallel_width(20, 1.0, 0.0, 100.0, 0.01) > optimal_parallel_width(20, 1.0, 0.0, 2.5, 1.0) > 1.0


@pytest.mark.parametrize("a", [1e-3, 0.5, 7.0, 60.0])
def test_time_unit_invariance(a):
    for n0 in (20, 100):
        base = optimal_parallel_width(n0, **TABLE_I)
        scaled = optimal_parallel_width(n0, 1.0, 0.4255, 2.5 * a, 1.0 * a * a, 0.1)
        assert scaled == pytest.approx(base, abs=1e-6)


@pytest.mark.parametrize("scale", [1e-4, 0.3, 25.0])
def test_noise_and_heterogeneity_scale_invariance(scale):
    for n0 in (20, 100):
        base = optimal_parallel_width(n0, **TABLE_I)
        scaled = optimal_parallel_width(n0, 1.0 * scale, 0.4255 * scale, 2.5, 1.0, 0.1)
        assert scaled == pytest.approx(base, abs=1e-6)


def test_result_in_range_and_single_client():
    assert optimal_parallel_width(1, **TABLE_I) == 1.0
    assert 1.0 <= optimal_parallel_width(2, **TABLE_I) <= 2.0
    big = optimal_parallel_width(100_000, **TABLE_I)
    assert 1.0 <= big <= 100_000


@pytest.mark.parametrize("n0", sorted(TABLE_I_EXPERIMENT))
def test_training_structure_reproduces_table_i_experiments(n0):
    s, w = TABLE_I_EXPERIMENT[n0]
    assert training_structure(n0, float(w)) == (w, s)


def test_training_structure_products():
    products = [math.prod(training_structure(n0, float(w))) for n0, (_, w) in sorted(TABLE_I_EXPERIMENT.items())]
    assert products == [9, 20, 49, 100, 200]


def test_training_structure_rounding_and_clamping():
    assert training_structure(20, 5.744) == (6, 3)
    assert training_structure(20, 4.5) == (5, 4)  # halves round up
    assert training_structure(20, 0.2) == (1, 20)  # clamped to 1: SFL
    assert training_structure(20, 35.0) == (20, 1)  # clamped to N0: FedAvg
    for n0 in (1, 7, 50, 200):
        for w_star in np.linspace(0.5, n0 + 1, 23):
            w, s = training_structure(n0, float(w_star))
            assert 1 <= w <= n0 and s == n0 // w and w * s <= n0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n0=0), "n0"),
        (dict(n0=2.5), "n0"),
        (dict(sigma2=-1.0), "sigma2"),
        (dict(sigma2=math.nan), "sigma2"),
        (dict(B=-0.1), "B"),
        (dict(t_mean=0.0), "t_mean"),
        (dict(t_mean=-2.0), "t_mean"),
        (dict(kappa2=0.0), "kappa2"),
        (dict(kappa2=math.inf), "kappa2"),
        (dict(c0=0.0), "c0"),
        (dict(c0=0.2), "c0"),
        (dict(c0=0.5), "c0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, name):
    args = dict(n0=20, **TABLE_I)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{name} "):
        optimal_parallel_width(**args)
    with pytest.raises(ValueError, match=rf"^{name} "):
        psfl_objective(1.5, **args)


def test_bad_structure_and_objective_arguments():
    with pytest.raises(ValueError, match="^w "):
        psfl_objective(0.5, 20, **TABLE_I)
    with pytest.raises(ValueError, match="^w "):
        psfl_objective(21.0, 20, **TABLE_I)
    with pytest.raises(ValueError, match="^n0 "):
        training_structure(0, 3.0)
    with pytest.raises(ValueError, match="^w_star "):
        training_structure(20, math.nan)
    with pytest.raises(ValueError, match="^w_star "):
        training_structure(20, 0.0)
