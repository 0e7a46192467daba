"""FedDST (Bibikar et al., AAAI 2022, "Federated Dynamic Sparse Training"; code bibikar/feddst ``dst.py``),
as baselines-notes section 3 states its original rule.

A server (node K) holds the global model w and one global ERK mask m at the module's density. Each
round it samples clients; a sampled client starts from w AND m, trains x = w * m (the mask hooks keep
it masked) and, on readjustment rounds, readjusts its mask at the end of local training:
it drops the alpha_t share of its active weights by magnitude and regrows as many by the |gradient|
of its last minibatch (``Client.train``'s ``layer_prune``/``layer_grow``; here
:func:`~lightning_dfl.sparse.rigl.rigl_masks`: each layer keeps its count). The server aggregates
elementwise over the holders (``dst.py``'s aggregation)::

    w = sum_k n_k x_k m_k / sum_k n_k m_k        (0/0 -> 0; unmasked tensors: sample-weighted mean)

and, where the union of the clients' masks is denser than the ERK budget, prunes each layer by
magnitude back to its budget (``layer_prune``); what it keeps is the new global mask m.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.checks import check_int, is_number
from lightning_dfl.federation.algorithms.base import RoundContext, TaskContext
from lightning_dfl.federation.algorithms.fedavg import FedAvg
from lightning_dfl.federation.algorithms.tally import RoundTally, TalliedTasks
from lightning_dfl.federation.exchange.aggregation import masked_average
from lightning_dfl.federation.exchange.messages import Message, gather_messages, masked_codec
from lightning_dfl.federation.exchange.plan import RoundPlan, Source
from lightning_dfl.sparse.masks import Masks
from lightning_dfl.sparse.rigl import dense_gradients, rigl_masks
from lightning_dfl.sparse.select import largest_k_mask

#: ``"paper"``: alpha_t = alpha/2 (1 + cos(pi t / t_end)); ``"code"``: ``dst.py`` multiplies by alpha once more
SCHEDULES = ("paper", "code")


@torch.no_grad()
def holder_average(messages: list[Message], coefficients: Any) -> tuple[dict[str, Tensor], Masks]:
    """``sum_k n_k x_k m_k / sum_k n_k m_k`` over the messages (no receiver mask) and the union of
    their masks (the positions some client holds)."""
    weights, masks = gather_messages(messages)
    average = masked_average(weights, masks, receiver_mask=None, coefficients=coefficients)
    union: Masks = {}
    for name, held in masks.items():
        union[name] = held[0].bool().clone()
        for m in held[1:]:
            union[name] |= m.bool()
    return average, union


@torch.no_grad()
def reprune(weights: dict[str, Tensor], union: Masks, budgets: dict[str, int]) -> Masks:
    """Per layer, the ``budgets[name]`` held positions of largest |w| (all held ones if fewer;
    ties to the lower flat index): the server's magnitude re-prune (``layer_prune``)."""
    out: Masks = {}
    for name, held in union.items():
        if int(held.sum()) <= budgets[name]:
            out[name] = held.clone()
            continue
        score = weights[name].detach().abs().reshape(-1).masked_fill(~held.reshape(-1), -math.inf)
        out[name] = largest_k_mask(score, budgets[name]).view_as(held)
    return out


