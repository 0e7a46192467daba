"""Ditto (Li, Hu, Beirami, Smith, ICML 2021, Alg. 1; baselines-notes section 2), server version.

The server (node K) holds the global model w, samples ``clients_per_round`` clients and updates
w^{t+1} = w^t + mean_i(x_i - w^t), the uniform mean of the original code (litian96/ditto,
``trainers_MTL/ditto.py``: ``simple_average`` of the updates); ``weighting: samples`` is the DA/DP
copies' sample-weighted FedAvg. A sampled client i

- computes x_i = SGD_{E_g}(w^t) (the global steps, plain local SGD), and
- updates its personal model v_i for E_p epochs with Alg. 1's personal step
  v_i <- v_i - eta (grad F_i(v_i) + lam (v_i - w^t)), w^t fixed for the whole round: SGD on
  F_i(v) + lam/2 ||v - w^t||^2 (Eq. 2's h_i), at the round's learning rate with a fresh optimizer.

v_i lives in the client store (``ditto/personal``) and starts at w^0, the initial model, as in both
codes; a client that is never sampled keeps v_i = w^0. The original alternates one personal and one
global step on the same batch; since w^t, not x_i, anchors v_i the two sequences do not interact,
and here they run one after the other so that E_g = 2 and E_p = 3 (the DA/DP scripts' ``--epochs 2
--local_epochs 3``) can differ. Only w travels: communication is FedAvg's; FLOPs count E_g + E_p epochs.

Evaluation (notes: "v_i for all K clients"): at every evaluated round's end
:meth:`Ditto.evaluate_round` tests every client's v_i on its test set (``acc/personal_mean``,
the headline); a sampled client's task also scores its new v_i (``clients.csv``), and
``acc/consensus_mean`` is w on every client, as FedAvg's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.federation.algorithms.base import TaskContext
from lightning_dfl.federation.algorithms.context import EvaluationContext, RoundContext
from lightning_dfl.federation.algorithms.fedavg import FedAvg
from lightning_dfl.federation.algorithms.training import train_locally
from lightning_dfl.federation.exchange.plan import RoundPlan
from lightning_dfl.federation.metrics.spread import personal_spread
from lightning_dfl.federation.store import ClientStore, StateField
from lightning_dfl.stats import mean_std

__all__ = ["Ditto", "PERSONAL"]

#: the store field of v_i
PERSONAL = "ditto/personal"
WEIGHTINGS = ("uniform", "samples")


class Ditto(FedAvg):
    """Ditto with a server: FedAvg on w (uniform mean of the updates by default) and a personal model
    v_i per client trained with the proximal term lam/2 ||v - w^t||^2; scored by v_i on all clients.

    Args:
        clients_per_round: clients the server samples each round (papers: 10 of 100).
        lam: lambda of the proximal term (DA/DP scripts: 0.5); 0 gives local training of v_i.
        global_epochs: E_g, epochs of x_i = SGD(w^t); ``None``: the trainer's local work.
        personal_epochs: E_p, epochs of the personal steps on v_i.
        weighting: the server's average: ``"uniform"`` (the original's mean of the updates) or
            ``"samples"`` (by sample count, the DA/DP copies and FedAvg).
    """

    name = "ditto"
    #: FedAvg's flags, declared again for its own hooks: shardable; not reads_only_sources (it reads other models)
    shardable = True
    reads_only_sources = False
    partitionable = True  # its set-up fetches the server's initial model; its hooks read sources and own nodes
    headline = "personal"

    def __init__(self, clients_per_round: int = 10, lam: float = 0.5, global_epochs: int | None = 2,
                 personal_epochs: int = 3, weighting: str = "uniform") -> None:
        super().__init__(clients_per_round)
        if not is_number(lam) or lam < 0:
            raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
        if global_epochs is not None:
            check_int("global_epochs (None: the trainer's local epochs)", global_epochs, 1)
        check_int("personal_epochs", personal_epochs, 1)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
        self.lam = float(lam)
        self.global_epochs = global_epochs
        self.personal_epochs = personal_epochs
        self.weighting = weighting

    def state_fields(self) -> list[StateField]:
        return [StateField(PERSONAL, like="weights", dtype=None)]

    def init_state(self, store: ClientStore, num_clients: int) -> None:
        """Every client's v_i starts at w^0, the server's (node K's) initial model; a resume then loads v_i. On
        several processes each holding its own nodes, every process fetches w^0 and writes its own clients'."""
        store.fetch([(num_clients, False)])
        initial, _ = store.published(num_clients)
        for k in range(num_clients):
            store.write(k, PERSONAL, initial)

    def evaluate_round(self, ctx: EvaluationContext) -> dict[str, float]:
        """At an evaluated round: every client's v_i on its test set (``acc/personal_mean|std``, the headline, and
        their spread ``acc/personal_min|p10|max|count``, in place of the shared model's trained copies')."""
        if not ctx.evaluates:
            return {}
        mine = {}
        for k in ctx.clients:  # each process its own clients
            ctx.load(ctx.store.read(k, PERSONAL), ctx.store.mask(k), apply=False)
            mine[k] = ctx.test(k)
        accuracies = ctx.gather(mine)
        mean, std = mean_std(accuracies)
        return {"acc/personal_mean": mean, "acc/personal_std": std, **personal_spread(accuracies),
                "acc/personal_count": float(len(accuracies))}

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        plan = super().plan_round(ctx)
        if self.weighting == "uniform":  # w^{t+1} = w^t + mean(x_i - w^t) = mean(x_i)
            plan = RoundPlan(plan.round_idx, [replace(t, coefficients=None) for t in plan.tasks], plan.meta)
        return plan

    def local_train(self, ctx: TaskContext) -> float:
        """x_i = SGD_{E_g}(w^t), then E_p epochs of personal steps on v_i; the worker ends with x_i
        (what the client sends), v_i goes to the store."""
        anchor = ctx.worker_weights()  # w^t, fixed for the round
        loss = train_locally(self, ctx, self.global_epochs)  # None: the trainer's local work
        shared = ctx.worker_weights()
        ctx.load_weights(ctx.store.read(ctx.node, PERSONAL))
        ctx.scratch["anchor"] = anchor
        self.configure_optimizer(ctx)
        train_locally(self, ctx, self.personal_epochs)
        del ctx.scratch["anchor"]
        ctx.write(PERSONAL, ctx.worker_weights())  # staged: a non-finite v_i is contained with the task's x_i
        ctx.load_weights(shared)
        return loss

    def loss(self, ctx: TaskContext, batch: Any) -> Tensor:
        """F_i(v) + lam/2 ||v - w^t||^2 during the personal epochs (its gradient is Alg. 1's personal
        step), the plain loss otherwise."""
        loss = super().loss(ctx, batch)
        anchor = ctx.scratch.get("anchor")
        if anchor is not None and self.lam:
            params = ctx.module.model.named_parameters()
            loss = loss + self.lam / 2 * sum((p - anchor[n]).pow(2).sum() for n, p in params)
        return loss

    def evaluate(self, ctx: TaskContext, stage: str) -> float | Tensor | None:
        """``"aggregated"``: w^t; ``"trained"``: the client's new v_i (all K are scored at the round's end)."""
        if stage != "trained":
            return super().evaluate(ctx, stage)
        sent = ctx.worker_weights()
        ctx.load_weights(ctx.read(PERSONAL))
        acc = super().evaluate(ctx, stage)
        ctx.load_weights(sent)
        return acc
