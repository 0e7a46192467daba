"""FedAvg-FT and D-PSGD-FT (DisPFL, Dai et al., ICML 2022, App. B.4; baselines-notes section 1): the
shared model, fine-tuned on each client's local data before that client's evaluation.

Training is FedAvg's or D-PSGD's, unchanged. At every evaluated round (``trainer.eval_every``; the
last round always) every client k computes x_k^FT = SGD_E(w) from the shared model w (FedAvg: the
server's model; D-PSGD: the consensus x-bar = the mean of all K clients' models), as one full local
round at the code's round index -1 (lr = lr_0 / lr_decay, the authors' ``client.train(w, -1)``),
and is scored by x_k^FT on its own test set. The fine-tuned models are thrown away: nothing that
trains or travels changes.

Metrics: ``acc/finetune_mean|std|min|p10|max|count`` (the fine-tuned models, also ``acc/personal_*`` and so
``acc/headline``), ``acc/consensus_mean|std`` (the shared model itself, as in FedAvg/D-PSGD),
``acc/trained_mean|std|min|p10|max|count`` (what the round's tasks published: FedAvg's sampled clients, D-PSGD's
clients), ``flops/finetune_total|per_client`` (the fine-tuning's 3 x forward FLOPs per sample, kept
out of ``flops/train_*``). The fine-tuning is an evaluation: its download of w is not counted as
communication and it takes no simulated time.

When: the authors' FedAvg-FT fine-tunes once, after round T; their D-PSGD-FT every 100 rounds
(round % 100 == 99, which includes T = 500). Here it follows the evaluation schedule, so that
``acc/headline`` is a fine-tuned accuracy at every round that has one (``acc/best`` never compares
fine-tuned with plain numbers): ``eval_every: 100`` is the authors' D-PSGD-FT schedule,
``eval_every: T`` FedAvg-FT's "after round T"; the final round, the one reported, is the same.
"""

from __future__ import annotations

import torch

from lightning_dfl.checks import check_int
from lightning_dfl.federation.algorithms.context import EvaluationContext
from lightning_dfl.federation.algorithms.dpsgd import DPSGD
from lightning_dfl.federation.algorithms.fedavg import FedAvg
from lightning_dfl.federation.metrics.spread import personal_spread
from lightning_dfl.seeding import derive_seed
from lightning_dfl.stats import mean_std

__all__ = ["DPSGDFT", "FedAvgFT"]

#: the round index the fine-tuning's learning rate is taken at (lr_0 x lr_decay^-1, the authors' code)
FINETUNE_ROUND = -1


