"""DA-DPFL's pruning schedule (Eq. 4-6) and dynamic aggregation (Sec. IV-B, VI-E, Prop. 1)."""

import math
import time

import numpy as np
import pytest

from lightning_dfl.federation import Clock
from lightning_dfl.federation.algorithms.dadpfl_waits import (
    format_schedule_table,
    random_rounds,
    reuse_dependencies,
    schedule_table,
    simulate_dynamic_aggregation,
    simulate_round,
    simulate_rounds,
)
from lightning_dfl.pruning_time import PruningSchedule, detection_score, first_pruning_round, pruning_rounds, vote

# --- Eq. 6: pruning rounds ---------------------------------------------------------------------


def test_pruning_rounds_hand_computed():
    # t* = 10, b = 0, c = 1.3: t_1 = 11; gaps ceil(10/1.3^k) = 8, 6, 5, 4, 3, 3, 2, 2, 1, ...
    assert pruning_rounds(10, 50) == [11, 19, 25, 30, 34, 37, 40, 42, 44, 45, 46, 47, 48, 49]
    # b = 2: t_1 = 12; gaps ceil(12/1.3^k) = ceil(9.23, 7.10, 5.46, 4.20) = 10, 8, 6, 5.
    assert pruning_rounds(10, 42, b=2) == [12, 22, 30, 36, 41]
    assert pruning_rounds(10, 41, b=2) == [12, 22, 30, 36]  # t_p < T
    # c = 1: constant gap t* + b.
    assert pruning_rounds(10, 45, c=1.0) == [11, 21, 31, 41]
    # c < 1: gaps grow: ceil(10/0.5) = 20, then 40.
    assert pruning_rounds(10, 100, c=0.5) == [11, 31, 71]
    # Non-integer b: t_1 = ceil(t* + b).
    assert pruning_rounds(10, 14, b=0.5) == [11]
    assert pruning_rounds(10, 14, b=1.5) == [12]


def test_pruning_rounds_edges():
    assert pruning_rounds(10, 11) == []  # t_1 = 11 is not < T
    assert pruning_rounds(0, 4) == [1, 2, 3]  # gaps never drop below 1
    rounds = pruning_rounds(100, 500)
    assert rounds[0] == 101 and rounds[-1] == 499
    assert all(b > a for a, b in zip(rounds, rounds[1:]))
    gaps = np.diff(rounds)
    assert all(g2 <= g1 for g1, g2 in zip(gaps, gaps[1:]))  # c > 1: frequency intensifies


def test_pruning_schedule_membership():
    schedule = PruningSchedule(t_star=10, total_rounds=50)
    assert 11 in schedule and 19 in schedule and 12 not in schedule and 10 not in schedule
    assert list(schedule) == pruning_rounds(10, 50) and len(schedule) == 14


@pytest.mark.parametrize("kwargs,word", [
    ({"c": 0.0}, "c "), ({"c": -1.0}, "c "), ({"b": -1.0}, "b "),
    ({"t_star": -1}, "t_star"), ({"total_rounds": 0}, "total_rounds"), ({"t_star": 2.5}, "t_star"),
])
def test_pruning_rounds_rejects_bad_input(kwargs, word):
    args = {"t_star": 10, "total_rounds": 50, **kwargs}
    with pytest.raises(ValueError, match=word):
        pruning_rounds(**args)


# --- Eq. 4-5 and the voting rule ----------------------------------------------------------------


def test_detection_score_and_vote():
    assert detection_score(12.0, 10.0, 40.0) == pytest.approx(0.05)
    assert detection_score(10.0, 12.0, 40.0) == pytest.approx(0.05)  # absolute value
    assert vote(0.02, 0.03) == 1
    assert vote(0.03, 0.03) == 0  # strict "<"
    assert vote(0.05, 0.03) == 0
    assert detection_score(5.0, 5.0, 0.0) == 0.0
    assert detection_score(6.0, 5.0, 0.0) == math.inf
    assert vote(detection_score(math.nan, 5.0, 1.0), 0.03) == 0  # a diverged client is not stable
    with pytest.raises(ValueError, match="delta_prev"):
        detection_score(1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="delta_pr"):
        vote(0.1, 0.0)


