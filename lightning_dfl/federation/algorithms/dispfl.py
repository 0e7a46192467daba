"""DisPFL (Dai et al., ICML 2022): personal sparse masks, masked gossip averaging, RigL mask search."""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_dfl.callbacks.rigl import RigL
from lightning_dfl.federation.algorithms.base import RoundContext, TopologyAlgorithm, parallel_plan
from lightning_dfl.federation.exchange.plan import RoundPlan
from lightning_dfl.sparse.rigl import REGROWTH_MODES


class DisPFL(TopologyAlgorithm):
    """DisPFL (Dai et al., ICML 2022, Alg. 1-2): personal ERK masks, masked gossip averaging
    (Alg. 1 line 7), masked local SGD, then RigL's local mask search (Alg. 2).

    Args:
        num_neighbors: M, the in-neighbours of each client per round.
        topology: see :data:`lightning_dfl.federation.exchange.topology.TOPOLOGIES`.
        drop_fraction: alpha_0 of the cosine drop schedule alpha_t = alpha_0/2 (1 + cos(pi t/T)).
        regrowth: ``"gradient"`` (RigL) or ``"random"`` (DisPFL's published runs).
        gradient_batches: local batches whose dense gradient scores regrowth, at most (a client with fewer uses all
            of its own).
    """

    name = "dispfl"
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True
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
