"""Which process owns each node of a federation sharded across processes, and what is gathered from the owners.

Node ``k`` (a client, or a server node ``K, K+1, ...``) is owned by process ``k mod N`` of the ``N`` processes
(:func:`owner_of`): its tasks run there and its round-end evaluations (a shared model on its test set, an
algorithm's per-client evaluations) too; per-client results are gathered from the owners in node order
(:meth:`Ownership.gather`), so every process holds the values one process computes, in the same order.
Round-robin keeps a plan level's tasks spread evenly whatever subset of clients takes part, and a server
lands on a fixed process like any node. One process owns every node: nothing is gathered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Ownership", "owner_of"]

T = TypeVar("T")


def owner_of(node: int, world_size: int) -> int:
    """The process that owns ``node`` among ``world_size`` processes: ``node mod world_size``."""
    return int(node) % world_size


@dataclass(frozen=True)
class Ownership:
    """This process's place among the run's processes: ``rank`` of ``world_size``, and the process group that
    carries the gathered values (a gloo group, whatever the accelerator's backend; ``None``: the default)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @classmethod
    def of_fabric(cls, fabric: Any) -> Ownership:
        """The ownership of ``fabric``'s process (launched): one process, or ``fabric.world_size`` with a gloo group."""
        if fabric.world_size == 1:
            return cls()
        import torch.distributed as dist

        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(rank=fabric.global_rank, world_size=fabric.world_size, group=group)

    def owner(self, node: int) -> int:
        """The process that owns ``node`` (:func:`owner_of`)."""
        return owner_of(node, self.world_size)

    def owns(self, node: int) -> bool:
        return self.owner(node) == self.rank

    def owned(self, nodes: Iterable[int]) -> list[int]:
        """The ``nodes`` this process owns, in the order given."""
        return [k for k in nodes if self.owns(k)]

    def gather(self, mine: Mapping[int, T], nodes: Iterable[int]) -> list[T]:
        """Every node's value of ``nodes`` in that order, each from its owner (``mine``: this process's own,
        keyed by node; picklable values). A collective: every process calls it with the same ``nodes``."""
        nodes = list(nodes)
        if self.world_size == 1:
            return [mine[k] for k in nodes]
        import torch.distributed as dist

        shares: list[Any] = [None] * self.world_size
        dist.all_gather_object(shares, dict(mine), group=self.group)
        return [shares[self.owner(k)][k] for k in nodes]
