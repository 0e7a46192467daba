"""DA-DPFL (Long et al.): dynamic aggregation with in-round reuse, sparse-to-sparser pruning."""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_dfl.callbacks.pqi import PQIPruning
from lightning_dfl.callbacks.rigl import RigL
from lightning_dfl.callbacks.voting import PruningTimeVoting
from lightning_dfl.federation.algorithms.base import RoundContext, TopologyAlgorithm
from lightning_dfl.federation.algorithms.dadpfl_waits import reuse_dependencies
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.sparse.rigl import REGROWTH_MODES


class DADPFL(TopologyAlgorithm):
    """DA-DPFL (Alg. 1): dynamic aggregation over a reuse order, with pruning-time voting and PQI pruning.

    Each round one random reuse permutation orders the clients; client k
    waits for at most ``max_wait`` (N) of its prior neighbours, the N that finish earliest, and
    aggregates the models they trained in this round with the start-of-round models of its other
    neighbours (Eq. 7). After E local epochs it votes on the pruning time (Eq. 4-5), prunes by the
    PQ index at the pruning rounds of Eq. 6 while its sparsity is below s* (Alg. 2), publishes the
    post-PQI model and searches its next mask with RigL (Alg. 3).

    N = 0 is parallel DFL (DisPFL with DA-DPFL's pruning); N = M = K - 1 on a full topology is
    sequential FL.

    Args:
        num_neighbors: M, the neighbours each client aggregates per round.
        topology: how neighbours are drawn.
        max_wait: N, at most this many prior neighbours are waited for.
        drop_fraction: RigL's initial drop fraction alpha_0 of the cosine schedule (Alg. 3), in [0, 1].
        regrowth: how RigL regrows weights: by gradient magnitude or at random (Alg. 3).
        gradient_batches: batches whose dense gradient scores RigL's regrowth, at most (a client with fewer uses all
            of its own).
        delta_pr: pruning threshold of Eq. 5, > 0 (the papers use 0.01-0.03).
        delta_v: voting threshold, the share of stable votes that decides the pruning time, in (0, 1].
        b: delay of the first pruning round (Eq. 6), >= 0.
        c: scale of the pruning frequency (Eq. 6), > 0; with c > 1 pruning intensifies.
        target_sparsity: s*, the share of zeros over the masked set PQI pruning reaches, in [0, 1).
        p: lower norm index of the PQ index, 0 < p < q (Alg. 2).
        q: upper norm index of the PQ index, q >= 1 (Alg. 2).
        eta_c: PQI's compression hyper-parameter, >= 0 (Alg. 2).
        gamma: PQI's scaling factor, >= 0 (Alg. 2).
        beta: the largest share of a layer's active weights one pruning event may remove, in [0, 1].
    """

    name = "dadpfl"
    #: N, the threshold and sparsity the paper sweeps, and RigL's drop fraction the authors set per data set
    settings = ("max_wait", "delta_pr", "target_sparsity", "drop_fraction")
    shardable = True  # no state changes inside tasks (its callbacks speak the sharding protocol)
    partitionable = True  # its hooks read other nodes as sources only
    reads_only_sources = True
    personal_masks = True
    sends_masks = True

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying", max_wait: int = 10,
                 drop_fraction: float = 0.5, regrowth: str = "gradient", gradient_batches: int = 1,
                 delta_pr: float = 0.03, delta_v: float = 0.5, b: float = 0.0, c: float = 1.3,
                 target_sparsity: float = 0.8, p: float = 0.5, q: float = 1.0, eta_c: float = 0.0,
                 gamma: float = 1.0, beta: float = 0.9) -> None:
        super().__init__(num_neighbors, topology)
        if max_wait < 0:
            raise ValueError(f"max_wait (N) must be >= 0, got {max_wait}")
        if regrowth not in REGROWTH_MODES:
            raise ValueError(f"unknown regrowth {regrowth!r}; allowed: {', '.join(REGROWTH_MODES)}")
        self.max_wait = max_wait
        self.drop_fraction = drop_fraction
        self.regrowth = regrowth
        self.gradient_batches = gradient_batches
        self.delta_pr, self.delta_v, self.b, self.c = delta_pr, delta_v, b, c
        self.target_sparsity = target_sparsity
        self.p, self.q, self.eta_c, self.gamma, self.beta = p, q, eta_c, gamma, beta
        self.callbacks()  # validate the callbacks' settings now, before any training

    def validate(self, num_clients: int) -> None:
        super().validate(num_clients)
        most = num_clients - 1 if self.topology == "full" else self.num_neighbors
        if self.max_wait > most:
            raise ValueError(f"max_wait (N) must be <= the number of neighbours M={most}, got {self.max_wait}")

    def callbacks(self) -> list[Callback]:
        return [
            PruningTimeVoting(delta_pr=self.delta_pr, delta_v=self.delta_v, b=self.b, c=self.c),
            PQIPruning(target_sparsity=self.target_sparsity, p=self.p, q=self.q, eta_c=self.eta_c,
                       gamma=self.gamma, beta=self.beta),
            RigL(drop_fraction=self.drop_fraction, regrowth=self.regrowth, gradient_batches=self.gradient_batches),
        ]

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        neighbors = self.neighbors(ctx)
        order = ctx.rng.permutation(ctx.num_clients)
        if ctx.participants is not None:  # inactive clients neither train nor send: nobody waits for them
            active = set(ctx.participants)
            neighbors = [[j for j in nbs if j in active] if k in active else [] for k, nbs in enumerate(neighbors)]
        reuse_index = [0] * ctx.num_clients
        for position, client in enumerate(order):
            reuse_index[int(client)] = position
        waits = reuse_dependencies(neighbors, reuse_index, self.max_wait, ctx.durations)
        taking_part = set(ctx.active_clients)
        tasks = []
        for client in (int(c) for c in order if int(c) in taking_part):
            fresh = set(waits[client])
            tasks.append(Task(node=client, sources=(Source(client), *(Source(j, fresh=j in fresh)
                                                                        for j in neighbors[client]))))
        return RoundPlan(ctx.round_idx, tasks, meta={"reuse_order": [int(c) for c in order]})
