"""DA-DPFL's pruning time (Eq. 4-6): the detection score, the vote, the first pruning round t* and the
pruning rounds after it.

Pure computation (the standard library only), below the federation and the callbacks: the voting
and PQI callbacks (:mod:`lightning_dfl.callbacks.voting`) call it, the CLI prints its schedules. The
papers' errata are applied:

* detection score, Eq. 4: ``|Delta_t - Delta_(t-1)| / |Delta_1|`` with ``Delta_t = ||w^t - w^0||^2``;
* vote, Eq. 5: 1 ("stable") when the score is below ``delta_pr``;
* first pruning time: ``t* = min{t : mean vote >= delta_v}`` (the printed ``<`` is an erratum);
* pruning rounds, Eq. 6: ``t_1 = max(t* + b, t* + 1)``, ``t_p = t_(p-1) + I_p`` with
  ``I_p = ceil((t* + b) / c^(p-1))`` (never below 1), while ``t_p < T``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from lightning_dfl.checks import check_int

__all__ = ["PruningSchedule", "detection_score", "first_pruning_round", "pruning_rounds", "vote"]

# ---------------------------------------------------------------------------------------------
# When to prune: Eq. 4-6
# ---------------------------------------------------------------------------------------------

_CEIL_EPS = 1e-9  # ceil() slack for ratios that are integers in exact arithmetic


def pruning_rounds(t_star: int, total_rounds: int, b: float = 0.0, c: float = 1.3) -> list[int]:
    """The pruning rounds ``T`` of Eq. 6, as the papers' errata fixes them.

    ``t_1 = max(ceil(t* + b), t* + 1)`` (``t*`` is known only when round ``t*`` ends), then
    ``t_p = t_(p-1) + I_p`` with ``I_p = max(ceil((t* + b) / c^(p-1)), 1)``, for as long as
    ``t_p < total_rounds``. With ``c > 1`` the gaps shrink, so late rounds may prune every round.

    Example: ``pruning_rounds(10, 50)`` is ``[11, 19, 25, 30, 34, 37, 40, 42, 44, 45, 46, 47, 48, 49]``.
    """
    check_int("t_star", t_star, 0)
    check_int("total_rounds", total_rounds, 1)
    if not (math.isfinite(b) and b >= 0):
        raise ValueError(f"b (delay of the first pruning round) must be >= 0, got {b!r}")
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"c (pruning frequency scale) must be > 0, got {c!r}")
    base = t_star + b
    rounds: list[int] = []
    t = max(math.ceil(base - _CEIL_EPS), t_star + 1)
    p = 1
    while t < total_rounds:
        rounds.append(t)
        p += 1
        try:
            scale = c ** (p - 1)
        except OverflowError:  # c > 1 over thousands of events: the gap is 0, floored to 1
            scale = math.inf
        if base == 0:
            gap = 0.0
        elif scale == 0.0:  # c < 1 underflowed: the gap is beyond any horizon
            break
        else:
            gap = base / scale
        t += max(math.ceil(gap - _CEIL_EPS), 1)
    return rounds


@dataclass(frozen=True)
class PruningSchedule:
    """The pruning rounds of Eq. 6 for a known ``t*``; ``round in schedule`` tests membership."""

    t_star: int
    total_rounds: int
    b: float = 0.0
    c: float = 1.3
    rounds: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", tuple(pruning_rounds(self.t_star, self.total_rounds,
                                                                self.b, self.c)))

    def __contains__(self, round_index: object) -> bool:
        return round_index in self.rounds

    def __iter__(self) -> Iterator[int]:
        return iter(self.rounds)

    def __len__(self) -> int:
        return len(self.rounds)


def detection_score(delta_t: float, delta_prev: float, delta_first: float) -> float:
    """Eq. 4: ``|Delta_t - Delta_(t-1)| / |Delta_1|``, each ``Delta = ||w - w^0||^2``.

    When ``Delta_1`` is 0 the score is 0 if nothing changed either, else ``inf`` (not stable).
    A NaN input gives NaN, which :func:`vote` counts as "not stable".
    """
    for name, value in (("delta_t", delta_t), ("delta_prev", delta_prev), ("delta_first", delta_first)):
        if value < 0:
            raise ValueError(f"{name} is a squared distance and must be >= 0, got {value!r}")
    numerator = abs(delta_t - delta_prev)
    denominator = abs(delta_first)
    if denominator == 0:
        if numerator == 0:
            return 0.0
        return math.nan if math.isnan(numerator) else math.inf
    return numerator / denominator


def vote(score: float, delta_pr: float) -> int:
    """Eq. 5: 1 ("stable") when ``score < delta_pr``, else 0 (also for a NaN score)."""
    if not (math.isfinite(delta_pr) and delta_pr > 0):
        raise ValueError(f"delta_pr (pruning threshold) must be > 0, got {delta_pr!r}")
    return 1 if score < delta_pr else 0


def first_pruning_round(vote_shares: Sequence[float], delta_v: float, first_round: int = 1) -> int | None:
    """``t* = min{t : share_t >= delta_v}`` (errata: ">=", a vote of 1 means stable).

    ``vote_shares[i]`` is the mean vote of round ``first_round + i``; returns that round, or
    None when no round reaches ``delta_v``.
    """
    if not (math.isfinite(delta_v) and 0 <= delta_v <= 1):
        raise ValueError(f"delta_v (voting threshold) must lie in [0, 1], got {delta_v!r}")
    for i, share in enumerate(vote_shares):
        if not 0 <= share <= 1:
            raise ValueError(f"vote share of round {first_round + i} must lie in [0, 1], got {share!r}")
        if share >= delta_v:
            return first_round + i
    return None