class _FineTuned:
    """The fine-tuning evaluation added to a method with a shared model (mixed in before it)."""

    headline = "personal"  # each client's personal model is its fine-tuned copy of the shared model
    settings = ("finetune_epochs",)

    def _init_finetune(self, finetune_epochs: int | None) -> None:
        if finetune_epochs is not None:
            check_int("finetune_epochs (None: the trainer's local epochs)", finetune_epochs, 0)
        self.finetune_epochs = finetune_epochs

    def evaluate_round(self, ctx: EvaluationContext) -> dict[str, float]:
        """At an evaluated round: fine-tune the shared model (:meth:`~Algorithm.consensus_sources`, averaged)
        on every client with the algorithm's own :meth:`~Algorithm.configure_optimizer` and
        :meth:`~Algorithm.local_train` at round index -1 (``finetune_epochs``, or the trainer's local work),
        test it on the client's test set; ``acc/finetune_*`` and ``flops/finetune_*``."""
        metrics = dict(super().evaluate_round(ctx))  # type: ignore[misc]
        if not ctx.evaluates:
            return metrics
        found = ctx.shared_model()
        if found is None:
            raise ValueError(f"{type(self).__name__} has no shared model (consensus_sources) to fine-tune")
        shared, mask = found
        epochs = ctx.local_epochs if self.finetune_epochs is None else self.finetune_epochs
        steps = ctx.local_steps if self.finetune_epochs is None else None
        mine = {}
        for k in ctx.clients:  # each process its own clients
            ctx.load(shared, mask)
            torch.manual_seed(derive_seed(ctx.seed, "finetune/torch", ctx.round_idx, k))
            generator = torch.Generator().manual_seed(derive_seed(ctx.seed, "finetune", ctx.round_idx, k))
            batches = ctx.draw_train_batches(k, generator)
            task = ctx.task(k, FINETUNE_ROUND, epochs, steps, batches)
            self.configure_optimizer(task)  # type: ignore[attr-defined]
            if epochs or steps:
                with torch.enable_grad():
                    self.local_train(task)  # type: ignore[attr-defined]
            mine[k] = (ctx.test(k), batches.samples * 3 * ctx.module.forward_flops())
        ctx.optimizer.state.clear()
        ctx.load_weights(shared)  # the worker holds the shared model again, as the round left it
        gathered = ctx.gather(mine)
        flops = 0.0
        for _, client_flops in gathered:  # added in client order, as one process adds them
            flops += client_flops
        accuracies = [acc for acc, _ in gathered]
        mean, std = mean_std(accuracies)
        metrics.update({"acc/finetune_mean": mean, "acc/finetune_std": std, **personal_spread(accuracies, "acc/finetune"),
                        "acc/finetune_count": float(len(accuracies)), "flops/finetune_total": flops,
                        "flops/finetune_per_client": flops / ctx.num_clients})
        return metrics

    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The fine-tuned models are the clients' personal models (the headline, with their spread); what the
        round's tasks published moves to ``acc/trained_*``."""
        out = dict(super().round_metrics(metrics))  # type: ignore[misc]
        if "acc/finetune_mean" in metrics:
            for stat in ("mean", "std", "min", "p10", "max", "count"):
                if f"acc/personal_{stat}" in metrics:
                    out[f"acc/trained_{stat}"] = metrics[f"acc/personal_{stat}"]
                out[f"acc/personal_{stat}"] = metrics[f"acc/finetune_{stat}"]
        return out


class FedAvgFT(_FineTuned, FedAvg):
    """FedAvg-FT (DisPFL App. B.4): FedAvg (McMahan et al., 2017), then at each evaluated round every
    client fine-tunes the server model w with one local round, x_k^FT = SGD_E(w) at lr_0 / lr_decay,
    and is scored by x_k^FT.

    Args:
        clients_per_round: clients the server samples each round (papers: 10 of 100).
        finetune_epochs: E of the fine-tuning; ``None`` (default): the trainer's local epochs (a full round).
    """

    name = "fedavg_ft"
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only; its fine-tuning the shared model

    def __init__(self, clients_per_round: int = 10, finetune_epochs: int | None = None) -> None:
        super().__init__(clients_per_round)
        self._init_finetune(finetune_epochs)


class DPSGDFT(_FineTuned, DPSGD):
    """D-PSGD-FT (DisPFL App. B.4): D-PSGD (Lian et al., 2017), then at each evaluated round every client
    fine-tunes the consensus model x-bar = (1/K) sum_k x_k with one local round, SGD_E(x-bar) at
    lr_0 / lr_decay, and is scored by it.

    Args:
        num_neighbors: M, the in-neighbours of each client per round.
        topology: see :data:`lightning_dfl.federation.exchange.topology.TOPOLOGIES`.
        finetune_epochs: E of the fine-tuning; ``None`` (default): the trainer's local epochs (a full round).
    """

    name = "dpsgd_ft"
    shardable = True
    partitionable = True  # its hooks read other nodes as sources only; its fine-tuning the shared model

    def __init__(self, num_neighbors: int = 10, topology: str = "time_varying",
                 finetune_epochs: int | None = None) -> None:
        super().__init__(num_neighbors, topology, headline="personal")
        self._init_finetune(finetune_epochs)
