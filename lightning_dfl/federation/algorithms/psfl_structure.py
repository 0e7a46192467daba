"""PSFL's optimal training structure (Sec. V-B): the constants of Eq. 8 (:func:`psfl_constants`), the
objective of Eq. 21 (:func:`psfl_objective`), its global minimiser ``W*``
(:func:`optimal_parallel_width`) and the integer ``(W, S)`` (:func:`training_structure`), with the
errata and decisions of ``docs/psfl.md``. Pure computation (numpy and the standard library).
"""

from __future__ import annotations

import math

import numpy as np

from lightning_dfl.checks import check_int, is_number

__all__ = ["optimal_parallel_width", "psfl_constants", "psfl_objective", "training_structure"]

# ---------------------------------------------------------------------------------------------
# PSFL's optimal training structure: Eq. 8, Eq. 21, psfl-notes errata 1-4 and decision 8
# ---------------------------------------------------------------------------------------------

_PSFL_GRID_POINTS = 2048  # points of each of the log-spaced and linear grids over [1, N0]
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_GOLDEN_TOL = 1e-10


def _check_real(name: str, value: object, lower: float, *, strict: bool, upper: float | None = None) -> float:
    """``value`` as a float if it is a finite real above ``lower`` (``>`` when ``strict``) and below ``upper``."""
    ok = is_number(value) and (value > lower if strict else value >= lower) and (upper is None or value < upper)
    if not ok:
        bound = f"{'>' if strict else '>='} {lower}" if upper is None else f"in ({lower}, {upper})"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


def psfl_constants(sigma2: float, B: float, n0: int, c0: float) -> tuple[float, float]:
    """``(alpha, beta)`` of PSFL's convergence bound, Eq. 8 (Theorem 1) as psfl-notes write it.

    ``alpha = [4 c0 (1 + 2 c0) (sigma^2 + B) / (1 - 2 c0^2) + 4 B] / N0`` and ``beta = 4 sigma^2 / N0``,
    for ``0 < c0 < 1/5``. (The bound's ``b = (16c0^3 - 28c0^2 - 24c0 + 6) / (3 (1 - 2c0^2))`` scales both
    of its terms alike and does not enter Eq. 21.)
    """
    sigma2 = _check_real("sigma2", sigma2, 0.0, strict=False)
    B = _check_real("B", B, 0.0, strict=False)
    n0 = check_int("n0", n0, 1)
    c0 = _check_real("c0", c0, 0.0, strict=True, upper=0.2)
    alpha = (4.0 * c0 * (1.0 + 2.0 * c0) * (sigma2 + B) / (1.0 - 2.0 * c0 ** 2) + 4.0 * B) / n0
    beta = 4.0 * sigma2 / n0
    return alpha, beta


def _psfl_j(w: np.ndarray, n0: int, alpha: float, beta: float, t_mean: float, kappa2: float) -> np.ndarray:
    """Eq. 21 for an array of ``w >= 1`` (no checks)."""
    log_w = np.log(w)
    return (alpha * np.sqrt(2.0 * kappa2 * n0 * w * log_w)
            + beta * (n0 * t_mean / w + np.sqrt(2.0 * kappa2 * n0 * log_w / w)))


def _check_psfl(n0: int, sigma2: float, B: float, t_mean: float, kappa2: float,
                c0: float) -> tuple[int, float, float, float, float]:
    """Validate Eq. 21's arguments; returns ``(n0, alpha, beta, t_mean, kappa2)``."""
    alpha, beta = psfl_constants(sigma2, B, n0, c0)
    t_mean = _check_real("t_mean", t_mean, 0.0, strict=True)
    kappa2 = _check_real("kappa2", kappa2, 0.0, strict=True)
    return int(n0), alpha, beta, t_mean, kappa2


