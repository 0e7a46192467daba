"""A round as a plan of tasks with "after" edges (its clock: ``lightning_dfl.federation.loop.clock``).

Parallel DFL (every task reads start-of-round models), DA-DPFL's in-round reuse (a task reads
the fresh models of the prior neighbours it waits for), PSFL's chains (each task reads its
predecessor's fresh model) and a server's aggregation (a non-training task that reads the
sampled clients' fresh models) are all plans. The executor runs tasks in :meth:`RoundPlan.order`;
results depend only on the plan and the seed, never on how independent tasks are interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def every_and_last(round_idx: int, every: int, rounds: int) -> bool:
    """Whether round ``round_idx`` (from 0) of ``rounds`` is on an "every ``every`` rounds, and the last"
    schedule (evaluations, diagnostics)."""
    return (round_idx + 1) % every == 0 or round_idx == rounds - 1


@dataclass(frozen=True)
class Source:
    """A model a task aggregates: ``node``'s start-of-round model, or if ``fresh`` the one it
    publishes in this round (the task then runs after ``node``'s task)."""

    node: int
    fresh: bool = False


@dataclass(frozen=True)
class Task:
    """One node's work in a round.

    Args:
        node: the client (or server) that runs it.
        sources: the models it aggregates first (include the node itself to keep its own model);
            empty: it starts from its own published model.
        coefficients: aggregation weights of the sources (``None``: all 1, DA-DPFL Eq. 7).
        train: whether it runs local epochs (a server's task does not).
        after: further nodes whose tasks must end before this one starts.
        replicas: nodes whose start-of-round published state the task reads without a message this round
            (what its node kept of them from earlier rounds: BEER's replicas of a neighbour that dropped
            out). They move between processes like sources, and are never counted, timed or mixed.
    """

    node: int
    sources: tuple[Source, ...] = ()
    coefficients: tuple[float, ...] | None = None
    train: bool = True
    after: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()

    def waits_for(self) -> set[int]:
        return {s.node for s in self.sources if s.fresh} | set(self.after)

    def receives_from(self) -> list[Source]:
        """The sources that cross the network (all but the node itself)."""
        return [s for s in self.sources if s.node != self.node]


@dataclass
class RoundPlan:
    """The tasks of one round; at most one task per node."""

    round_idx: int
    tasks: list[Task]
    meta: dict = field(default_factory=dict)
    #: ``(sender, receiver, bytes)`` of control messages the plan itself needed (PRISAM's mask
    #: collection and group labels), counted as side information before the tasks run
    side_transfers: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        nodes = [t.node for t in self.tasks]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"round {self.round_idx}: a node has several tasks: {sorted(nodes)}")
        by_node = set(nodes)
        for task in self.tasks:
            missing = task.waits_for() - by_node
            if missing:
                raise ValueError(f"round {self.round_idx}: node {task.node} waits for nodes without a task: "
                                 f"{sorted(missing)}")
            if task.coefficients is not None and len(task.coefficients) != len(task.sources):
                raise ValueError(f"node {task.node}: {len(task.coefficients)} coefficients for "
                                 f"{len(task.sources)} sources")
        self._order = self._topological_order()

    def _topological_order(self) -> list[Task]:
        by_node = {t.node: t for t in self.tasks}
        pending = {t.node: len(t.waits_for()) for t in self.tasks}
        dependents: dict[int, list[int]] = {t.node: [] for t in self.tasks}
        for t in self.tasks:
            for d in t.waits_for():
                dependents[d].append(t.node)
        index = {t.node: i for i, t in enumerate(self.tasks)}
        ready = sorted((n for n, c in pending.items() if c == 0), key=index.__getitem__)
        order: list[Task] = []
        while ready:
            node = ready.pop(0)
            order.append(by_node[node])
            for d in dependents[node]:
                pending[d] -= 1
                if pending[d] == 0:
                    ready.append(d)
            ready.sort(key=index.__getitem__)
        if len(order) != len(self.tasks):
            stuck = sorted(n for n, c in pending.items() if c > 0)
            raise ValueError(f"round {self.round_idx}: the plan has a cycle among nodes {stuck}")
        return order

    def order(self) -> list[Task]:
        """Tasks in a dependency-respecting order (ties in the plan's own order)."""
        return list(self._order)

    def levels(self) -> list[list[Task]]:
        """Tasks by dependency depth: level 0 waits for nobody, level d's deepest dependency is at
        level d - 1; each level in the plan's order (their concatenation is a topological order)."""
        depth: dict[int, int] = {}
        for task in self._order:
            depth[task.node] = 1 + max((depth[d] for d in task.waits_for()), default=-1)
        levels: list[list[Task]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
        for task in self.tasks:
            levels[depth[task.node]].append(task)
        return levels
