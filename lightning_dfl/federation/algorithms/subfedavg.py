"""Sub-FedAvg, unstructured (Vahidian et al., 2021, "Personalized Federated Learning by Structured and
Unstructured Pruning under Data Heterogeneity"; code MMorafah/Sub-FedAvg ``main_u.py``,
``src/client/client_u.py``, ``src/sub_fedavg/sub_fedavg_u.py``), as baselines-notes section 9 states its
original rule.

Each client keeps a personal mask m_i (the store's mask of the node; all ones at the start: the
module's density 1). A sampled client starts from w * m_i, trains E epochs with masked gradients
and derives two candidate masks by pruning p of the alive weights of each layer by magnitude: m1
after epoch 1, m2 after epoch E. If their Hamming distance exceeds ``dist_thresh`` and the client
has not reached its target density, it applies m2 (capped so that it lands on the target) and keeps
it only if its accuracy then exceeds ``acc_thresh``; else it reverts. The server averages each
weight over the clients that hold it, ``w = sum_k x_k / sum_k m_k`` (positions nobody holds keep the
server's value; unmasked tensors: the plain mean). Evaluation: w * m_i on every client.

Three of the code's behaviours that the notes do not take are options (each named in the run's label):

* ``headline="own_model"``: ``main_u.py``'s score, each client's own last-trained net (its
  ``clients[idx].eval_test()``, main_u.py:276 and 322-334, on ``self.net``, which after a task is the trained
  and pruned-or-reverted model, client_u.py:112); a client never sampled still holds the initial model
  (main_u.py:168-172). Here that net is the client's published model in the store (what it sent the
  server; every node starts from the initial model).
* ``second_mask_epoch=5``: client_u.py:70-71 takes m2 after epoch 5 whatever E; with E < 5, m2 stays the
  mask the client started with (client_u.py:41), so the step changes nothing unless it is the landing step
  (client_u.py:93 prunes the final net again).
* ``landing_cap=0.05``: client_u.py:85-93: when the pruned share plus p would pass the target share
  (``pruning_target - pruned < percent``), the step prunes the share of the alive weights that lands on the
  target, at most 5 % (``if percent > 5: percent = 5``), of the final net.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.federation.algorithms.base import TaskContext
from lightning_dfl.federation.algorithms.context import EvaluationContext
from lightning_dfl.federation.algorithms.fedavg import FedAvg
from lightning_dfl.federation.algorithms.tally import RoundTally, TalliedTasks
from lightning_dfl.federation.algorithms.training import train_locally
from lightning_dfl.federation.exchange.aggregation import masked_average
from lightning_dfl.federation.exchange.messages import Message, gather_messages, masked_codec
from lightning_dfl.federation.exchange.plan import Source
from lightning_dfl.federation.metrics.evaluation import accuracy
from lightning_dfl.federation.store import StateField
from lightning_dfl.sparse.masks import Masks
from lightning_dfl.sparse.select import smallest_k_mask
from lightning_dfl.stats import mean_std

#: the round in which a client's published mask last changed (-1: never), sent with its model
MASK_ROUND = "subfedavg/mask_round"
#: what the headline scores: w * m_i on every client (the notes), or each client's own last-trained net (main_u.py)
SUBFEDAVG_HEADLINES = ("subnetwork", "own_model")


def hamming(m1: Masks, m2: Masks) -> float:
    """The mean over layers of the share of entries where the masks differ (``dist_masks``)."""
    return sum(float((m1[n] != m2[n]).float().mean()) for n in m1) / max(len(m1), 1)


@torch.no_grad()
def magnitude_prune(weights: dict[str, Tensor], masks: Masks, counts: dict[str, int]) -> Masks:
    """Each layer's mask less its ``counts[name]`` active entries of smallest |w| (ties: lower index)."""
    out: Masks = {}
    for name, mask in masks.items():
        flat = mask.reshape(-1).bool()
        score = weights[name].detach().abs().reshape(-1).masked_fill(~flat, math.inf)
        out[name] = (flat & ~smallest_k_mask(score, counts[name])).view_as(mask)
    return out


