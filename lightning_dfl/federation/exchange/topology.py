"""Who hears whom: each round, every client's in-neighbours (itself excluded)."""

from __future__ import annotations

import numpy as np

from lightning_dfl.checks import check_int
from lightning_dfl.registry import Registry


class Topology:
    """Base class: ``neighbors(round_idx, rng)`` lists each client's in-neighbours for one round."""

    name = "base"

    def __init__(self, num_neighbors: int) -> None:
        self.num_neighbors = check_int("num_neighbors", num_neighbors, 0)

    def validate(self, num_clients: int) -> None:
        """Raise if this topology cannot connect ``num_clients`` clients."""
        if self.num_neighbors >= num_clients:
            raise ValueError(f"num_neighbors (M) must be < the number of clients (K): got M={self.num_neighbors}, "
                             f"K={num_clients}")

    def neighbors(self, num_clients: int, round_idx: int, rng: np.random.Generator) -> list[list[int]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_neighbors={self.num_neighbors})"


class TimeVaryingTopology(Topology):
    """A fresh random directed graph each round; every client receives from exactly M others and
    sends to exactly M others (the papers' busiest-node bound, DisPFL Sec. 4.1).

    Built as M edge-disjoint random derangements: the clients are placed on a random cycle and
    each client receives from the clients M distinct random shifts away. Every round's graph is
    connected: a shift set whose members all share a factor with K (e.g. K = 20, shifts {4, 10, 12,
    16}) splits the cycle into gcd(K, shifts) separate graphs (spectral gap 0), so such a set is
    drawn again (about 3.3 % of draws at K = 20, M = 4; none when K is prime).
    """

    name = "time_varying"

    def neighbors(self, num_clients: int, round_idx: int, rng: np.random.Generator) -> list[list[int]]:
        self.validate(num_clients)
        order = rng.permutation(num_clients)
        position = np.empty(num_clients, dtype=np.int64)
        position[order] = np.arange(num_clients)
        shifts = rng.choice(np.arange(1, num_clients), size=self.num_neighbors, replace=False)
        while len(shifts) and np.gcd.reduce([num_clients, *shifts]) > 1:  # disconnected: draw the shifts again
            shifts = rng.choice(np.arange(1, num_clients), size=self.num_neighbors, replace=False)
        return [sorted(int(order[(position[k] + s) % num_clients]) for s in shifts) for k in range(num_clients)]


class InDegreeTopology(Topology):
    """Each client receives from M others drawn uniformly at random, fresh each round (the authors'
    code: the in-degree is M, the out-degree varies)."""

    name = "time_varying_in_degree"

    def neighbors(self, num_clients: int, round_idx: int, rng: np.random.Generator) -> list[list[int]]:
        self.validate(num_clients)
        result = []
        for k in range(num_clients):
            others = np.delete(np.arange(num_clients), k)
            result.append(sorted(int(j) for j in rng.choice(others, size=self.num_neighbors, replace=False)))
        return result


class RingTopology(Topology):
    """A fixed ring: client k hears the ``num_neighbors`` nearest clients on either side (M even)."""

    name = "ring"

    def __init__(self, num_neighbors: int = 2) -> None:
        super().__init__(num_neighbors)
        if num_neighbors % 2:
            raise ValueError(f"a ring needs an even num_neighbors (as many on each side), got {num_neighbors}")

    def neighbors(self, num_clients: int, round_idx: int, rng: np.random.Generator) -> list[list[int]]:
        self.validate(num_clients)
        half = self.num_neighbors // 2
        return [sorted({(k + d) % num_clients for d in range(-half, half + 1) if d}) for k in range(num_clients)]


class FullTopology(Topology):
    """Every client hears all the others (M = K - 1, whatever ``num_neighbors`` an algorithm has)."""

    name = "full"

    def __init__(self) -> None:
        super().__init__(0)

    def validate(self, num_clients: int) -> None:
        """Any number of clients can be fully connected."""

    def neighbors(self, num_clients: int, round_idx: int, rng: np.random.Generator) -> list[list[int]]:
        return [[j for j in range(num_clients) if j != k] for k in range(num_clients)]


#: Name -> topology class (each class's ``name``).
TOPOLOGIES: Registry[type[Topology]] = Registry(
    "topology", [(cls.name, cls) for cls in (TimeVaryingTopology, InDegreeTopology, RingTopology, FullTopology)]
)


def build_topology(name: str, num_neighbors: int) -> Topology:
    """A topology by name: one of :data:`TOPOLOGIES` (``"full"`` ignores ``num_neighbors``)."""
    cls = TOPOLOGIES.get(name)
    return FullTopology() if cls is FullTopology else cls(num_neighbors)