def test_first_pruning_round_uses_greater_or_equal():
    shares = [0.0, 0.2, 0.49, 0.5, 0.9]
    assert first_pruning_round(shares, 0.5) == 4  # rounds numbered from 1; 0.5 >= 0.5
    assert first_pruning_round(shares, 0.5, first_round=0) == 3
    assert first_pruning_round(shares, 0.95) is None
    assert first_pruning_round([], 0.5) is None
    with pytest.raises(ValueError, match="delta_v"):
        first_pruning_round(shares, 1.5)
    with pytest.raises(ValueError, match="round 2"):
        first_pruning_round([0.1, 1.2], 0.5)


# --- Sec. IV-B: one round ------------------------------------------------------------------------

# Fig. 1 (K = 6, M = 2), clients 0..5 standing for nodes 1..6 with reuse index = node number.
# Consistent with the figure: nodes 1, 2, 4 have no prior neighbour; node 3 has prior 2; node 5
# has prior 1; node 6 has priors 1 and 5.
FIG1_NEIGHBORS = [[1, 2], [2, 3], [1, 3], [4, 5], [0, 5], [0, 4]]
FIG1_REUSE = [0, 1, 2, 3, 4, 5]


def test_fig1_waits():
    assert reuse_dependencies(FIG1_NEIGHBORS, FIG1_REUSE, 0) == [[]] * 6
    # N = 1: node 3 waits for 2, nodes 5 and 6 for 1 (node 1 finishes before node 5).
    assert reuse_dependencies(FIG1_NEIGHBORS, FIG1_REUSE, 1) == [[], [], [1], [], [0], [0]]
    # N = 2: node 6 waits for 1 and 5.
    assert reuse_dependencies(FIG1_NEIGHBORS, FIG1_REUSE, 2) == [[], [], [1], [], [0], [0, 4]]
    sched = simulate_round(FIG1_NEIGHBORS, FIG1_REUSE, 2)
    assert sched.start == [0, 0, 1, 0, 1, 2]
    assert sched.finish == [1, 1, 2, 1, 2, 3]
    assert sched.delay == 2
    # Nodes 1, 2, 4 train in parallel; 5 and 6 train alongside 3 when N = 1.
    assert simulate_round(FIG1_NEIGHBORS, FIG1_REUSE, 1).start == [0, 0, 1, 0, 1, 1]


def test_waits_for_earliest_finishers_with_durations():
    # Client 3 has priors 0, 1, 2 finishing at 5, 1, 3; with N = 2 it waits for 1 and 2.
    neighbors = [[3], [3], [3], [0, 1, 2]]
    sched = simulate_round(neighbors, [0, 1, 2, 3], 2, durations=[5, 1, 3, 1])
    assert sched.waits[3] == [1, 2]
    assert sched.start[3] == 3 and sched.finish[3] == 4
    # Ties in finish time go to the smaller reuse index.
    tie = simulate_round(neighbors, [2, 1, 0, 3], 1, durations=[1, 1, 1, 1])
    assert tie.waits[3] == [2]  # client 2 holds reuse index 0
    # Reuse positions, not client ids, decide who is prior.
    assert reuse_dependencies([[1], [0]], [1, 0], 1) == [[1], []]


def test_waits_chain_beyond_n():
    # A chain: each client's only prior is the one before; N = 1 still gives delay K - 1.
    k = 6
    neighbors = [[(i - 1) % k] for i in range(k)]
    neighbors[0] = [1]
    sched = simulate_round(neighbors, list(range(k)), 1)
    assert sched.start == [0, 1, 2, 3, 4, 5]


def test_simulate_round_rejects_bad_input():
    with pytest.raises(ValueError, match="permutation"):
        simulate_round([[1], [0]], [0, 0], 1)
    with pytest.raises(ValueError, match="other clients"):
        simulate_round([[0], [0]], [0, 1], 1)
    with pytest.raises(ValueError, match="distinct"):
        simulate_round([[1, 1], [0]], [0, 1], 1)
    with pytest.raises(ValueError, match="max_wait"):
        simulate_round([[1], [0]], [0, 1], -1)
    with pytest.raises(ValueError, match="durations"):
        simulate_round([[1], [0]], [0, 1], 1, durations=[1.0, -1.0])


