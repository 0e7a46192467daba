"""Parallel decentralized algorithms: DisPFL, D-PSGD, and Local training."""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_dfl.callbacks.rigl import RigL
from lightning_dfl.federation.algorithms.base import (
    Algorithm,
    RoundContext,
    TopologyAlgorithm,
)
from lightning_dfl.federation.plan import RoundPlan, Source, Task
from lightning_dfl.sparse.rigl import REGROWTH_MODES


def parallel_plan(ctx: RoundContext, neighbors: list[list[int]]) -> RoundPlan:
    """Every participating client aggregates itself and its participating neighbours' start-of-round
    models, all in parallel."""
    active = ctx.active_clients
    taking_part = set(active)
    tasks = [Task(node=k, sources=(Source(k), *(Source(j) for j in neighbors[k] if j in taking_part)))
             for k in active]
    return RoundPlan(ctx.round_idx, tasks)


class DisPFL(TopologyAlgorithm):
    """DisPFL (Dai et al., ICML 2022, Alg. 1-2): personal ERK masks, masked gossip averaging
    (Alg. 1 line 7), masked local SGD, then RigL's local mask search (Alg. 2).

    Args:
        num_neighbors: M, the in-neighbours of each client per round.
        topology: see :data:`lightning_dfl.federation.topology.TOPOLOGIES`.
        drop_fraction: alpha_0 of the cosine drop schedule alpha_t = alpha_0/2 (1 + cos(pi t/T)).
        regrowth: ``"gradient"`` (RigL) or ``"random"`` (DisPFL's published runs).
        gradient_batches: local batches whose dense gradient scores regrowth.
    """

    name = "dispfl"
    shardable = True  # no state changes inside tasks
    reads_only_sources = True  # its tasks read their sources and their own start-of-round model only
    personal_masks = True
    sends_masks = True

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying", drop_fraction: float = 0.5,
                 regrowth: str = "gradient", gradient_batches: int = 1) -> None:
        super().__init__(num_neighbors, topology)
        if not 0.0 <= drop_fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1], got {drop_fraction}")
        if regrowth not in REGROWTH_MODES:
            raise ValueError(f"unknown regrowth {regrowth!r}; allowed: {', '.join(REGROWTH_MODES)}")
        if gradient_batches < 1:
            raise ValueError(f"gradient_batches must be >= 1, got {gradient_batches}")
        self.drop_fraction = drop_fraction
        self.regrowth = regrowth
        self.gradient_batches = gradient_batches

    def callbacks(self) -> list[Callback]:
        return [RigL(drop_fraction=self.drop_fraction, regrowth=self.regrowth,
                     gradient_batches=self.gradient_batches)]

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        return parallel_plan(ctx, self.neighbors(ctx))


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
    shardable = True  # no state changes inside tasks
    reads_only_sources = True  # its tasks read their sources and their own start-of-round model only
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


class Local(Algorithm):
    """Local training only: no communication (the papers' "Local" baseline)."""

    name = "local"
    shardable = True  # no state changes inside tasks
    reads_only_sources = True  # its tasks read their sources and their own start-of-round model only

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        return RoundPlan(ctx.round_idx, [Task(node=k) for k in ctx.active_clients])
