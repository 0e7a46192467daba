"""The simulated clock: client times (PSFL Sec. VI-A3), transfer times and round schedules (DA-DPFL Sec. IV-B)."""

import json
import math

import numpy as np
import pytest

from lightning_dfl.federation import RoundPlan, Source, Task
from lightning_dfl.federation.algorithms import DADPFL, RoundContext
from lightning_dfl.federation.algorithms.dadpfl_waits import simulate_round
from lightning_dfl.federation.loop.clock import Clock, default_durations, finish_times


def _ctx(round_idx=0, num_clients=8, seed=0, durations=None):
    return RoundContext(round_idx, 10, num_clients, tuple([10] * num_clients), np.random.default_rng(seed), durations)


def _old_clock_metrics(plan, durations=None):
    """``RoundPlan.schedule`` and ``clock_metrics`` as they were before the clock module."""
    times = {}
    for task in plan.order():
        start = max((times[d][1] for d in task.waits_for()), default=0.0)
        duration = durations[task.node] if durations is not None else (1.0 if task.train else 0.0)
        times[task.node] = (start, start + duration)
    starts = [times[t.node][0] for t in plan.tasks if t.train]
    counts = {}
    for s in starts:
        counts[round(s, 9)] = counts.get(round(s, 9), 0) + 1
    metrics = {"parallelism": counts.get(0.0, 0) / len(starts), "max_parallelism": max(counts.values()) / len(starts),
               "delay": max(starts), "duration": max(f for _, f in times.values())}
    return times, metrics


# --- compute times --------------------------------------------------------------------------------


def test_fixed_speeds_give_one_over_speed_and_servers_take_no_time():
    clock = Clock(speeds=[1.0, 2.0, 4.0, 0.5])
    clock.setup(4, num_servers=1)
    assert clock.compute_times(0) == (1.0, 0.5, 0.25, 2.0, 0.0)
    unit = Clock()
    unit.setup(3)
    assert unit.compute_times(5) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("distribution,tol", [("uniform", 0.15), ("exponential", 0.25), ("normal", 0.1),
                                              ("discrete", 0.2)])
def test_distribution_means(distribution, tol):
    # Every default distribution has mean 2.5 (the truncated normal's is 2.518).
    clock = Clock(distribution=distribution)
    clock.setup(2000, seed=1)
    times = np.array(clock.compute_times(0))
    assert (times > 0).all()
    assert times.mean() == pytest.approx(2.5, abs=tol)
    if distribution == "uniform":
        assert times.min() >= 0.5 and times.max() <= 4.5


def test_discrete_draws_only_given_values():
    clock = Clock(distribution="discrete", values=(0.5, 3))
    clock.setup(500, seed=2)
    assert set(clock.compute_times(0)) == {0.5, 3.0}


def test_noise():
    exact = Clock(distribution="uniform")
    exact.setup(50, seed=4)
    assert exact.compute_times(3) == exact.base_times  # noise 0: no draw
    noisy = Clock(distribution="uniform", noise=0.2)
    noisy.setup(2000, seed=4)
    relative = np.array(noisy.compute_times(3)) / np.array(noisy.base_times) - 1
    assert relative.std() == pytest.approx(0.2, abs=0.02) and abs(relative.mean()) < 0.02
    assert noisy.compute_times(3) != noisy.compute_times(4)  # redrawn each round
    floored = Clock(noise=2.0, min_time=0.01)
    floored.setup(2000)
    times = np.array(floored.compute_times(0))
    assert times.min() == 0.01 and (times == 0.01).sum() > 100  # about 31% fall below the floor


def test_times_are_seeded_per_client():
    def times(num_clients, seed=3):
        clock = Clock(distribution="exponential", noise=0.2)
        clock.setup(num_clients, seed=seed)
        return clock.base_times, clock.compute_times(7)

    base, round7 = times(5)
    assert times(5) == (base, round7)
    more_base, more_round7 = times(50)
    assert more_base[:5] == base and more_round7[:5] == round7  # adding clients changes nobody's times
    assert times(5, seed=4)[0] != base


# --- transfer times and schedules ----------------------------------------------------------------


def test_transfer_time():
    assert Clock().transfer_time(10**9) == 0.0
    assert Clock(latency=0.25).transfer_time(10**9) == 0.25
    assert Clock(bandwidth=1000.0, latency=0.25).transfer_time(500) == 0.25 + 500 / 1000
    assert Clock(bandwidth=4.0).transfer_time(0) == 0.0
    with pytest.raises(ValueError, match="nbytes"):
        Clock().transfer_time(-1)


def test_hand_computed_schedule_with_bandwidth():
    # Chain 0 -> 1 -> 2; client 2 also reads client 0's start-of-round model.
    plan = RoundPlan(0, [
        Task(0, sources=(Source(0),)),
        Task(1, sources=(Source(1), Source(0, fresh=True))),
        Task(2, sources=(Source(2), Source(1, fresh=True), Source(0))),
    ])
    clock = Clock(bandwidth=100.0, latency=0.5)
    times = clock.schedule(plan, [1.0, 2.0, 0.5], edge_bytes={(0, 1): 200, (1, 2): 50, (0, 2): 400})
    # 0: starts at 0, ends at 1.
    # 1: 0's fresh model arrives at 1 + 0.5 + 200/100 = 3.5; ends at 3.5 + 2 = 5.5.
    # 2: 1's fresh model at 5.5 + 0.5 + 50/100 = 6.5; 0's old model at 0.5 + 400/100 = 4.5; ends at 7.
    assert times == {0: (0.0, 1.0), 1: (3.5, 5.5), 2: (6.5, 7.0)}
    # A server runs after client 2 and reads client 0's start-of-round model (no byte count: latency only).
    server = RoundPlan(0, [*plan.tasks, Task(3, sources=(Source(0),), train=False, after=(2,))])
    times = clock.schedule(server, [1.0, 2.0, 0.5, 0.0], edge_bytes={(0, 1): 200, (1, 2): 50, (0, 2): 400})
    assert times[3] == (7.0, 7.0)
    # Latency 8 only: 1 starts at 1 + 8 = 9, ends at 11; 2 starts at 11 + 8 = 19, ends at 19.5; the
    # server waits for 2 (no transfer for "after") and 0's old model (at 8).
    assert Clock(latency=8.0).schedule(server, [1.0, 2.0, 0.5, 0.0]) == {
        0: (0.0, 1.0), 1: (9.0, 11.0), 2: (19.0, 19.5), 3: (19.5, 19.5)}


