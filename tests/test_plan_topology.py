import numpy as np
import pytest

from lightning_dfl.federation import Clock, RoundPlan, Source, Task
from lightning_dfl.federation.algorithms import DADPFL, RoundContext
from lightning_dfl.federation.exchange.topology import (
    FullTopology,
    InDegreeTopology,
    RingTopology,
    TimeVaryingTopology,
    build_topology,
)


def test_time_varying_topology_has_exact_in_and_out_degree():
    topo = TimeVaryingTopology(num_neighbors=10)
    rng = np.random.default_rng(0)
    for round_idx in range(5):
        nbrs = topo.neighbors(100, round_idx, rng)
        out_degree = np.zeros(100, dtype=int)
        for k, ns in enumerate(nbrs):
            assert len(ns) == 10 and len(set(ns)) == 10 and k not in ns
            for j in ns:
                out_degree[j] += 1
        assert (out_degree == 10).all()


def _strongly_connected(nbrs):
    """Every client reaches every other along the edges j -> k (k hears j), and back."""
    k = len(nbrs)
    adj = np.zeros((k, k), dtype=bool)
    for receiver, senders in enumerate(nbrs):
        adj[senders, receiver] = True
    reach = np.eye(k, dtype=bool) | adj
    for _ in range(k):
        reach = reach | ((reach.astype(int) @ reach.astype(int)) > 0)
    return bool(reach.all())


@pytest.mark.parametrize("num_clients,num_neighbors", [(20, 4), (12, 2), (30, 3)])
def test_time_varying_topology_connects_every_round(num_clients, num_neighbors):
    """A shift set sharing a factor with K (K = 20: {4, 10, 12, 16}) splits the round's graph (spectral gap 0, ~3 %
    of draws at K = 20, M = 4): such sets are drawn again, so every round's graph is strongly connected."""
    topo = TimeVaryingTopology(num_neighbors=num_neighbors)
    rng = np.random.default_rng(0)
    for round_idx in range(300):
        nbrs = topo.neighbors(num_clients, round_idx, rng)
        assert _strongly_connected(nbrs), f"round {round_idx}: {nbrs}"
        assert all(len(ns) == num_neighbors for ns in nbrs)
    assert topo.neighbors(5, 0, rng) and TimeVaryingTopology(0).neighbors(6, 0, rng) == [[]] * 6


def test_time_varying_topology_changes_each_round_and_is_seeded():
    topo = TimeVaryingTopology(num_neighbors=3)
    a = topo.neighbors(20, 0, np.random.default_rng(1))
    b = topo.neighbors(20, 0, np.random.default_rng(1))
    c = topo.neighbors(20, 1, np.random.default_rng(2))
    assert a == b and a != c


def test_in_degree_topology_and_ring_and_full():
    nbrs = InDegreeTopology(4).neighbors(10, 0, np.random.default_rng(0))
    assert all(len(ns) == 4 and k not in ns for k, ns in enumerate(nbrs))
    assert RingTopology(2).neighbors(5, 0, np.random.default_rng(0))[0] == [1, 4]
    assert FullTopology().neighbors(3, 0, np.random.default_rng(0)) == [[1, 2], [0, 2], [0, 1]]


def test_topology_errors_name_the_value():
    with pytest.raises(ValueError, match="M=10, K=10"):
        TimeVaryingTopology(10).validate(10)
    with pytest.raises(ValueError, match="unknown topology 'star2'"):
        build_topology("star2", 2)
    with pytest.raises(ValueError, match="even"):
        RingTopology(3)


def test_plan_orders_dependencies_and_schedules_clock():
    tasks = [
        Task(2, sources=(Source(2), Source(0, fresh=True), Source(1, fresh=True))),
        Task(0, sources=(Source(0), Source(1))),
        Task(1, sources=(Source(1),)),
        Task(3, sources=(Source(3), Source(2, fresh=True))),
    ]
    plan = RoundPlan(0, tasks)
    order = [t.node for t in plan.order()]
    assert order.index(2) > order.index(0) and order.index(2) > order.index(1) and order.index(3) > order.index(2)
    times = Clock().schedule(plan)
    assert times[0] == (0, 1) and times[1] == (0, 1) and times[2] == (1, 2) and times[3] == (2, 3)
    m = Clock().round_metrics(plan)
    assert m["parallelism"] == 0.5 and m["delay"] == 2 and m["duration"] == 3 and m["max_parallelism"] == 0.5


def test_plan_refuses_cycles_and_missing_tasks():
    with pytest.raises(ValueError, match="cycle"):
        RoundPlan(0, [Task(0, sources=(Source(1, fresh=True),)), Task(1, sources=(Source(0, fresh=True),))])
    with pytest.raises(ValueError, match="without a task"):
        RoundPlan(0, [Task(0, sources=(Source(5, fresh=True),))])
    with pytest.raises(ValueError, match="several tasks"):
        RoundPlan(0, [Task(0), Task(0)])


def _is_topological(tasks):
    seen = set()
    for task in tasks:
        if not task.waits_for() <= seen:
            return False
        seen.add(task.node)
    return True


def test_levels_of_a_chain_and_of_a_parallel_plan():
    chain = RoundPlan(0, [Task(2, sources=(Source(1, fresh=True),)), Task(0), Task(1, after=(0,))])
    assert [[t.node for t in level] for level in chain.levels()] == [[0], [1], [2]]
    parallel = RoundPlan(0, [Task(3, sources=(Source(3), Source(1))), Task(1), Task(2)])
    assert [[t.node for t in level] for level in parallel.levels()] == [[3, 1, 2]]
    assert RoundPlan(0, []).levels() == []


def test_levels_of_dadpfl_plans_respect_every_wait():
    for seed, (m, n) in enumerate([(3, 1), (3, 3), (5, 2), (9, 9)]):
        ctx = RoundContext(seed, 10, 10, (10,) * 10, np.random.default_rng(seed))
        plan = DADPFL(num_neighbors=m, max_wait=n, topology="full" if m == 9 else "time_varying").plan_round(ctx)
        levels = plan.levels()
        depth = {t.node: d for d, level in enumerate(levels) for t in level}
        for d, level in enumerate(levels):
            assert level == [t for t in plan.tasks if depth[t.node] == d]  # the plan's order
            for task in level:
                assert all(depth[w] < d for w in task.waits_for())
                assert d == 0 or any(depth[w] == d - 1 for w in task.waits_for())
        assert _is_topological([t for level in levels for t in level])
        assert sorted(depth) == list(range(10))
        if m == n == 9:
            assert [len(level) for level in levels] == [1] * 10  # sequential
