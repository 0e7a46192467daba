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
