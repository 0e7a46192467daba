"""FedAvg (McMahan et al., 2017): a server samples clients, they train, it averages by sample count."""

from __future__ import annotations

from lightning_dfl.checks import is_int
from lightning_dfl.federation.algorithms.base import Algorithm, RoundContext
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task


class FedAvg(Algorithm):
    """The server (node K) samples ``clients_per_round`` of the active clients uniformly without replacement; each
    starts from the server model and trains; the server averages their fresh models weighted by
    their sample counts. Its headline accuracy is the server model on every client's test set.

    Args:
        clients_per_round: clients sampled each round (papers: 10 of 100).
    """

    name = "fedavg"
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True
    settings = ("clients_per_round",)
    num_servers = 1
    headline = "consensus"

    def __init__(self, clients_per_round: int = 10) -> None:
        if not is_int(clients_per_round):  # None (null) failed in the comparison below: a TypeError, "a bug"
            raise ValueError(f"clients_per_round must be an integer >= 1, got {clients_per_round!r}")
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        self.clients_per_round = clients_per_round

    def validate(self, num_clients: int) -> None:
        super().validate(num_clients)
        if self.clients_per_round > num_clients:
            raise ValueError(f"clients_per_round must be <= the number of clients ({num_clients}), "
                             f"got {self.clients_per_round}")

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        server = ctx.num_clients
        if ctx.participants is None:
            sampled = sorted(int(k) for k in ctx.rng.choice(ctx.num_clients, self.clients_per_round, replace=False))
        else:  # sample among the active clients (all of them when fewer are active)
            active = ctx.active_clients
            count = min(self.clients_per_round, len(active))
            sampled = sorted(int(k) for k in ctx.rng.choice(active, count, replace=False)) if count else []
        tasks = [Task(node=k, sources=(Source(server),)) for k in sampled]
        if not sampled:  # nobody is active: the server keeps its model
            return RoundPlan(ctx.round_idx, [Task(node=server, sources=(Source(server),), train=False)])
        tasks.append(Task(node=server, sources=tuple(Source(k, fresh=True) for k in sampled),
                          coefficients=tuple(float(ctx.sample_counts[k]) for k in sampled), train=False))
        return RoundPlan(ctx.round_idx, tasks, meta={"sampled": sampled})

    def consensus_sources(self, num_clients: int) -> list[Source]:
        return [Source(num_clients)]
