"""PSFL's client samplers (Sec. V-C, Theorem 3, psfl-notes 14): structure, unbiasedness, round time."""

import numpy as np
import pytest

from lightning_dfl.sampling import (
    SAMPLERS,
    TimeBasedSampler,
    UniformSampler,
    WeightedSampler,
    build_sampler,
)

NAMES = ["time", "uniform", "weighted"]
DISCRETE_TIMES = np.array([0.5, 1.0, 2.0, 4.0, 5.0])


def _estimates(n, seed=0):
    return np.random.default_rng(seed).choice(DISCRETE_TIMES, size=n).tolist()


def _round_times(sampler, times, num_sequences, length, rounds, seed):
    """Eq. 4 per round: the slowest sequence's summed true time (here the estimates are the true times)."""
    rng = np.random.default_rng(seed)
    plans = np.array([sampler.sample(times, num_sequences, length, rng) for _ in range(rounds)])  # (R, W, S)
    return np.asarray(times)[plans].sum(axis=2).max(axis=1)


def test_registry():
    assert SAMPLERS.names() == NAMES
    assert isinstance(build_sampler("time"), TimeBasedSampler)
    assert isinstance(build_sampler("uniform"), UniformSampler)
    assert build_sampler("weighted", exponent=1.0).exponent == 1.0
    assert build_sampler("weighted").exponent == 0.5


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n, w, s", [(20, 4, 5), (20, 5, 4), (10, 3, 3), (7, 1, 7), (7, 7, 1), (9, 2, 2), (1, 1, 1)])
def test_shape_and_distinct(name, n, w, s):
    sampler = build_sampler(name)
    rng = np.random.default_rng(1)
    for _ in range(20):
        plan = sampler.sample(_estimates(n), w, s, rng)
        assert len(plan) == w and all(len(seq) == s for seq in plan)
        flat = [c for seq in plan for c in seq]
        assert all(type(c) is int and 0 <= c < n for c in flat)
        assert len(set(flat)) == w * s


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_under_seed(name):
    sampler = build_sampler(name)
    est = _estimates(30)
    first = [sampler.sample(est, 3, 4, np.random.default_rng(7)) for _ in range(2)]
    assert first[0] == first[1]
    assert sampler.sample(est, 3, 4, np.random.default_rng(8)) != first[0]


def test_time_based_groups_sorted_ties_by_id():
    est = [3.0, 1.0, 2.0, 1.0, 5.0, 2.0, 4.0, 0.5]
    groups = TimeBasedSampler().groups(est, 4)
    assert [g.tolist() for g in groups] == [[7, 1], [3, 2], [5, 0], [6, 4]]


def test_time_based_unequal_groups_larger_first():
    est = list(range(10, 0, -1))  # client 9 fastest
    groups = TimeBasedSampler().groups(est, 3)
    assert [g.size for g in groups] == [4, 3, 3]
    assert groups[0].tolist() == [9, 8, 7, 6]
    probabilities = TimeBasedSampler().selection_probabilities(est, 2, 3)
    assert probabilities[[9, 8, 7, 6]].tolist() == [0.5] * 4
    assert np.allclose(probabilities[:6], 2 / 3)
    assert probabilities.sum() == pytest.approx(6)