def test_vectorised_rounds_match_single_round_simulation():
    rng = np.random.default_rng(3)
    neighbors, order = random_rounds(12, 4, 30, rng)
    for n in (0, 1, 2, 4):
        start, prior = simulate_rounds(neighbors, order, n)
        for r in range(30):
            reuse = np.argsort(order[r])
            sched = simulate_round(neighbors[r].tolist(), reuse.tolist(), n)
            assert [sched.start[c] for c in order[r]] == start[r].tolist()
            expected_prior = [sum(reuse[j] < reuse[c] for j in neighbors[r, c]) for c in order[r]]
            assert prior[r].tolist() == expected_prior


def test_vectorised_rounds_with_durations_match_single_rounds():
    rng = np.random.default_rng(4)
    neighbors, order = random_rounds(12, 4, 30, rng)
    durations = rng.uniform(0.5, 4.5, size=(30, 12))
    for n in (0, 1, 2, 4):
        start, _ = simulate_rounds(neighbors, order, n, durations)
        assert start.dtype == np.float64
        for r in range(30):
            reuse = np.argsort(order[r])
            sched = simulate_round(neighbors[r].tolist(), reuse.tolist(), n, durations[r].tolist())
            assert [sched.start[c] for c in order[r]] == start[r].tolist()
    unit_start, _ = simulate_rounds(neighbors, order, 2)
    assert np.array_equal(simulate_rounds(neighbors, order, 2, np.ones((30, 12)))[0], unit_start)
    with pytest.raises(ValueError, match="durations"):
        simulate_rounds(neighbors, order, 2, np.ones((30, 11)))
    with pytest.raises(ValueError, match="durations"):
        simulate_rounds(neighbors, order, 2, np.full((30, 12), np.nan))


def test_random_rounds_draw_distinct_other_neighbours():
    neighbors, order = random_rounds(10, 9, 50, np.random.default_rng(0))
    for r in range(50):
        assert sorted(order[r]) == list(range(10))
        for c in range(10):
            assert sorted(neighbors[r, c]) == [j for j in range(10) if j != c]


# --- Sec. VI-E, Figs. 8-9, Proposition 1 ---------------------------------------------------------


def test_proposition1_prior_counts_are_hypergeometric():
    k_total, m, rounds = 20, 5, 4000
    stats = simulate_dynamic_aggregation(k_total, m, 1, rounds, seed=1)
    for k in (1, 5, 10, 16, 20):  # Proposition 1's 1-based reuse position
        counts = np.bincount(stats.prior_counts[:, k - 1], minlength=m + 1)
        for mm in range(m + 1):
            pmf = math.comb(k - 1, mm) * math.comb(k_total - k, m - mm) / math.comb(k_total - 1, m)
            freq = counts[mm] / rounds
            sigma = math.sqrt(max(pmf * (1 - pmf), 1e-12) / rounds)
            assert abs(freq - pmf) < 5 * sigma + 1e-9, (k, mm, freq, pmf)


@pytest.mark.parametrize("m", [2, 10, 30])
def test_parallelism_is_one_over_m_plus_one_for_every_n(m):
    for n in sorted({1, 2, m}):
        stats = simulate_dynamic_aggregation(100, m, n, 1000, seed=2)
        # Monte-Carlo standard error is about sqrt(p(1-p)/(K R)) < 0.001.
        assert stats.parallelism == pytest.approx(1 / (m + 1), abs=0.005)
        assert stats.expected_parallelism == 1 / (m + 1)
        assert stats.max_parallelism >= stats.parallelism


def test_no_waiting_is_fully_parallel():
    stats = simulate_dynamic_aggregation(50, 10, 0, 200, seed=0)
    assert stats.parallelism == 1.0 and stats.max_parallelism == 1.0 and stats.delay == 0.0
    assert stats.expected_parallelism == 1.0


