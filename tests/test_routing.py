"""What moves between processes before a plan level: each source a task's process does not own, once."""

from lightning_dfl.federation import RoundPlan, Source, Task
from lightning_dfl.federation.exchange.routing import Route, level_routes, plan_routes
from lightning_dfl.federation.loop.ownership import owner_of


def two(node):
    return owner_of(node, 2)


def test_a_parallel_level_moves_each_missing_source_once_per_receiver():
    plan = RoundPlan(0, [Task(0, (Source(0), Source(1), Source(2))), Task(1, (Source(1), Source(3))),
                         Task(2, (Source(2), Source(1))), Task(3, (Source(3), Source(0), Source(2)))])
    (level,) = plan.levels()
    # process 0 runs clients 0 and 2 and needs client 1 once; process 1 runs 1 and 3 and needs 0 and 2
    assert level_routes(level, two) == [Route(1, False, 1, 0), Route(0, False, 0, 1), Route(2, False, 0, 1)]
    assert level_routes(level, lambda node: 0) == []  # one process owns every node: nothing moves


def test_chains_and_a_server_move_fresh_models_level_by_level():
    server = 4  # PSFL's shape: a chain 0 -> 1 started from the server's model, then the server reads its end
    plan = RoundPlan(0, [Task(0, (Source(server),)), Task(1, (Source(0, fresh=True),)),
                         Task(server, (Source(1, fresh=True),), train=False)])
    assert plan_routes(plan, two) == [[], [Route(0, True, 0, 1)], [Route(1, True, 1, 0)]]
    # three processes: the server is process 1's, so is client 1: the chain's end needs no transfer
    assert plan_routes(plan, lambda node: owner_of(node, 3)) == [[Route(server, False, 1, 0)],
                                                                 [Route(0, True, 0, 1)], []]


def test_a_tasks_replicas_move_like_start_of_round_sources_but_are_not_sources():
    # BEER's shape: client 1 dropped out; its ring neighbours 0 and 2 mix in the replicas they hold of it
    plan = RoundPlan(0, [Task(0, (Source(0), Source(3)), replicas=(1,)), Task(2, (Source(2), Source(3)), replicas=(1,)),
                         Task(3, (Source(3), Source(0), Source(2)))])
    (level,) = plan.levels()
    # process 0 runs 0 and 2: it needs 3 once and the replica of 1 once; process 1 runs 3 and needs 0 and 2
    assert level_routes(level, two) == [Route(3, False, 1, 0), Route(1, False, 1, 0), Route(0, False, 0, 1),
                                        Route(2, False, 0, 1)]
    assert all(s.node != 1 for t in plan.tasks for s in t.receives_from())  # no message, no transfer time
    assert plan.tasks[0].waits_for() == set()  # a replica is a start-of-round record: nothing to wait for


def test_beer_lists_its_absent_neighbours_as_replicas():
    import numpy as np

    from lightning_dfl.federation.algorithms import BEER
    from lightning_dfl.federation.algorithms.context import RoundContext

    ctx = RoundContext(round_idx=3, num_rounds=5, num_clients=6, sample_counts=(10,) * 6,
                       rng=np.random.default_rng(0), participants=(0, 2, 3, 5))
    plan = BEER(num_neighbors=2).plan_round(ctx)
    by_node = {t.node: t for t in plan.tasks}
    assert sorted(by_node) == [0, 2, 3, 5]  # ring neighbours: k - 1 and k + 1
    assert [s.node for s in by_node[0].sources] == [0, 5] and by_node[0].replicas == (1,)
    assert [s.node for s in by_node[2].sources] == [2, 3] and by_node[2].replicas == (1,)
    assert [s.node for s in by_node[3].sources] == [3, 2] and by_node[3].replicas == (4,)
    assert [s.node for s in by_node[5].sources] == [5, 0] and by_node[5].replicas == (4,)
