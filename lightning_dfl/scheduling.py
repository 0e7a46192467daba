"""DA-DPFL's schedules: when to prune (Eq. 4-6) and who waits for whom (Sec. IV-B).

Pure computation (numpy and the standard library; below the federation, which it never imports:
its clock, ``lightning_dfl.federation.clock``, builds on :func:`finish_times` and is passed in as a
:class:`ComputeTimes`): the federation's planner and the voting and pruning callbacks call these
functions; the CLI prints :func:`format_schedule_table`.

Pruning time (papers' errata applied):

* detection score, Eq. 4: ``|Delta_t - Delta_(t-1)| / |Delta_1|`` with ``Delta_t = ||w^t - w^0||^2``;
* vote, Eq. 5: 1 ("stable") when the score is below ``delta_pr``;
* first pruning time: ``t* = min{t : mean vote >= delta_v}``;
* pruning rounds, Eq. 6: ``t_1 = max(t* + b, t* + 1)``, ``t_p = t_(p-1) + I_p`` with
  ``I_p = ceil((t* + b) / c^(p-1))`` (never below 1), while ``t_p < T``.

Dynamic aggregation (Alg. 1 lines 6-14): one random reuse permutation per round orders all
clients; client k's *prior* neighbours are those with a smaller reuse index; k waits for the
``N`` prior neighbours that finish earliest (all of them when it has fewer than ``N``) and
starts when the last of those finishes. Prior neighbours come earlier in reuse order, so
processing clients in reuse order is a valid topological order.

PSFL's training structure (Sec. V-B, with the errata of ``docs/psfl.md``): the
constants of Eq. 8 (:func:`psfl_constants`), the objective of Eq. 21 (:func:`psfl_objective`), its
global minimiser ``W*`` (:func:`optimal_parallel_width`) and the integer ``(W, S)``
(:func:`training_structure`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lightning_dfl.checks import check_int, is_number

# ---------------------------------------------------------------------------------------------
# Simulated time: when each task starts and ends (the federation's clock builds on it)
# ---------------------------------------------------------------------------------------------


class ComputeTimes(Protocol):
    """What :func:`simulate_dynamic_aggregation` needs of a clock
    (:class:`lightning_dfl.federation.clock.Clock` is one): set up, then per-round compute times."""

    def setup(self, num_clients: int, num_servers: int = 0, seed: int = 0) -> None: ...

    def compute_times(self, round_idx: int) -> Sequence[float]: ...


#: per node, the times its inputs become available, given the finish times of the nodes before it
Arrivals = Callable[[int, Mapping[int, float]], Iterable[float]]
Durations = Sequence[float] | Mapping[int, float]


def finish_times(order: Iterable[int], arrivals: Arrivals, durations: Durations) -> dict[int, tuple[float, float]]:
    """``(start, finish)`` per node, visiting ``order`` (a topological order): node k starts at the
    latest of ``arrivals(k, finish)`` (0 when there is none) and finishes ``durations[k]`` later
    (DA-DPFL Sec. IV-B; ``finish`` holds the nodes already visited)."""
    finish: dict[int, float] = {}
    times: dict[int, tuple[float, float]] = {}
    for node in order:
        start = max(arrivals(node, finish), default=0.0)
        finish[node] = start + durations[node]
        times[node] = (start, finish[node])
    return times


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


# ---------------------------------------------------------------------------------------------
# Who waits for whom: Sec. IV-B, Alg. 1 lines 6-14
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundSchedule:
    """One round's simulated clock: per client its start and finish time and the clients it
    waited for (in reuse order)."""

    start: list[float]
    finish: list[float]
    waits: list[list[int]]

    @property
    def delay(self) -> float:
        """The latest start time (in units of one task when durations are 1)."""
        return max(self.start, default=0.0)


def _check_round(neighbors: Sequence[Sequence[int]], reuse_index: Sequence[int], max_wait: int,
                 durations: Sequence[float] | None) -> None:
    k = len(neighbors)
    check_int("max_wait", max_wait, 0)
    if sorted(int(i) for i in reuse_index) != list(range(k)):
        raise ValueError(f"reuse_index must be a permutation of 0..{k - 1} (one position per client "
                         f"of neighbors), got {list(reuse_index)!r}")
    for client, nbs in enumerate(neighbors):
        ids = [int(j) for j in nbs]
        bad = [j for j in ids if not 0 <= j < k or j == client]
        if bad:
            raise ValueError(f"client {client}'s neighbours must be other clients in 0..{k - 1}, got {bad}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"client {client}'s neighbours must be distinct, got {ids}")
    if durations is not None:
        if len(durations) != k:
            raise ValueError(f"durations needs one value per client ({k}), got {len(durations)}")
        bad = [d for d in durations if not (math.isfinite(d) and d >= 0)]
        if bad:
            raise ValueError(f"durations must be finite and >= 0, got {bad}")


def simulate_round(neighbors: Sequence[Sequence[int]], reuse_index: Sequence[int], max_wait: int,
                   durations: Sequence[float] | None = None) -> RoundSchedule:
    """Simulate one DA-DPFL round on a clock (Sec. IV-B).

    Args:
        neighbors: ``neighbors[k]`` are client k's in-neighbours (client ids ``0..K-1``).
        reuse_index: ``reuse_index[k]`` is client k's position in the round's one reuse
            permutation.
        max_wait: N, the most prior neighbours a client waits for (0: fully parallel).
        durations: each client's task time (default 1 each).

    Clients are processed in reuse order. Client k waits for the N prior neighbours that finish
    earliest (ties: smaller reuse index first), starts at the latest of their finish times (0
    if it waits for none) and finishes ``durations[k]`` later (the clock's :func:`finish_times`).
    """
    _check_round(neighbors, reuse_index, max_wait, durations)
    k_total = len(neighbors)
    dur = [1.0] * k_total if durations is None else [float(d) for d in durations]
    pos = [int(i) for i in reuse_index]
    waits: list[list[int]] = [[] for _ in range(k_total)]

    def arrivals(client: int, finish: Mapping[int, float]) -> list[float]:
        prior = [int(j) for j in neighbors[client] if pos[int(j)] < pos[client]]
        prior.sort(key=lambda j: (finish[j], pos[j]))
        waits[client] = sorted(prior[:max_wait], key=pos.__getitem__)
        return [finish[j] for j in waits[client]]

    times = finish_times(sorted(range(k_total), key=pos.__getitem__), arrivals, dur)
    return RoundSchedule(start=[times[c][0] for c in range(k_total)], finish=[times[c][1] for c in range(k_total)],
                         waits=waits)


def reuse_dependencies(neighbors: Sequence[Sequence[int]], reuse_index: Sequence[int], max_wait: int,
                       durations: Sequence[float] | None = None) -> list[list[int]]:
    """The clients each client waits for (in reuse order); see :func:`simulate_round`."""
    return simulate_round(neighbors, reuse_index, max_wait, durations).waits


def simulate_rounds(neighbors: np.ndarray, order: np.ndarray, max_wait: int,
                    durations: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`simulate_round` over many rounds.

    Args:
        neighbors: int array ``(R, K, M)``: ``neighbors[r, k]`` are client k's in-neighbours.
        order: int array ``(R, K)``: ``order[r, i]`` is the client at reuse position ``i``.
        max_wait: N.
        durations: float array ``(R, K)``: ``durations[r, k]`` is client k's task time in round r
            (default: 1 each, and integer start times).

    Returns:
        ``start`` (``(R, K)``: start time of the client at each reuse *position*) and ``prior``
        (``(R, K)``, int: its number of prior neighbours).
    """
    check_int("max_wait", max_wait, 0)
    if neighbors.ndim != 3 or order.ndim != 2 or neighbors.shape[:2] != order.shape:
        raise ValueError(f"neighbors must have shape (R, K, M) and order (R, K), got "
                         f"{neighbors.shape} and {order.shape}")
    if durations is None:
        dtype, never = np.int64, np.iinfo(np.int64).max
    else:
        durations = np.asarray(durations, dtype=np.float64)
        if durations.shape != order.shape:
            raise ValueError(f"durations must have shape (R, K) = {order.shape}, got {durations.shape}")
        if not (np.isfinite(durations) & (durations >= 0)).all():
            raise ValueError("durations must be finite and >= 0")
        dtype, never = np.float64, np.inf
    rounds, k_total, m = neighbors.shape
    rows = np.arange(rounds)
    pos = np.empty_like(order)
    pos[rows[:, None], order] = np.arange(k_total)[None, :]
    finish = np.zeros((rounds, k_total), dtype=dtype)  # indexed by client
    start = np.zeros((rounds, k_total), dtype=dtype)  # indexed by reuse position
    prior = np.zeros((rounds, k_total), dtype=np.int64)
    anyone_waits = m > 0 and max_wait > 0
    for i in range(k_total):
        client = order[:, i]
        nbs = neighbors[rows, client]  # (R, M)
        is_prior = pos[rows[:, None], nbs] < i
        n_prior = is_prior.sum(axis=1)
        prior[:, i] = n_prior
        if not anyone_waits:
            continue  # N = 0 or M = 0: everybody starts at 0
        times = np.where(is_prior, finish[rows[:, None], nbs], never)
        times.sort(axis=1)
        k_wait = np.minimum(n_prior, max_wait)
        begin = np.where(k_wait > 0, times[rows, np.maximum(k_wait - 1, 0)], 0)
        start[:, i] = begin
        finish[rows, client] = begin + (1 if durations is None else durations[rows, client])
    return start, prior


def random_rounds(num_clients: int, num_neighbors: int, rounds: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``rounds`` random rounds: each client gets ``num_neighbors`` distinct other clients
    uniformly at random, and each round one uniform reuse permutation.

    Returns ``neighbors`` ``(R, K, M)`` and ``order`` ``(R, K)`` for :func:`simulate_rounds`.
    """
    check_int("num_clients", num_clients, 1)
    check_int("num_neighbors", num_neighbors, 0)
    check_int("rounds", rounds, 0)
    if num_neighbors >= num_clients:
        raise ValueError(f"num_neighbors (M) must be < num_clients (K={num_clients}), got {num_neighbors}")
    k, m = num_clients, num_neighbors
    if m > 0:
        # The M smallest of K-1 i.i.d. uniforms index a uniform M-subset of the others.
        keys = rng.random((rounds, k, k - 1))
        offsets = np.argpartition(keys, m - 1, axis=2)[:, :, :m]
        neighbors = (np.arange(k)[None, :, None] + 1 + offsets) % k
    else:
        neighbors = np.zeros((rounds, k, 0), dtype=np.int64)
    order = np.argsort(rng.random((rounds, k)), axis=1)
    return neighbors, order


@dataclass(frozen=True)
class SchedulingStats:
    """Parallelism and delay of DA-DPFL's dynamic aggregation (Sec. VI-E, Figs. 8-9).

    Attributes:
        parallelism: mean over rounds of the share of clients that start at time 0 (exactly
            ``1/(M+1)`` in expectation for every N >= 1).
        max_parallelism: mean over rounds of the largest share of clients starting at one
            same time.
        delay: mean over rounds of the latest start time, in units of one task (or of the clock).
        delays: per round, the latest start time.
        prior_counts: ``(rounds, K)``; column ``i`` is the number of prior neighbours of the
            client at reuse position ``i`` (0-based; Proposition 1's k is ``i + 1``).
    """

    num_clients: int
    num_neighbors: int
    max_wait: int
    rounds: int
    seed: int
    parallelism: float
    max_parallelism: float
    delay: float
    delays: np.ndarray = field(repr=False)
    prior_counts: np.ndarray = field(repr=False)

    @property
    def expected_parallelism(self) -> float:
        """``1/(M+1)`` for N >= 1, 1 for N = 0."""
        return 1.0 if self.max_wait == 0 else 1.0 / (self.num_neighbors + 1)


# Elements of the (batch, K, K-1) array of random keys drawn at once.
_BATCH_ELEMENTS = 4_000_000


def simulate_dynamic_aggregation(num_clients: int, num_neighbors: int, max_wait: int,
                                 rounds: int = 10_000, seed: int = 0, clock: ComputeTimes | None = None) -> SchedulingStats:
    """Monte-Carlo estimate of parallelism and delay (Sec. VI-E, Figs. 8-9).

    Each round every client gets ``num_neighbors`` (M) distinct random other clients and one
    fresh reuse permutation orders them all; each waits for at most ``max_wait`` (N) prior
    neighbours. Every task takes one unit of time, or with a ``clock`` (set up here with
    ``num_clients`` and ``seed``) its time ``clock.compute_times(r)`` in round r. The draws depend
    on ``(K, M, rounds, seed)`` and the clock only, so runs that differ in N share their rounds.
    """
    check_int("num_clients", num_clients, 1)
    check_int("num_neighbors", num_neighbors, 0)
    check_int("rounds", rounds, 1)
    check_int("max_wait", max_wait, 0)
    if num_neighbors >= num_clients:
        raise ValueError(f"num_neighbors (M) must be < num_clients (K={num_clients}), got {num_neighbors}")
    if max_wait > num_neighbors:
        raise ValueError(f"max_wait (N) must lie in [0, num_neighbors={num_neighbors}], got {max_wait}")
    if clock is not None:
        clock.setup(num_clients, seed=seed)
    rng = np.random.default_rng(seed)
    k = num_clients
    batch = max(1, _BATCH_ELEMENTS // max(k * (k - 1), 1))
    delays = np.empty(rounds, dtype=np.int64 if clock is None else np.float64)
    at_zero = np.empty(rounds, dtype=np.float64)
    largest = np.empty(rounds, dtype=np.float64)
    prior_counts = np.empty((rounds, k), dtype=np.int16 if k < 2**15 else np.int64)
    for lo in range(0, rounds, batch):
        hi = min(lo + batch, rounds)
        neighbors, order = random_rounds(k, num_neighbors, hi - lo, rng)
        durations = None if clock is None else np.array([clock.compute_times(r) for r in range(lo, hi)])
        start, prior = simulate_rounds(neighbors, order, max_wait, durations)
        delays[lo:hi] = start.max(axis=1)
        at_zero[lo:hi] = (start == 0).mean(axis=1)
        largest[lo:hi] = _largest_group(start) / k
        prior_counts[lo:hi] = prior
    return SchedulingStats(
        num_clients=k, num_neighbors=num_neighbors, max_wait=max_wait, rounds=rounds, seed=seed,
        parallelism=float(at_zero.mean()), max_parallelism=float(largest.mean()),
        delay=float(delays.mean()), delays=delays, prior_counts=prior_counts,
    )


def _largest_group(start: np.ndarray) -> np.ndarray:
    """Per row, the most start times equal to 9 decimals (as the clock's round metrics group them)."""
    ordered = np.sort(np.round(start, 9), axis=1)
    positions = np.arange(ordered.shape[1])
    new_run = np.ones(ordered.shape, dtype=bool)
    new_run[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run_start = np.maximum.accumulate(np.where(new_run, positions, 0), axis=1)
    return (positions - run_start + 1).max(axis=1)


def schedule_table(num_clients: int = 100, neighbor_sizes: Sequence[int] = (2, 5, 10, 20, 50),
                   max_waits: Sequence[int | None] = (1, 2, 5, 10, 20, None), rounds: int = 10_000,
                   seed: int = 0) -> list[SchedulingStats]:
    """Figs. 8-9 as numbers: one :class:`SchedulingStats` per (M, N).

    ``None`` in ``max_waits`` means N = M (waiting for all prior neighbours, the papers' black
    line). A given N above M is waited as N = M ("at most N"), and each (M, effective N) is
    simulated once.
    """
    if not neighbor_sizes or not max_waits:
        raise ValueError("neighbor_sizes and max_waits must not be empty")
    rows: list[SchedulingStats] = []
    for m in neighbor_sizes:
        seen: set[int] = set()
        for n in max_waits:
            effective = m if n is None else min(n, m)
            if effective in seen:
                continue
            seen.add(effective)
            rows.append(simulate_dynamic_aggregation(num_clients, m, effective, rounds, seed))
    return rows


def format_schedule_table(rows: Sequence[SchedulingStats]) -> str:
    """Render :func:`schedule_table`'s rows as a plain-text table (M, N, parallelism, delay)."""
    header = ("M", "N", "parallelism", "1/(M+1)", "max parallelism", "delay (tasks)")
    lines = [header]
    for s in rows:
        n = f"{s.max_wait}" + (" (=M)" if s.max_wait == s.num_neighbors and s.max_wait > 0 else "")
        lines.append((str(s.num_neighbors), n, f"{s.parallelism:.4f}", f"{s.expected_parallelism:.4f}",
                      f"{s.max_parallelism:.4f}", f"{s.delay:.2f}"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        s = rows[0]
        out.insert(0, f"K = {s.num_clients} clients, {s.rounds} rounds, seed {s.seed}; "
                      f"delay = latest start time per round in task units")
    return "\n".join(out)


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


__all__ = [
    "PruningSchedule",
    "RoundSchedule",
    "SchedulingStats",
    "detection_score",
    "first_pruning_round",
    "format_schedule_table",
    "optimal_parallel_width",
    "psfl_constants",
    "psfl_objective",
    "pruning_rounds",
    "random_rounds",
    "reuse_dependencies",
    "schedule_table",
    "simulate_dynamic_aggregation",
    "simulate_round",
    "simulate_rounds",
    "training_structure",
    "vote",
]
