"""Local: every client trains on its own data only (the papers' "Local" baseline)."""

from __future__ import annotations

from lightning_dfl.federation.algorithms.base import Algorithm, RoundContext
from lightning_dfl.federation.exchange.plan import RoundPlan, Task


class Local(Algorithm):
    """Local training only: no communication (the papers' "Local" baseline)."""

    name = "local"
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        return RoundPlan(ctx.round_idx, [Task(node=k) for k in ctx.active_clients])