def test_parallelism_falls_and_delay_grows_with_m():
    ms = (2, 5, 10, 20)
    runs = [simulate_dynamic_aggregation(100, m, m, 500, seed=4) for m in ms]
    par = [s.parallelism for s in runs]
    delay = [s.delay for s in runs]
    assert all(b < a for a, b in zip(par, par[1:]))
    assert all(b > a for a, b in zip(delay, delay[1:]))
    # About linear in M when N = M (the papers' black line): delay / M stays within a band.
    ratios = [d / m for d, m in zip(delay, ms)]
    assert max(ratios) / min(ratios) < 2.0
    # The README's check value: about 17 tasks at M = N = 10, K = 100.
    assert runs[2].delay == pytest.approx(17, abs=1.0)


def test_n_regulates_delay():
    delays = [simulate_dynamic_aggregation(100, 50, n, 300, seed=5).delay for n in (1, 2, 5, 50)]
    assert all(b > a for a, b in zip(delays, delays[1:]))
    assert delays[1] < delays[-1] / 5


def test_full_topology_with_n_equal_m_is_sequential():
    stats = simulate_dynamic_aggregation(30, 29, 29, 20, seed=0)
    assert stats.delay == 29 and np.all(stats.delays == 29)
    assert stats.parallelism == pytest.approx(1 / 30) and stats.max_parallelism == pytest.approx(1 / 30)


def test_full_topology_with_n_two_waits_for_the_first_two():
    # Everybody after the second position waits for the first two finishers: start 2.
    stats = simulate_dynamic_aggregation(30, 29, 2, 20, seed=0)
    assert stats.delay == 2 and stats.max_parallelism == pytest.approx(28 / 30)


def test_determinism_and_common_random_numbers():
    a = simulate_dynamic_aggregation(40, 6, 2, 300, seed=9)
    b = simulate_dynamic_aggregation(40, 6, 2, 300, seed=9)
    c = simulate_dynamic_aggregation(40, 6, 2, 300, seed=10)
    assert np.array_equal(a.delays, b.delays) and np.array_equal(a.prior_counts, b.prior_counts)
    assert (a.parallelism, a.max_parallelism, a.delay) == (b.parallelism, b.max_parallelism, b.delay)
    assert not np.array_equal(a.prior_counts, c.prior_counts)
    # Same seed, other N: the same rounds (prior counts do not depend on N).
    d = simulate_dynamic_aggregation(40, 6, 6, 300, seed=9)
    assert np.array_equal(a.prior_counts, d.prior_counts)
    assert np.all(d.delays >= a.delays)  # waiting for more never starts anybody earlier


def test_dynamic_aggregation_with_a_clock():
    unit = simulate_dynamic_aggregation(40, 6, 2, 300, seed=9)
    fixed = simulate_dynamic_aggregation(40, 6, 2, 300, seed=9, clock=Clock())
    assert (fixed.parallelism, fixed.max_parallelism, fixed.delay) == (unit.parallelism, unit.max_parallelism,
                                                                       unit.delay)
    timed = simulate_dynamic_aggregation(40, 6, 2, 300, seed=9, clock=Clock(distribution="discrete", noise=0.2))
    # Durations never change who is prior, and only clients without prior neighbours start at 0.
    assert np.array_equal(timed.prior_counts, unit.prior_counts) and timed.parallelism == unit.parallelism
    assert timed.delays.dtype == np.float64 and timed.delay != unit.delay
    again = simulate_dynamic_aggregation(40, 6, 2, 300, seed=9, clock=Clock(distribution="discrete", noise=0.2))
    assert np.array_equal(again.delays, timed.delays)


@pytest.mark.parametrize("args,word", [
    ((10, 10, 1), "num_neighbors"), ((10, 3, 4), "max_wait"), ((10, 3, -1), "max_wait"),
    ((0, 0, 0), "num_clients"),
])
def test_simulation_rejects_bad_input(args, word):
    with pytest.raises(ValueError, match=word):
        simulate_dynamic_aggregation(*args, rounds=10)
    with pytest.raises(ValueError, match="rounds"):
        simulate_dynamic_aggregation(10, 3, 1, rounds=0)