def test_time_based_one_client_per_group_per_sequence():
    est = _estimates(24, seed=3)
    sampler = TimeBasedSampler()
    group_of = np.empty(24, dtype=int)
    for g, members in enumerate(sampler.groups(est, 4)):
        group_of[members] = g
    rng = np.random.default_rng(0)
    for _ in range(50):
        for seq in sampler.sample(est, 6, 4, rng):
            assert sorted(group_of[seq].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("n, w, s", [(12, 2, 3), (20, 5, 4), (100, 5, 4), (30, 1, 6)])
def test_time_based_selection_probability_exact_when_s_divides_n(n, w, s):
    # Theorem 3: W / |G| = W S / N = N0 / N for every client, exactly.
    probabilities = TimeBasedSampler().selection_probabilities(_estimates(n, seed=n), w, s)
    assert (probabilities == w / (n // s)).all()
    assert w / (n // s) == (w * s) / n


def test_time_based_uniform_frequencies_by_position():
    # Pr[client n at position m of sequence w] = 1 / (|G| S) = 1 / N when S divides N (Theorem 3).
    n, w, s, rounds = 12, 2, 3, 6000
    est = _estimates(n, seed=5)
    rng = np.random.default_rng(11)
    plans = np.array([TimeBasedSampler().sample(est, w, s, rng) for _ in range(rounds)])  # (R, W, S)
    counts = np.zeros((n, w, s))
    np.add.at(counts, (plans, np.arange(w)[None, :, None], np.arange(s)[None, None, :]), 1)
    expected = rounds / n
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected)  # 5 sigma: ~110 of 500
    frequency = counts.sum(axis=(1, 2)) / rounds
    assert np.abs(frequency - w * s / n).max() < 0.03  # N0 / N = 0.5, sigma ~ 0.0065


def test_uniform_and_weighted_frequencies():
    n, w, s, rounds = 10, 2, 2, 4000
    est = [0.5] * 5 + [4.5] * 5
    rng = np.random.default_rng(2)
    for name, fast_more in (("uniform", False), ("weighted", True)):
        plans = np.array([build_sampler(name).sample(est, w, s, rng) for _ in range(rounds)])
        frequency = np.bincount(plans.ravel(), minlength=n) / rounds
        if fast_more:  # biased towards the fast clients (p ~ t^-1/2, three times the weight)
            assert frequency[:5].min() > frequency[5:].max()
        else:
            assert np.abs(frequency - w * s / n).max() < 0.04


def test_time_based_beats_uniform_round_time():
    # N = 100, S = 4, W = 5, times from {0.5, 1, 2, 4, 5}, 2,000 rounds per sampler.
    times = _estimates(100, seed=42)
    rounds = 2000
    means = {name: _round_times(build_sampler(name), times, 5, 4, rounds, seed=0).mean() for name in NAMES}
    print(f"\nmean round time (N=100, W=5, S=4, discrete times, {rounds} rounds): "
          + ", ".join(f"{name} {value:.3f}" for name, value in means.items()))
    assert means["time"] < means["uniform"]


@pytest.mark.parametrize("s", [3, 4, 5])
def test_report_time_based_vs_weighted(s):
    # Fig. 6's claim that time-based also beats weighted sampling: measured and printed, not asserted.
    times = _estimates(500, seed=7)
    means = {name: _round_times(build_sampler(name), times, 3, s, 400, seed=1).mean() for name in NAMES}
    print(f"\nmean round time (N=500, W=3, S={s}, discrete times, 400 rounds): "
          + ", ".join(f"{name} {value:.3f}" for name, value in means.items()))
    assert all(np.isfinite(v) for v in means.values())


@pytest.mark.parametrize("name", NAMES)
def test_bad_arguments(name):
    sampler = build_sampler(name)
    rng = np.random.default_rng(0)
    est = _estimates(10)
    with pytest.raises(ValueError, match=r"num_sequences \* length"):
        sampler.sample(est, 4, 3, rng)
    with pytest.raises(ValueError, match="^length "):
        sampler.sample(est, 2, 0, rng)
    with pytest.raises(ValueError, match="^num_sequences "):
        sampler.sample(est, 0, 2, rng)
    with pytest.raises(ValueError, match="^num_sequences "):
        sampler.sample(est, 1.5, 2, rng)
    with pytest.raises(ValueError, match="^estimates "):
        sampler.sample(est[:-1] + [float("nan")], 2, 2, rng)
    with pytest.raises(ValueError, match="^estimates "):
        sampler.sample(est[:-1] + [-1.0], 2, 2, rng)
    with pytest.raises(ValueError, match="^rng "):
        sampler.sample(est, 2, 2, np.random.RandomState(0))


def test_bad_weighted_and_names():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"^estimates .*\(3, 0\.0\)"):
        WeightedSampler().sample([1.0, 2.0, 1.0, 0.0], 1, 2, rng)
    assert len(TimeBasedSampler().sample([1.0, 0.0, 2.0], 1, 3, rng)[0]) == 3  # a zero time is fine unweighted
    with pytest.raises(ValueError, match="^exponent "):
        WeightedSampler(exponent=-0.5)
    with pytest.raises(ValueError, match="unknown sampler 'round_robin'; allowed: time, uniform, weighted"):
        build_sampler("round_robin")
    with pytest.raises(ValueError, match=r"W \* S = 1 \* 3"):
        TimeBasedSampler().groups([1.0, 2.0], 3)
