"""D-PSGD (Lian et al., 2017): decentralized parallel SGD with uniform neighbourhood averaging."""

from __future__ import annotations

from lightning_dfl.federation.algorithms.base import RoundContext, TopologyAlgorithm, parallel_plan
from lightning_dfl.federation.exchange.plan import RoundPlan, Source


class DPSGD(TopologyAlgorithm):
    """D-PSGD (Lian et al., 2017): uniform average of itself and its neighbours' models, then local
    epochs. All clients share one mask (dense unless the module's density is below 1). Its shared
    model, tested on every client, is the average of all clients' models; ``headline="personal"``
    reports each client's own model instead (PRISAM's "FedAvg" baseline, prisam-notes 13).

    Args:
        num_neighbors: M, the neighbours each client averages with per round.
        topology: how neighbours are drawn.
        headline: the reported accuracy: "consensus" (the average model) or "personal" (each client's own).
    """

    name = "dpsgd"
    settings = ("headline",)  # which accuracy it reports, not how it trains
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True
    headline = "consensus"

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying", headline: str = "consensus") -> None:
        super().__init__(num_neighbors, topology)
        if headline not in ("consensus", "personal"):
            raise ValueError(f"headline must be 'consensus' (the average model on every client's test set) or "
                             f"'personal' (each client's own model, PRISAM's baseline), got {headline!r}")
        self.headline = headline

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        return parallel_plan(ctx, self.neighbors(ctx))

    def consensus_sources(self, num_clients: int) -> list[Source]:
        return [Source(k) for k in range(num_clients)]