def prune_counts(masks: Masks, fraction: float, target_active: int, cap: float | None = None) -> dict[str, int]:
    """How many alive weights of each layer a prune step removes.

    ``cap=None`` (ours): ``round(fraction * alive)`` per layer (``fake_prune``'s percentile), or, where that
    would pass the target, exactly the ``alive - target_active`` weights spread over the layers in proportion
    to their alive counts (largest remainders first): the step lands on the target.

    ``cap`` a share (client_u.py:85-93): the landing step is taken when the pruned share plus ``fraction``
    would pass the target share (line 86, ``pruning_target - pruned < percent``: ``alive - target_active <
    fraction * size``, ``size`` the masked entries); it prunes the share of the alive weights that lands on the
    target (line 89), but at most ``cap`` of each layer's alive weights (lines 91-92, the code's 5 %). Uncapped,
    the step lands exactly (as ours); capped, ``round(cap * alive)`` per layer. Either way a step never
    passes the target.
    """
    alive = {n: int(m.sum()) for n, m in masks.items()}
    total = sum(alive.values())
    need = max(total - target_active, 0)
    share = fraction
    if cap is not None and need < fraction * sum(m.numel() for m in masks.values()):  # line 86: the landing step
        if need <= cap * total:
            return _spread(alive, need)  # line 89's share, within the cap: it lands
        share = cap  # lines 91-92
    counts = {n: int(math.floor(share * a + 0.5)) for n, a in alive.items()}
    if total - sum(counts.values()) >= target_active:
        return counts
    return _spread(alive, need)


def _spread(alive: dict[str, int], need: int) -> dict[str, int]:
    """``need`` prunings spread over the layers in proportion to their ``alive`` counts (largest remainders
    first; ties keep the layer order)."""
    total = sum(alive.values())
    exact = {n: need * a / total for n, a in alive.items()} if total else {n: 0.0 for n in alive}
    counts = {n: int(math.floor(e)) for n, e in exact.items()}
    order = sorted(alive, key=lambda n: -(exact[n] - counts[n]))  # stable: ties keep the layer order
    for n in order[: need - sum(counts.values())]:
        counts[n] += 1
    return counts