def test_default_durations_and_finish_times():
    plan = RoundPlan(0, [Task(0), Task(1), Task(2, sources=(Source(0, fresh=True), Source(1, fresh=True)),
                                               train=False)])
    assert default_durations(plan) == {0: 1.0, 1: 1.0, 2: 0.0}
    assert Clock().schedule(plan) == Clock().schedule(plan, default_durations(plan)) == {
        0: (0.0, 1.0), 1: (0.0, 1.0), 2: (1.0, 1.0)}
    waits = {0: [], 1: [0], 2: [0, 1]}
    times = finish_times([0, 1, 2], lambda k, finish: [finish[j] for j in waits[k]], [2.0, 1.0, 3.0])
    assert times == {0: (0.0, 2.0), 1: (2.0, 3.0), 2: (3.0, 6.0)}


@pytest.mark.parametrize("m,n,k", [(3, 2, 12), (3, 0, 8), (5, 5, 12), (2, 1, 30)])
def test_round_metrics_equal_the_old_clock_metrics(m, n, k):
    timed = Clock(distribution="discrete", noise=0.2)
    timed.setup(k, seed=1)
    for r in range(5):
        for durations in (None, timed.compute_times(r)):
            plan = DADPFL(num_neighbors=m, max_wait=n).plan_round(_ctx(r, k, seed=r, durations=durations))
            old_times, old_metrics = _old_clock_metrics(plan, durations)
            assert Clock().schedule(plan, durations) == old_times
            assert Clock().round_metrics(plan, durations) == old_metrics


def test_simulate_round_with_clock_durations_equals_the_plan_schedule():
    clock = Clock(distribution="uniform", noise=0.2)
    clock.setup(12, seed=2)
    algo = DADPFL(num_neighbors=3, max_wait=2)
    for r in range(4):
        durations = clock.compute_times(r)
        plan = algo.plan_round(_ctx(r, 12, seed=r, durations=durations))
        ctx = _ctx(r, 12, seed=r, durations=durations)  # same draws again
        neighbors = algo.neighbors(ctx)
        reuse = [0] * 12
        for pos, c in enumerate(ctx.rng.permutation(12)):
            reuse[int(c)] = pos
        simulated = simulate_round(neighbors, reuse, 2, durations)
        times = clock.schedule(plan, durations)
        assert [times[c] for c in range(12)] == list(zip(simulated.start, simulated.finish))


# --- cumulative time and validation ---------------------------------------------------------------


def test_state_dict_resumes_the_total():
    clock = Clock()
    assert clock.elapsed == 0.0
    clock.advance(1.5)
    assert clock.advance(2.0) == 3.5
    state = json.loads(json.dumps(clock.state_dict()))  # plain containers only
    resumed = Clock()
    resumed.load_state_dict(state)
    assert resumed.elapsed == 3.5 and resumed.advance(0.5) == 4.0
    with pytest.raises(ValueError, match="duration"):
        clock.advance(-1.0)


@pytest.mark.parametrize("kwargs,word", [
    ({"distribution": "gamma"}, "distribution"), ({"speeds": [1.0, 0.0]}, "speeds"),
    ({"speeds": [1.0, -2.0]}, "speeds"), ({"speeds": [1.0], "distribution": "uniform"}, "speeds"),
    ({"low": 0.0}, "low"), ({"low": math.nan}, "low"), ({"high": 0.4}, "high"), ({"mean": 0}, "mean"),
    ({"std": -1.0}, "std"), ({"values": ()}, "values"), ({"values": (1.0, -2.0)}, "values"),
    ({"values": "12"}, "values"), ({"noise": -0.1}, "noise"), ({"noise": "a"}, "noise"),
    ({"min_time": 0.0}, "min_time"), ({"bandwidth": 0.0}, "bandwidth"), ({"latency": -1.0}, "latency"),
    ({"latency": math.inf}, "latency"), ({"mean": True}, "mean"),
])
def test_bad_constructor_values_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Clock(**kwargs)


def test_setup_checks_sizes():
    with pytest.raises(ValueError, match="client_speeds has 2 entries for 4 clients"):
        Clock(speeds=[1.0, 1.0]).setup(4)
    with pytest.raises(ValueError, match="num_clients"):
        Clock().setup(0)
    with pytest.raises(ValueError, match="num_servers"):
        Clock().setup(2, num_servers=-1)
    with pytest.raises(RuntimeError, match="setup"):
        Clock().compute_times(0)
    clock = Clock()
    clock.setup(2)
    with pytest.raises(ValueError, match="round_idx"):
        clock.compute_times(-1)
