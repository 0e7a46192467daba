"""Which published models must move between processes before a plan level runs, from whom to whom.

With the nodes owned by processes (``owner(node)``), a task runs on its node's owner and reads its plan's
sources there. A source the owner does not hold must come from the source node's owner: a :class:`Route`.
:func:`level_routes` lists them for one level, each ``(node, fresh)`` once per receiving process, in the
level's order; :func:`plan_routes` for every level of a plan. A task's replicas (start-of-round records it
reads without a message) travel the same way. What a task's hooks read beyond its sources and replicas (an
algorithm without :attr:`~lightning_dfl.federation.algorithms.base.Algorithm.reads_only_sources`) is not in
the plan, so not here. ``benchmarks/sharded_scale.py`` compares the routes' bytes with what today's
broadcast moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_dfl.federation.exchange.plan import RoundPlan, Task

__all__ = ["Route", "level_routes", "plan_routes"]


@dataclass(frozen=True)
class Route:
    """``node``'s published model (this round's if ``fresh``, else its start-of-round one) sent by its owner
    ``sender`` to ``receiver``, whose tasks read it."""

    node: int
    fresh: bool
    sender: int
    receiver: int


def level_routes(level: Sequence[Task], owner: Callable[[int], int]) -> list[Route]:
    """The routes one level needs: for each task (in level order) each source (then each replica: a start-of-round
    record) its runner does not own, once per ``(receiver, node, fresh)``."""
    routes: list[Route] = []
    seen: set[tuple[int, int, bool]] = set()
    for task in level:
        receiver = owner(task.node)
        for node, fresh in [*((s.node, s.fresh) for s in task.sources), *((k, False) for k in task.replicas)]:
            sender = owner(node)
            key = (receiver, node, fresh)
            if sender != receiver and key not in seen:
                seen.add(key)
                routes.append(Route(node, fresh, sender, receiver))
    return routes


def plan_routes(plan: RoundPlan, owner: Callable[[int], int]) -> list[list[Route]]:
    """:func:`level_routes` of each of ``plan``'s levels, in order."""
    return [level_routes(level, owner) for level in plan.levels()]

