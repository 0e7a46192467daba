"""The ``Algorithm`` interface: how a federation plans its rounds and evaluates its models."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from lightning.pytorch import Callback

from lightning_dfl.federation.plan import RoundPlan, Source
from lightning_dfl.federation.topology import Topology, build_topology


@dataclass(frozen=True)
class RoundContext:
    """What an algorithm may read when it plans a round."""

    round_idx: int
    num_rounds: int
    num_clients: int
    sample_counts: tuple[int, ...]
    rng: np.random.Generator
    #: simulated task durations per client (``None``: all 1)
    durations: tuple[float, ...] | None = None


class Algorithm:
    """Base class of federated algorithms.

    A subclass says how a round is planned (:meth:`plan_round`), whether each client keeps a
    personal mask (:attr:`personal_masks`), which callbacks it needs by default (RigL for DisPFL),
    how many server nodes it uses and which shared model, if any, is tested on every client's test
    set (:meth:`consensus_sources`). Local training itself is the worker module's.
    """

    #: short name used in logs and run folders
    name = "base"
    #: each client draws its own initial mask (else all share the module's mask)
    personal_masks = False
    #: server nodes appended after the clients (node ids K, K+1, ...)
    num_servers = 0
    #: the headline accuracy: "personal" (each client's model) or "consensus" (the shared model)
    headline = "personal"
    #: whether models travel with their masks (the mask bits are counted as communication)
    sends_masks = False

    def validate(self, num_clients: int) -> None:
        """Raise ``ValueError`` if this algorithm cannot run with ``num_clients`` clients."""
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")

    def callbacks(self) -> list[Callback]:
        """Callbacks the algorithm needs; a user callback of the same class replaces its default."""
        return []

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        raise NotImplementedError

    def consensus_sources(self, num_clients: int) -> list[Source] | None:
        """The shared model tested on every client's test set at a round's end (``None``: none)."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class GossipAlgorithm(Algorithm):
    """Base of the decentralized algorithms: a topology gives each client M in-neighbours
    (``num_neighbors``; with the ``full`` topology every client hears the K - 1 others)."""

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying") -> None:
        self.num_neighbors = num_neighbors
        self.topology = topology
        self._topology: Topology = build_topology(topology, num_neighbors)

    def validate(self, num_clients: int) -> None:
        super().validate(num_clients)
        self._topology.validate(num_clients)

    def neighbors(self, ctx: RoundContext) -> list[list[int]]:
        return self._topology.neighbors(ctx.num_clients, ctx.round_idx, ctx.rng)
