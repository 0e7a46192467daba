"""FedFomo (Zhang et al., ICLR 2021, "Personalized Federated Learning with First Order Model
Optimization"; code NVlabs/FedFomo ``federation.py``, ``client.py``), as baselines-notes section 8
states its original rule.

Decentralized, every active client every round (as the DisPFL authors run it), with the original
update order (aggregate, then train). Client i holds a validation split and an affinity row P_i
(the store field ``fedfomo/affinity``, length K). Each round it picks M of the other clients by
epsilon-greedy on P_i (``get_federating_clients``: epsilon_t = max(0.3 - 0.05 t, 0) chance to take
the next random client, else the next by affinity), receives their start-of-round models and weighs
each on its validation loss (``compute_fomo_weights``, ``update_client_weights``, ``federate``)::

    w_ij = (L_i(theta_i) - L_i(theta_j)) / ||theta_j - theta_i||        (0 when theta_j = theta_i)
    theta_i <- theta_i + sum_j max(w_ij, 0) / sum_k max(w_ik, 0) (theta_j - theta_i)   (none > 0: kept)
    P_ij <- P_ij + w_ij

with theta_i its own start-of-round model; then E local epochs.

The validation split (20%) is made here, fixed per client: the datamodule keeps no validation split
and ``TaskContext`` carries none (see the class docstring).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.federation.algorithms.base import Algorithm, RoundContext, TaskContext
from lightning_dfl.federation.algorithms.context import CountingBatches
from lightning_dfl.federation.algorithms.tally import RoundTally, TalliedTasks
from lightning_dfl.federation.exchange.messages import Message
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.federation.store import StateField
from lightning_dfl.seeding import derive_seed

AFFINITY = "fedfomo/affinity"
AFFINITY_UPDATES = ("raw", "normalized")
#: the headline accuracy: ``"personal"`` (each client's model after local training, the common setting) or
#: ``"aggregated"`` (after aggregation, before training: the original's ``local_eval``, main.py lines 323-329)
FOMO_HEADLINES = ("personal", "aggregated")


def epsilon_at(round_idx: int, epsilon: float = 0.3, decay: float = 0.05) -> float:
    """The exploration chance of round ``round_idx`` (from 0): ``max(epsilon - decay t, 0)``."""
    return max(epsilon - decay * round_idx, 0.0)


def epsilon_greedy(affinity: Sequence[float], candidates: Sequence[int], count: int, epsilon: float,
                   rng: np.random.Generator) -> list[int]:
    """``count`` distinct candidates: each pick takes, with probability ``epsilon``, the next of a random
    order, else the next by affinity (descending, ties in random order) not yet chosen."""
    candidates = list(candidates)
    scores = np.asarray([float(affinity[c]) for c in candidates])
    top = [candidates[i] for i in np.lexsort((rng.random(len(candidates)), -scores))]
    shuffled = [candidates[i] for i in rng.permutation(len(candidates))]
    chosen: list[int] = []
    for _ in range(min(count, len(candidates))):
        order = shuffled if rng.random() < epsilon else top
        chosen.append(next(c for c in order if c not in chosen))
    return chosen


def fomo_weights(own_loss: float, losses: Sequence[float], distances: Sequence[float]) -> list[float]:
    """``(L(theta_i) - L(theta_j)) / ||theta_j - theta_i||``, 0 where the distance is 0 (the 0/0 guard)."""
    return [(own_loss - loss) / d if d > 0 else 0.0 for loss, d in zip(losses, distances)]


@torch.no_grad()
def fomo_combine(own: dict[str, Tensor], models: Sequence[dict[str, Tensor]],
                 weights: Sequence[float]) -> dict[str, Tensor] | None:
    """``own + sum_j w_j+ / sum_k w_k+ (model_j - own)`` over the floating entries; ``None`` (keep
    ``own``) when no weight is positive."""
    positive = [max(w, 0.0) for w in weights]
    total = sum(positive)
    if total <= 0:
        return None
    out = {n: t.clone() for n, t in own.items()}
    for model, w in zip(models, positive):
        if w > 0:
            for n, t in out.items():
                if t.is_floating_point():
                    t.add_(model[n].to(t.device, t.dtype) - own[n], alpha=w / total)
    return out


class _Shuffled:
    """Re-iterable batches of fixed tensors, re-shuffled each pass by ``generator``."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, generator: torch.Generator) -> None:
        self.x, self.y, self.batch_size, self.generator = x, y, batch_size, generator

    def __len__(self) -> int:
        return math.ceil(len(self.y) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = torch.randperm(len(self.y), generator=self.generator).to(self.y.device)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            yield self.x[idx], self.y[idx]


class FedFomo(TalliedTasks, Algorithm):
    """FedFomo, decentralized: epsilon-greedy neighbours from an affinity row, validation-loss weights.

    Args:
        num_neighbors: M, models each client receives per round (papers: 10; the code's default 8).
        epsilon: the initial exploration chance (0.3).
        epsilon_decay: its decrease per round (0.05).
        val_fraction: the share of the client's training pass held out for the weights (0.2).
        affinity_update: ``"raw"`` (P_ij += w_ij, the paper) or ``"normalized"`` (the code's
            w_ij / |sum_k w_ik|).
        headline: the reported accuracy: ``"personal"`` (after local training, as every method here is
            scored) or ``"aggregated"`` (``acc/aggregated_mean``: each client's aggregated model before it
            trains, as the original scores it: ``server.initialize_clients`` then ``server.local_eval``, then
            ``local_train``, main.py lines 323-329; its extra aggregation after the last round, lines 382-385,
            is not run: the last row is the last round's aggregation). Labelled "scored after aggregation".

    The split: one pass of the client's training batches drawn by a generator seeded by (seed, client)
    only, so the same samples in the same order every round (:meth:`split`; the datamodule's batches,
    drawn through the task context's ``draw_train_batches``); the first ``val_fraction`` are its
    validation set, the rest is what it trains on, re-shuffled each round. Augmented data sets (CIFAR)
    thus train on one fixed augmentation per sample; a datamodule option (``validation_fraction``, with
    ``client_val_batches(k)`` and training batches that exclude it) would restore fresh augmentation.
    Logged: ``fedfomo/positive`` (share of received models with w > 0) and ``flops/validation``
    ((M + 1) forward passes over the validation split, added to ``flops/train_*``).
    """

    name = "fedfomo"
    settings = ("num_neighbors",)
    phrases = {"headline": "scored after aggregation"}
    shardable = True
    reads_only_sources = True  # its plan names the M models each client receives
    partitionable = True  # and its hooks read other nodes as sources only

    def __init__(self, num_neighbors: int = 10, epsilon: float = 0.3, epsilon_decay: float = 0.05,
                 val_fraction: float = 0.2, affinity_update: str = "raw", headline: str = "personal") -> None:
        self.num_neighbors = check_int("num_neighbors (M)", num_neighbors, 1)
        if not is_number(epsilon) or not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be a number in [0, 1], got {epsilon!r}")
        if not is_number(epsilon_decay) or epsilon_decay < 0:
            raise ValueError(f"epsilon_decay must be a number >= 0, got {epsilon_decay!r}")
        if not is_number(val_fraction) or not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
        if affinity_update not in AFFINITY_UPDATES:
            raise ValueError(f"unknown affinity_update {affinity_update!r}; allowed: {', '.join(AFFINITY_UPDATES)}")
        if headline not in FOMO_HEADLINES:
            raise ValueError(f"unknown headline {headline!r}; allowed: {', '.join(FOMO_HEADLINES)}")
        self.headline = headline
        self.epsilon, self.epsilon_decay = float(epsilon), float(epsilon_decay)
        self.val_fraction = float(val_fraction)
        self.affinity_update = affinity_update
        self._num_clients = 0
        self.tally = RoundTally(flops=0.0, tasks=0, positive=0, received=0)

    def validate(self, num_clients: int) -> None:
        super().validate(num_clients)
        if self.num_neighbors >= num_clients:
            raise ValueError(f"num_neighbors (M) must be < the number of clients (K): got M={self.num_neighbors}, "
                             f"K={num_clients}")
        self._num_clients = num_clients

    def state_fields(self) -> list[StateField]:
        return [StateField(AFFINITY, shape=(self._num_clients,), dtype=torch.float64)]

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        """Each active client receives the M others it picks by epsilon-greedy on its affinity row (:meth:`choose`;
        the rows are read from their owners), in id order: only those M send."""
        active = ctx.active_clients
        store = ctx.store
        rows = store.gather_nodes(lambda k: store.read(k, AFFINITY).tolist(), active)
        tasks = []
        for k, affinity in zip(active, rows):
            chosen = set(self.choose(ctx, k, affinity))
            tasks.append(Task(node=k, sources=(Source(k), *(Source(j) for j in active if j in chosen))))
        return RoundPlan(ctx.round_idx, tasks)

    def choose(self, ctx: RoundContext, client: int, affinity: Sequence[float]) -> list[int]:
        """``client``'s M neighbours among the other active clients, by epsilon-greedy on its ``affinity`` row
        (``get_federating_clients``; the stream ``fedfomo/choose`` of the round and client), in pick order."""
        candidates = [j for j in ctx.active_clients if j != client]
        rng = np.random.default_rng(derive_seed(ctx.seed, "fedfomo/choose", ctx.round_idx, client))
        eps = epsilon_at(ctx.round_idx, self.epsilon, self.epsilon_decay)
        return epsilon_greedy(affinity, candidates, self.num_neighbors, eps, rng)

    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        """The weights and update on the client's validation split with the worker (theta_i), and P_i's update."""
        val, train, batch_size = self.split(ctx)
        ctx.scratch["fedfomo/train"] = (train, batch_size)
        return self.update(ctx, [m for m in messages if m.sender != ctx.node], val)  # None: theta_i is kept

    def split(self, ctx: TaskContext) -> tuple[list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor], int]:
        """The client's fixed split: one pass of its training batches drawn by a generator seeded by
        ``(seed, "fedfomo/split", client)`` alone (the same samples, in the same order, every round); the
        first ``val_fraction`` are its validation batches, the rest its training samples."""
        generator = torch.Generator().manual_seed(derive_seed(ctx.seed, "fedfomo/split", ctx.node))
        batches = ctx.draw_train_batches(ctx.node, generator)
        batch_size = batches.batch_size
        drawn = list(batches)
        if not drawn:
            empty = torch.empty(0)
            return [], (empty, empty), batch_size
        x, y = torch.cat([b[0] for b in drawn]), torch.cat([b[1] for b in drawn])
        n_val = min(max(int(round(self.val_fraction * len(y))), 1), len(y) - 1) if len(y) > 1 else 0
        val = [(x[i:min(i + batch_size, n_val)], y[i:min(i + batch_size, n_val)]) for i in range(0, n_val, batch_size)]
        return val, (x[n_val:], y[n_val:]), batch_size

    # -- the task ------------------------------------------------------------------------------------
    def local_train(self, ctx: TaskContext) -> float:
        """E epochs on the client's training part of the split (re-shuffled by the stream ``fedfomo/train``)."""
        original = ctx.train_batches
        (x, y), batch_size = ctx.scratch.pop("fedfomo/train")
        ctx.train_batches = CountingBatches(_Shuffled(x, y, batch_size, ctx.generator("fedfomo/train")))
        try:
            loss = super().local_train(ctx)
        finally:
            original.samples, ctx.train_batches = ctx.train_batches.samples, original  # FLOPs: the samples trained on
        return loss

    @torch.no_grad()
    def update(self, ctx: TaskContext, messages: list[Message],
               val: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor] | None:
        """The weights, the update and P_ij += w_ij for the received ``messages`` on the validation batches ``val``; returns
        the new model (``None``: no positive weight, theta_i is kept). The weights go to ``ctx.scratch``."""
        own = ctx.worker_weights()
        if not val:
            return None
        names = [n for n, _ in ctx.module.model.named_parameters() if n in own]
        own_loss = self._loss(ctx, val)
        losses, distances = [], []
        for m in messages:
            ctx.load_weights(m.weights)
            losses.append(self._loss(ctx, val))
            distances.append(math.sqrt(sum(float((m.weights[n].to(own[n].device) - own[n]).double().pow(2).sum())
                                           for n in names)))
        weights = fomo_weights(own_loss, losses, distances)
        combined = fomo_combine(own, [m.weights for m in messages], weights)
        ctx.load_weights(own)
        ctx.scratch["fedfomo/weights"] = dict(zip((m.sender for m in messages), weights))
        affinity = ctx.store.read(ctx.node, AFFINITY).clone()
        scale = abs(sum(weights)) if self.affinity_update == "normalized" else 1.0
        for m, w in zip(messages, weights):
            affinity[m.sender] += w / max(scale, 1e-9)
        ctx.write(AFFINITY, affinity)  # staged: committed with the task's update
        self.tally.add(flops=(len(messages) + 1) * sum(len(b[1]) for b in val) * ctx.module.forward_flops(), tasks=1,
                       positive=sum(w > 0 for w in weights), received=len(weights))
        ctx.report["fedfomo/positive"] = float(sum(w > 0 for w in weights))
        return combined

    @staticmethod
    def _loss(ctx: TaskContext, batches: list[tuple[Tensor, Tensor]]) -> float:
        with ctx.fabric.autocast():
            _, total, loss_sum = ctx.module.evaluate(batches)
        return loss_sum / total

    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        tally = self.tally.take()
        flops, received = tally["flops"], tally["received"]
        out = {"flops/validation": flops, "fedfomo/positive": tally["positive"] / received if received else 0.0}
        if flops:
            out["flops/train_total"] = metrics.get("flops/train_total", 0.0) + flops
            out["flops/train_per_client"] = metrics.get("flops/train_per_client", 0.0) + flops / max(tally["tasks"], 1)
        return out
