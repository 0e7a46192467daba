"""The reads of start-of-round models a round's plan has still to make (:class:`StartReads`), so that a store
can free a node's start-of-round model once it holds the node's new one and no task will read the old one
again (:meth:`~lightning_dfl.federation.store.protocol.ClientStore.release_start`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dfl.federation.exchange.plan import RoundPlan, Task

__all__ = ["StartReads"]


class StartReads:
    """The reads of start-of-round models a plan has still to make; ``release(node)`` is called when the last
    read of ``node``'s start-of-round model has been made.

    A node's start-of-round model is read by every task that lists it as a non-fresh source (when the
    task starts: its messages), by every task that lists it as a replica (until that task ends) and by the
    node's own task (the model it starts from, and falls back to when its update is non-finite: until the
    task ends). :meth:`started` and :meth:`finished` report them
    (the executor's ``sources_read`` and ``task_ended``).
    Nodes without a task keep their one model and are never released.
    """

    def __init__(self, plan: RoundPlan, release: Callable[[int], None]) -> None:
        self.release = release
        self.pending: Counter[int] = Counter()
        nodes = {task.node for task in plan.tasks}
        #: per task, the replicas it reads until it ends (those of nodes with a task: the others are never released)
        self.replicas = {task.node: [k for k in task.replicas if k in nodes and k != task.node] for task in plan.tasks}
        for task in plan.tasks:
            self.pending[task.node] += 1
            for node in [*self._others(task), *self.replicas[task.node]]:
                self.pending[node] += 1

    @staticmethod
    def _others(task: Task) -> list[int]:
        return [s.node for s in task.sources if not s.fresh and s.node != task.node]

    def _read(self, node: int) -> None:
        self.pending[node] -= 1
        if self.pending[node] == 0:
            self.release(node)

    def started(self, task: Task) -> None:
        """``task`` has read its sources (its messages are built)."""
        for node in self._others(task):
            self._read(node)

    def finished(self, task: Task) -> None:
        """``task`` has ended (its node has published; its replicas are read)."""
        for node in self.replicas[task.node]:
            self._read(node)
        self._read(task.node)
