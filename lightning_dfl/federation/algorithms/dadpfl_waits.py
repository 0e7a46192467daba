"""DA-DPFL's dynamic aggregation in simulated time (Sec. IV-B, Alg. 1 lines 6-14): who waits for whom,
when each task starts and ends, and the Monte Carlo of the waits.

One random reuse permutation per round orders all clients; client k's *prior* neighbours are those
with a smaller reuse index; k waits for the ``N`` prior neighbours that finish earliest (all of them
when it has fewer than ``N``) and starts when the last of those finishes. Prior neighbours come
earlier in reuse order, so processing clients in reuse order is a valid topological order.

:func:`~lightning_dfl.federation.exchange.schedule.finish_times` times every plan (this module and the
federation's clock build on it); DA-DPFL's planner calls
:func:`reuse_dependencies`; the CLI prints :func:`format_schedule_table`. Pure computation (numpy and
the standard library); a clock is passed in as a :class:`ComputeTimes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_dfl.checks import check_int
from lightning_dfl.federation.exchange.schedule import ComputeTimes, finish_times

__all__ = ["RoundSchedule", "SchedulingStats", "format_schedule_table", "random_rounds", "reuse_dependencies", "schedule_table", "simulate_dynamic_aggregation", "simulate_round", "simulate_rounds"]

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
                   seed: int = 0, progress: Callable[[int, int], None] | None = None) -> list[SchedulingStats]:
    """Figs. 8-9 as numbers: one :class:`SchedulingStats` per (M, N).

    ``None`` in ``max_waits`` means N = M (waiting for all prior neighbours, the papers' black
    line). A given N above M is waited as N = M ("at most N"), and each (M, effective N) is
    simulated once. ``progress(done, total)`` is called after each (M, N) is simulated.
    """
    if not neighbor_sizes or not max_waits:
        raise ValueError("neighbor_sizes and max_waits must not be empty")
    num_clients = check_int("num_clients", num_clients, 2)
    for m in neighbor_sizes:
        check_int(f"neighbors (M) for {num_clients} clients", m, 1, num_clients - 1)
    cells = list(dict.fromkeys((m, m if n is None else min(n, m)) for m in neighbor_sizes for n in max_waits))
    rows: list[SchedulingStats] = []
    for m, n in cells:
        rows.append(simulate_dynamic_aggregation(num_clients, m, n, rounds, seed))
        if progress is not None:
            progress(len(rows), len(cells))
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