def psfl_objective(w: float, n0: int, sigma2: float, B: float, t_mean: float, kappa2: float, c0: float) -> float:
    """``J(W)`` of Eq. 21 (natural log), the full expression (errata 1-2 keep ``sqrt(ln W / W)``)::

        J(W) = alpha sqrt(2 kappa^2 N0 W ln W) + beta (N0 tbar / W + sqrt(2 kappa^2 N0 ln W / W))

    with ``(alpha, beta)`` from :func:`psfl_constants`, ``tbar = t_mean`` the mean client time and
    ``kappa^2 = kappa2`` the time variance; ``w`` is real in ``[1, n0]``.
    """
    n0, alpha, beta, t_mean, kappa2 = _check_psfl(n0, sigma2, B, t_mean, kappa2, c0)
    w = _check_real("w", w, 1.0, strict=False)
    if w > n0:
        raise ValueError(f"w must lie in [1, n0={n0}], got {w!r}")
    return float(_psfl_j(np.array(w), n0, alpha, beta, t_mean, kappa2))


def optimal_parallel_width(n0: int, sigma2: float, B: float, t_mean: float, kappa2: float,
                           c0: float = 0.1) -> float:
    """The real ``W*`` in ``[1, n0]`` that minimises Eq. 21's :func:`psfl_objective` globally.

    ``J'(1+) = +inf``, so ``W = 1`` is always a local minimum and an interior local minimum need not
    be the global one (errata 3): ``J`` is evaluated on a dense grid over ``[1, n0]`` (log-spaced and
    linear), a golden-section search refines between the best grid point's neighbours, and the
    result is compared with the best grid point and both end points. Ties go to the smaller ``W``
    (``sigma2 = B = 0`` makes ``J`` vanish and gives 1). ``W*`` depends only on ``n0``,
    ``t_mean / sqrt(kappa2)`` and ``alpha / beta``.

    Example: ``optimal_parallel_width(20, 1.0, 0.4255, 2.5, 1.0)`` is ``5.7435...`` (Table I).
    """
    n0, alpha, beta, t_mean, kappa2 = _check_psfl(n0, sigma2, B, t_mean, kappa2, c0)
    if n0 == 1:
        return 1.0

    def j(w: np.ndarray | float) -> np.ndarray:
        return _psfl_j(np.asarray(w, dtype=np.float64), n0, alpha, beta, t_mean, kappa2)

    grid = np.unique(np.clip(np.concatenate([np.geomspace(1.0, n0, _PSFL_GRID_POINTS),
                                             np.linspace(1.0, n0, _PSFL_GRID_POINTS)]), 1.0, n0))
    values = j(grid)
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
    # Golden section on [lo, hi]; J is smooth there at the grid's resolution.
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = float(j(x1)), float(j(x2))
    while hi - lo > _GOLDEN_TOL * max(1.0, abs(lo)):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - _GOLDEN * (hi - lo)
            f1 = float(j(x1))
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + _GOLDEN * (hi - lo)
            f2 = float(j(x2))
    refined = (x1, f1) if f1 <= f2 else (x2, f2)
    candidates = [(1.0, float(values[0])), (float(grid[best]), float(values[best])), refined,
                  (float(n0), float(values[-1]))]
    return min(candidates, key=lambda c: (c[1], c[0]))[0]


def training_structure(n0: int, w_star: float) -> tuple[int, int]:
    """The integer structure ``(W, S)`` of psfl-notes decision 8: ``W = clamp(round(W*), 1, N0)``,
    ``S = floor(N0 / W)``, so ``S W <= N0`` (rounding ``S*`` and ``W*`` apart can exceed it, errata 7).

    Halves round up. Example: ``training_structure(50, 7.0)`` is ``(7, 7)`` (Table I's experiment).
    """
    n0 = check_int("n0", n0, 1)
    w_star = _check_real("w_star", w_star, 0.0, strict=True)
    width = min(max(math.floor(w_star + 0.5), 1), n0)
    return width, n0 // width