def test_papers_scale_runs_well_under_a_minute():
    # K = 100, 10,000 rounds (Sec. VI-E); about 1-2 s on 2 cores. Generous bound.
    t0 = time.perf_counter()
    stats = simulate_dynamic_aggregation(100, 10, 10, 10_000, seed=0)
    assert time.perf_counter() - t0 < 60
    assert stats.rounds == 10_000 and stats.prior_counts.shape == (10_000, 100)
    assert stats.parallelism == pytest.approx(1 / 11, abs=0.002)


def test_schedule_table_and_format():
    rows = schedule_table(num_clients=30, neighbor_sizes=(2, 5), max_waits=(1, 2, 5, None),
                          rounds=50, seed=0)
    # M = 2: N in {1, 2} (5 and None clamp to 2); M = 5: N in {1, 2, 5}.
    assert [(s.num_neighbors, s.max_wait) for s in rows] == [(2, 1), (2, 2), (5, 1), (5, 2), (5, 5)]
    text = format_schedule_table(rows)
    lines = text.splitlines()
    assert "K = 30" in lines[0]
    assert "parallelism" in lines[1] and "delay" in lines[1]
    assert len(lines) == 3 + len(rows)
    assert "(=M)" in lines[4]  # M = 2, N = 2
    with pytest.raises(ValueError, match="empty"):
        schedule_table(neighbor_sizes=())


def test_pruning_rounds_long_horizons_do_not_overflow():
    # c^(p-1) passes the float range after about 2,700 events at c = 1.3: the gaps are then 1.
    rounds = pruning_rounds(10, 5000)
    assert rounds[:14] == pruning_rounds(10, 50)
    assert rounds[13:] == list(range(49, 5000))
    # t* + b = 0 with c < 1: 0 / c^(p-1) stays 0 (also once c^(p-1) underflows to 0.0).
    assert pruning_rounds(0, 3000, c=0.5) == list(range(1, 3000))
    # Growing gaps end the schedule long before c^(p-1) underflows.
    assert pruning_rounds(10, 10**6, c=0.5)[-1] == 655351


def _imports(module) -> list[str]:
    import ast
    from pathlib import Path

    tree = ast.parse(Path(module.__file__).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    return imported + [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]


def test_the_schedules_sit_in_their_layers():
    """DESIGN.md's layers: the pruning-time equations import nothing of the package but its checks; DA-DPFL's
    waits and PSFL's structure are pure (no engine module: no store, executor, trainer; the waits only the one
    finish-time rule); the clock times plans by that same rule."""
    import lightning_dfl.federation.algorithms.dadpfl_waits as dadpfl_waits
    import lightning_dfl.federation.algorithms.psfl_structure as psfl_structure
    import lightning_dfl.federation.exchange.schedule as schedule
    import lightning_dfl.pruning_time as pruning_time
    from lightning_dfl.federation.loop import clock

    assert [m for m in _imports(pruning_time) if m.startswith("lightning_dfl")] == ["lightning_dfl.checks"]
    assert [m for m in _imports(psfl_structure) if m.startswith("lightning_dfl")] == ["lightning_dfl.checks"]
    assert [m for m in _imports(dadpfl_waits) if m.startswith("lightning_dfl")] == [
        "lightning_dfl.checks", "lightning_dfl.federation.exchange.schedule"]
    assert [m for m in _imports(schedule) if m.startswith("lightning_dfl")] == []
    assert clock.finish_times is schedule.finish_times is dadpfl_waits.finish_times


def test_schedule_table_reports_each_simulated_cell():
    """`lightning-dfl schedule` shows a bar while it simulates (40 s at its defaults): one call per distinct
    (M, effective N), in the table's order; N above M is N = M, simulated once."""
    from lightning_dfl.federation.algorithms.dadpfl_waits import schedule_table

    calls = []
    rows = schedule_table(num_clients=12, neighbor_sizes=[2, 5], max_waits=[1, 2, None], rounds=20,
                          progress=lambda done, total: calls.append((done, total)))
    assert [(r.num_neighbors, r.max_wait) for r in rows] == [(2, 1), (2, 2), (5, 1), (5, 2), (5, 5)]
    assert calls == [(k, 5) for k in range(1, 6)]