class FedDST(TalliedTasks, FedAvg):
    """FedDST on the engine's star: FedAvg's sampling and plan with a global sparse mask.

    Args:
        clients_per_round: clients the server samples each round (papers: 10 of 100).
        readjustment_ratio: alpha of the schedule, in [0, 1] (paper 0.5).
        readjust_every: R_adj; round t (from 0) readjusts when (t - 1) mod R_adj == 0 (``dst.py``).
        decay_end: t_end, after which alpha_t = 0 (``None``: T // 2, the paper's and code's default).
        schedule: ``"paper"`` (alpha/2 (1 + cos(pi t / t_end))) or ``"code"`` (``dst.py``: times alpha again).

    The density is the module's (``model.density``; the papers' s = 0.5 is density 0.5). Logged:
    ``feddst/readjust`` (1 on readjustment rounds), ``feddst/drop_fraction`` (alpha_t),
    ``feddst/mask_changed`` (the global mask changed this round), ``flops/readjust`` (the dense
    gradient batch of the readjusting clients, added to ``flops/train_*``).
    """

    name = "feddst"
    #: FedAvg's flags, declared again for its own hooks: shardable; not reads_only_sources (it reads other models)
    shardable = True
    reads_only_sources = False
    # its messages compare a source's mask with the receiver's own (a client's current mask, or the server's
    # published one in the server's task): it reads other nodes as sources only
    partitionable = True

    def __init__(self, clients_per_round: int = 10, readjustment_ratio: float = 0.5, readjust_every: int = 10,
                 decay_end: int | None = None, schedule: str = "paper") -> None:
        super().__init__(check_int("clients_per_round", clients_per_round, 1))
        if not is_number(readjustment_ratio) or not 0.0 <= readjustment_ratio <= 1.0:
            raise ValueError(f"readjustment_ratio (alpha) must be a number in [0, 1], got {readjustment_ratio!r}")
        self.readjustment_ratio = float(readjustment_ratio)
        self.readjust_every = check_int("readjust_every (R_adj)", readjust_every, 1)
        self.decay_end = None if decay_end is None else check_int("decay_end (t_end)", decay_end, 1)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self._budgets: dict[str, int] | None = None
        self.tally = RoundTally(flops=0.0, tasks=0, mask_changes=0)
        self._fraction = 0.0

    # -- the schedule ---------------------------------------------------------------------------
    def drop_fraction(self, round_idx: int, num_rounds: int) -> float:
        """alpha_t of round ``round_idx``: 0 unless it is a readjustment round before t_end."""
        t_end = self.decay_end if self.decay_end is not None else num_rounds // 2
        if (round_idx - 1) % self.readjust_every != 0 or round_idx >= t_end:
            return 0.0
        alpha = self.readjustment_ratio
        fraction = alpha / 2 * (1 + math.cos(math.pi * round_idx / t_end))
        return fraction * alpha if self.schedule == "code" else fraction

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        self._fraction = self.drop_fraction(ctx.round_idx, ctx.num_rounds)
        return super().plan_round(ctx)

    # -- communication ----------------------------------------------------------------------------
    def message(self, ctx: TaskContext, source: Source) -> Message:
        """The model with mask bits counted only when the receiver does not hold that mask already:
        server -> client when the client's last mask differs from m, client -> server after a
        readjustment changed the client's mask (``dst.py``'s ``dl_cost``/``ul_cost``)."""
        store, server = ctx.store, ctx.num_clients
        weights, mask = store.published(source.node, source.fresh)
        if source.node == ctx.node:
            changed = False
        elif source.node == server:
            changed = _differ(mask, store.mask(ctx.node))
        else:
            changed = _differ(mask, store.published(server)[1])
        return masked_codec(changed).encode(weights, mask, sender=source.node, masked_names=store.masked_names,
                                            active_values=store.active_values(source.node, source.fresh))

    # -- a client -----------------------------------------------------------------------------------
    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        """The client starts from the server's model and mask (the worker's mask is loaded here)."""
        (message,) = messages
        ctx.module.mask.load_(message.mask, apply=False)
        return message.weights

    def loss(self, ctx: TaskContext, batch: Any) -> Tensor:
        ctx.scratch["feddst/last_batch"] = batch
        return super().loss(ctx, batch)

    def local_train(self, ctx: TaskContext) -> float:
        """Local epochs, then on readjustment rounds the client's drop-and-regrow (``Client.train``)."""
        loss = super().local_train(ctx)
        self.tally.add(tasks=1)
        batch = ctx.scratch.pop("feddst/last_batch", None)
        fraction = self.drop_fraction(ctx.round_idx, ctx.num_rounds)
        if fraction > 0 and batch is not None and math.isfinite(loss):
            mask, module = ctx.module.mask, ctx.module
            mask.apply_()
            scores = dense_gradients(module, mask, module.loss, [batch])
            weights = {n: p.detach() for n, p in mask.params.items()}
            mask.load_(rigl_masks(weights, mask.masks, fraction, scores=scores), apply=True)
            flops = 3 * module.flops_profile.dense_forward_flops() * int(batch[1].shape[0])
            ctx.report["feddst/readjust_flops"] = flops
            self.tally.add(flops=flops)
        return loss

    # -- the server ---------------------------------------------------------------------------------
    def budgets(self, module: Any) -> dict[str, int]:
        """Each masked layer's ERK budget: its active count in a mask at the module's density and distribution."""
        if self._budgets is None:
            masks = module.draw_initial_masks(torch.Generator().manual_seed(0))
            self._budgets = {n: int(m.sum()) for n, m in masks.items()}
        return self._budgets

    def server_step(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor]:
        weights, union = holder_average(messages, ctx.task.coefficients)
        new_mask = reprune(weights, union, self.budgets(ctx.module))
        for name, m in new_mask.items():
            weights[name].mul_(m.to(weights[name].dtype))
        self.tally.add(mask_changes=int(_differ(new_mask, ctx.store.mask(ctx.node))))
        ctx.store.set_mask(ctx.node, new_mask)  # published with the model (the executor reads it after this)
        return weights

    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        tally = self.tally.take()
        extra, tasks = tally["flops"], tally["tasks"]
        out = {"feddst/readjust": float(self._fraction > 0), "feddst/drop_fraction": self._fraction,
               "feddst/mask_changed": float(tally["mask_changes"] > 0), "flops/readjust": extra}
        if extra:
            out["flops/train_total"] = metrics.get("flops/train_total", 0.0) + extra
            out["flops/train_per_client"] = metrics.get("flops/train_per_client", 0.0) + extra / max(tasks, 1)
        return out


def _differ(a: Masks, b: Masks) -> bool:
    return any(not torch.equal(a[n], b[n].to(a[n].device)) for n in a)