@torch.no_grad()
def holder_mean(messages: list[Message], server: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sum_k x_k / sum_k m_k`` per position (``Sub_FedAVG_U``); positions no client holds keep
    ``server``'s value; unmasked tensors take the plain mean."""
    weights, masks = gather_messages(messages)
    average = masked_average(weights, masks)
    for name, held in masks.items():
        nobody = ~held[0].bool()
        for m in held[1:]:
            nobody &= ~m.bool()
        average[name][nobody] = server[name][nobody].to(average[name].dtype)
    return average


class SubFedAvg(TalliedTasks, FedAvg):
    """Sub-FedAvg (unstructured) on the engine's star: FedAvg's sampling, personal masks in the store.

    Args:
        clients_per_round: clients the server samples each round (papers: 10 of 100).
        prune_fraction: p, the share of each layer's alive weights a candidate mask prunes (code 0.1).
        target_density: the density (share of the masked set kept) at which pruning stops (code: 30%
            pruned, 0.7; the DisPFL copy 0.5).
        dist_thresh: the Hamming distance between m1 and m2 above which a client prunes (code 1e-4).
        acc_thresh: the accuracy (in [0, 1]) on the client's test set that a pruned model must exceed to
            be kept (code 50%).
        headline: what the headline scores: ``"subnetwork"`` (the notes: the server's model under each
            client's mask, w * m_i, ``acc/subnetwork_mean``) or ``"own_model"`` (``main_u.py``'s score: each
            client's own last-trained net, the initial model for a client never sampled,
            ``acc/own_model_mean``; :meth:`evaluate_round`).
        second_mask_epoch: the epoch after which m2 is taken: ``None`` (the notes: after the last, E) or an
            epoch e >= 1 (client_u.py:70: 5 whatever E; with E < e m2 is the mask the client started with).
            With ``local_steps``, after e passes over the client's data.
        landing_cap: ``None`` (ours: a step that would pass the target lands exactly on it) or a share c in
            (0, 1]: client_u.py:85-93's landing step, at most c of each layer's alive weights (code 0.05;
            :func:`prune_counts`).

    Logged: ``acc/subnetwork_mean|std`` (w * m_i on every client's test set, the notes' evaluation and
    the headline, ``acc/headline``, so it compares with the other methods; ``acc/personal_mean`` is only
    the sampled clients' trained models), with ``headline="own_model"`` also ``acc/own_model_mean|std``
    (the headline then), ``subfedavg/density_mean`` (over all clients), ``subfedavg/pruned_clients``
    (accepted prunings this round), ``flops/check``.
    """

    name = "subfedavg"
    #: FedAvg's flags, declared again for its own hooks: shardable; not reads_only_sources (it reads other models)
    shardable = True
    reads_only_sources = False
    partitionable = True  # its message reads the source's published mask round; its evaluation fetches the server
    headline = "subnetwork"  # baselines-notes 9: w * m_i on every client's test set
    phrases = {"headline": "scored on own model", "second_mask_epoch": "second mask after epoch {value}",
               "landing_cap": "landing step capped at {value}"}

    def __init__(self, clients_per_round: int = 10, prune_fraction: float = 0.1, target_density: float = 0.7,
                 dist_thresh: float = 1e-4, acc_thresh: float = 0.5, headline: str = "subnetwork",
                 second_mask_epoch: int | None = None, landing_cap: float | None = None) -> None:
        super().__init__(check_int("clients_per_round", clients_per_round, 1))
        if not is_number(prune_fraction) or not 0.0 < prune_fraction < 1.0:
            raise ValueError(f"prune_fraction (p) must be a number in (0, 1), got {prune_fraction!r}")
        if not is_number(target_density) or not 0.0 < target_density <= 1.0:
            raise ValueError(f"target_density must be a number in (0, 1], got {target_density!r}")
        if not is_number(dist_thresh) or not 0.0 <= dist_thresh <= 1.0:
            raise ValueError(f"dist_thresh must be a number in [0, 1], got {dist_thresh!r}")
        if not is_number(acc_thresh) or not 0.0 <= acc_thresh <= 1.0:
            raise ValueError(f"acc_thresh must be an accuracy in [0, 1], got {acc_thresh!r}")
        if headline not in SUBFEDAVG_HEADLINES:
            raise ValueError(f"unknown headline {headline!r}; allowed: {', '.join(SUBFEDAVG_HEADLINES)}")
        if second_mask_epoch is not None:
            check_int("second_mask_epoch (None: after the last epoch)", second_mask_epoch, 1)
        if landing_cap is not None and (not is_number(landing_cap) or not 0.0 < landing_cap <= 1.0):
            raise ValueError(f"landing_cap must be None (land exactly on the target) or a share in (0, 1], "
                             f"got {landing_cap!r}")
        self.headline = headline
        self.second_mask_epoch = second_mask_epoch
        self.landing_cap = None if landing_cap is None else float(landing_cap)
        self.prune_fraction = float(prune_fraction)
        self.target_density = float(target_density)
        self.dist_thresh = float(dist_thresh)
        self.acc_thresh = float(acc_thresh)
        self.tally = RoundTally(pruned=0, flops=0.0, tasks=0)

    def state_fields(self) -> list[StateField]:
        return [*super().state_fields(), StateField(MASK_ROUND, dtype=torch.int64, fill=-1, published=True)]

    def evaluate_round(self, ctx: EvaluationContext) -> dict[str, float]:
        """Every round: the clients' mean density (``subfedavg/density_mean``); at evaluated rounds the
        server's model under each client's personal mask, w * m_i, on that client's test set
        (``acc/subnetwork_mean|std``, the headline by default), and with ``headline="own_model"`` each
        client's own net on its test set (``acc/own_model_mean|std``, the headline then; :meth:`own_models`)."""
        store, server = ctx.store, ctx.num_clients
        densities = ctx.gather({k: float(sum(int(m.sum()) for m in store.mask(k).values()) / max(store.masked_size(), 1))
                                for k in ctx.clients})
        metrics = {"subfedavg/density_mean": sum(densities) / len(densities)}
        if not ctx.evaluates:
            return metrics
        store.fetch([(server, False)])  # from its owner where each process holds its own nodes
        weights, _ = store.published(server)
        mine = {}
        for k in ctx.clients:  # each process its own clients
            ctx.load(weights, store.mask(k))
            mine[k] = ctx.test(k)
        mean, std = mean_std(ctx.gather(mine))
        metrics.update({"acc/subnetwork_mean": mean, "acc/subnetwork_std": std})
        if self.headline == "own_model":
            metrics.update(self.own_models(ctx))
        return metrics

    def own_models(self, ctx: EvaluationContext) -> dict[str, float]:
        """main_u.py's score (its lines 322-334 after the last round, 273-289 every ``print_freq`` rounds): each
        client's ``self.net`` on its test set. That net is what the client's last task left (trained, then its
        pruning kept or reverted: client_u.py:112), the initial model if it was never sampled (main_u.py:168-172):
        the model it published, which the store keeps until its next task (every node starts from the initial
        model). Each process scores the clients it owns."""
        mine = {}
        for k in ctx.clients:
            weights, mask = ctx.store.published(k)
            ctx.load(weights, mask, apply=False)  # as published: zero outside its mask
            mine[k] = ctx.test(k)
        mean, std = mean_std(ctx.gather(mine))
        return {"acc/own_model_mean": mean, "acc/own_model_std": std}

    def consensus_sources(self, num_clients: int) -> None:
        return None  # the dense server model alone is not what Sub-FedAvg evaluates (see evaluate_round)

    # -- communication: sparse both ways -----------------------------------------------------------
    def message(self, ctx: TaskContext, source: Source) -> Message:
        """Server -> client: the entries of the client's mask (it knows its mask). Client -> server: its
        active values, with its mask bits when the mask changed this round."""
        store, server = ctx.store, ctx.num_clients
        weights, mask = store.published(source.node, source.fresh)
        if source.node == server and ctx.node != server:
            return masked_codec(False).encode(weights, store.mask(ctx.node), sender=server,
                                              masked_names=store.masked_names)
        changed = source.fresh and int(store.read(source.node, MASK_ROUND, True)) == ctx.round_idx
        return masked_codec(changed).encode(weights, mask, sender=source.node, masked_names=store.masked_names,
                                             active_values=store.active_values(source.node, source.fresh))

    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        """w * m_i: the server's model (the executor applies the client's own mask)."""
        (message,) = messages
        return message.weights

    def server_step(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor]:
        return holder_mean(messages, ctx.store.published(ctx.node)[0])

    def publish_fields(self, ctx: TaskContext) -> dict[str, Any]:
        """This round as :data:`MASK_ROUND` when the mask the client publishes differs from the one it published
        before (its message then carries the mask bits); else nothing (the field keeps its round)."""
        before = ctx.store.published(ctx.node)[1]
        mask = ctx.module.mask.masks
        changed = any(not torch.equal(mask[n], before[n]) for n in before)
        return {MASK_ROUND: ctx.round_idx} if changed else {}

    # -- a client ----------------------------------------------------------------------------------------
    def local_train(self, ctx: TaskContext) -> float:
        """E epochs (m1 after the first, m2 after the last or ``second_mask_epoch``), then the pruning decision
        (``client_u.train``, client_u.py:33-116)."""
        mask = ctx.module.mask
        epochs, steps = ctx.local_epochs, ctx.local_steps
        attribute, total, first, second = self._mask_points(ctx)
        loss_sum, seen, candidates, done = 0.0, 0, {}, 0
        for cut in sorted({c for c in (first, second, total) if c is not None and c > 0}):
            setattr(ctx, attribute, cut - done)
            before = ctx.train_batches.samples
            loss = train_locally(self, ctx)
            n = ctx.train_batches.samples - before
            loss_sum, seen, done = loss_sum + (loss * n if n else 0.0), seen + n, cut
            if cut in (first, second):
                candidates[cut] = self._candidate(ctx)
        ctx.local_epochs, ctx.local_steps = epochs, steps
        self.tally.add(tasks=1)
        loss = loss_sum / seen if seen else float("nan")
        if not math.isfinite(loss) or not candidates:
            return loss
        started = {n: m.clone() for n, m in mask.masks.items()}
        m1 = candidates[first]
        m2 = started if second is None else candidates[second]  # client_u.py:41: m2 starts as the mask
        distance = hamming(m1, m2)
        ctx.report["subfedavg/hamming"] = distance
        if distance <= self.dist_thresh or mask.num_active() <= self._target_active(mask):
            return loss
        if self._counts(mask) != self._counts(mask, landing=False):
            m2 = self._candidate(ctx)  # the landing step prunes the final net (client_u.py:93)
        elif second is None:
            return loss  # m2 is the mask it has: applying it changes nothing (the code still checks it)
        old_weights = ctx.worker_weights()
        mask.load_(m2, apply=True)  # m2, capped at the target
        test = ctx.test_batches()
        accepted = accuracy(ctx.module, ctx.fabric, test) > self.acc_thresh
        self.tally.add(flops=getattr(test, "samples", 0) * ctx.module.forward_flops(), pruned=int(accepted))
        if not accepted:
            mask.load_(started, apply=False)
            ctx.load_weights(old_weights)
        ctx.report["subfedavg/accepted"] = float(accepted)
        return loss

    def _mask_points(self, ctx: TaskContext) -> tuple[str, int, int, int | None]:
        """The task's local work as ``(attribute, total, first, second)``: in epochs (``local_epochs``) or steps
        (``local_steps``, a pass = the client's batches), where m1 and m2 are taken (``second`` ``None``: past
        the end, m2 is the mask the client started with)."""
        epochs, steps = ctx.local_epochs, ctx.local_steps
        if steps is None:
            second = epochs if self.second_mask_epoch is None else self.second_mask_epoch
            return "local_epochs", epochs, min(1, epochs), second if second <= epochs else None
        per_pass = len(ctx.train_batches)
        second = steps if self.second_mask_epoch is None else self.second_mask_epoch * per_pass
        return "local_steps", steps, min(steps, per_pass), second if second <= steps else None

    def _target_active(self, mask: Any) -> int:
        return math.ceil(self.target_density * mask.num_masked() - 1e-9)

    def _counts(self, mask: Any, landing: bool = True) -> dict[str, int]:
        """The prune step's counts per layer (:func:`prune_counts`); ``landing=False``: plain p of each layer."""
        if not landing:
            return {n: int(math.floor(self.prune_fraction * int(m.sum()) + 0.5)) for n, m in mask.masks.items()}
        return prune_counts(mask.masks, self.prune_fraction, self._target_active(mask), self.landing_cap)

    def _candidate(self, ctx: TaskContext) -> Masks:
        mask = ctx.module.mask
        weights = {n: p.detach() for n, p in mask.params.items()}
        return magnitude_prune(weights, mask.masks, self._counts(mask))

    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        tally = self.tally.take()
        flops = tally["flops"]
        out = {"subfedavg/pruned_clients": float(tally["pruned"]), "flops/check": flops}
        if flops:
            out["flops/train_total"] = metrics.get("flops/train_total", 0.0) + flops
            out["flops/train_per_client"] = metrics.get("flops/train_per_client", 0.0) + flops / max(tally["tasks"], 1)
        return out
