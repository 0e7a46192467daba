"""FedDST (Bibikar et al., AAAI 2022, "Federated Dynamic Sparse Training"; code bibikar/feddst ``dst.py``),
as baselines-notes section 3 states its original rule, with the authors' code's own behaviours as labelled options.

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

What the authors' code does where it differs (read at bibikar/feddst commit 25d6184; ``dst.py`` and the
``models.py`` it calls), each an option whose default is ours (the paper's rule as the notes state it):

* ``schedule="code"``: ``dst.py:398-399`` computes ``alpha * _decay(t)`` = alpha^2/2 (1 + cos(pi t / t_end))
  (``models.py:87-90``: 0 from t_end on), but uses it only to gate the round (``dst.py:403``: ``readjust``
  needs it > 0); the drop itself prunes to ``sparsity + (1 - sparsity) * args.readjustment_ratio``
  (``dst.py:264``), the constant alpha (``Client.train``'s ``readjustment_ratio`` argument is never read).
  So "code" drops alpha on every readjustment round before t_end. (Until 2026-12-03 our "code" dropped
  alpha^2/2 (1 + cos): the gate value, which no code drops.)
* ``regrow_among="all"``: ``layer_grow`` (``models.py:179-217``) takes the top-|gradient| entries over the
  whole layer (``models.py:209``), active ones included, sets their mask to 1 and their weight to 0
  (``models.py:213-216``): a pick on a kept active weight resets it to 0 (and the layer ends with fewer
  active weights than its budget); ours (``"inactive"``) regrows among the entries inactive after the drop.
* ``readjust_clock="epoch"``: ``dst.py:263`` readjusts after a local epoch when ``(curr_epoch - 9) % 10 == 0``
  (``--pruning-begin 9``, ``--pruning-interval 10``, ``dst.py:50-51``), ``curr_epoch`` being the client's count
  of the local epochs it has trained in its life (``dst.py:192, 273``), AND the round is a readjustment round
  (``readjust``, ``dst.py:403``). With dst.py's 10 local epochs that is every round's last epoch; with fewer,
  only some participations readjust, and after the matching epoch training goes on. Ours (``"round"``):
  the round alone, at the end of local training.
* ``reprune_ties="random"``: the server's ``layer_prune`` (``dst.py:508-512``, ``models.py:168-175``) is
  ``torch.topk`` of the smallest |w| over the whole layer, whose order among equal values (the many zeros:
  regrown weights are 0, ``models.py:213``) torch leaves unspecified, and which also ranks unheld entries, so
  its mask may end below the budget. Ours (``"index"``) keeps the held ties of lowest flat index, which puts
  them in the first rows; ``"random"`` breaks ties among the held entries uniformly at random (seeded from the
  run's seed and the round), the budget kept exactly.

Not reproduced: ``dst.py:374`` samples clients with replacement (``rng.choice`` without ``replace=False``, an
unseeded generator, ``dst.py:22``; a client drawn twice trains twice and is summed twice); here the engine runs
one task per node and round, so sampling stays FedAvg's (without replacement). The readjustment's gradient is
of the last minibatch in train mode (``dst.py:266-268``); ours in eval mode
(:func:`~lightning_dfl.sparse.rigl.dense_gradients`; the same without dropout or batch norm). The drop count
is ``ceil(alpha_t n)`` per layer; ``dst.py`` re-prunes to an ERK allocation at the lower density
(``models.py:93-136``, floors).
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
from lightning_dfl.federation.algorithms.training import train_locally
from lightning_dfl.federation.exchange.aggregation import masked_average
from lightning_dfl.federation.exchange.messages import Message, gather_messages, masked_codec
from lightning_dfl.federation.exchange.plan import RoundPlan, Source
from lightning_dfl.seeding import derive_seed
from lightning_dfl.sparse.masks import Masks
from lightning_dfl.sparse.rigl import dense_gradients, num_dropped, rigl_masks
from lightning_dfl.sparse.select import largest_k_mask, smallest_k_mask_among
from lightning_dfl.state_field import StateField

#: ``"paper"``: alpha_t = alpha/2 (1 + cos(pi t / t_end)); ``"code"``: ``dst.py``: alpha itself, the annealed
#: value only gating the round (module docstring)
SCHEDULES = ("paper", "code")
#: where a readjustment regrows: ``"inactive"`` (RigL: among the entries inactive after the drop) or ``"all"``
#: (``dst.py``'s ``layer_grow``: top |gradient| over the layer, the picks' weights set to 0)
REGROW_AMONG = ("inactive", "all")
#: when a client readjusts: ``"round"`` (at the end of a readjustment round's training) or ``"epoch"``
#: (``dst.py``: also after its lifetime local epoch e with (e - 9) % 10 == 0)
READJUST_CLOCKS = ("round", "epoch")
#: the server re-prune's order among equal |w|: ``"index"`` (lower flat index kept) or ``"random"`` (seeded)
REPRUNE_TIES = ("index", "random")
#: ``dst.py``'s ``--pruning-begin`` and ``--pruning-interval`` defaults (``dst.py:50-51``)
PRUNING_BEGIN, PRUNING_INTERVAL = 9, 10
#: a client's count of the local epochs it has trained (``readjust_clock="epoch"``; ``dst.py``'s ``curr_epoch``)
EPOCHS = "feddst/epochs"


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")
    return value


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
def reprune(weights: dict[str, Tensor], union: Masks, budgets: dict[str, int],
            generator: torch.Generator | None = None) -> Masks:
    """Per layer, the ``budgets[name]`` held positions of largest |w| (all held ones if fewer): the server's
    magnitude re-prune (``layer_prune``). Ties go to the lower flat index, or, given a ``generator`` (on the
    CPU), to a uniformly random order among the tied (one permutation of the layer per layer, in order)."""
    out: Masks = {}
    for name, held in union.items():
        if int(held.sum()) <= budgets[name]:
            out[name] = held.clone()
            continue
        score = weights[name].detach().abs().reshape(-1).masked_fill(~held.reshape(-1), -math.inf)
        if generator is None:
            out[name] = largest_k_mask(score, budgets[name]).view_as(held)
            continue
        order = torch.randperm(score.numel(), generator=generator).to(score.device)
        kept = torch.zeros_like(held.reshape(-1))
        kept[order] = largest_k_mask(score[order], budgets[name])  # ties by position in the random order
        out[name] = kept.view_as(held)
    return out


@torch.no_grad()
def regrow_over_all(weights: dict[str, Tensor], masks: Masks, drop_fraction: float,
                    scores: dict[str, Tensor]) -> tuple[Masks, Masks]:
    """``dst.py``'s readjustment with its ``layer_grow`` (``models.py:179-217``): per layer of ``n`` active
    weights, drop the ``k = ceil(drop_fraction n)`` of smallest |w| (ties by flat index), then pick the ``k``
    entries of largest |score| over the WHOLE layer (active ones included; ties by flat index) and make them
    active. Returns the new masks and the picks, whose weights the caller sets to 0 (``models.py:213``): a pick
    on a kept active weight stays active at 0, so the layer may end with fewer than ``n`` active weights. A
    layer that drops nothing, or a dense one, is unchanged (no picks)."""
    new, picks = {}, {}
    for name, mask in masks.items():
        flat = mask.detach().reshape(-1).bool()
        active = int(flat.sum())
        k = num_dropped(float(drop_fraction), active)
        if k == 0 or active == flat.numel():
            new[name], picks[name] = flat.clone().view_as(mask), torch.zeros_like(flat).view_as(mask)
            continue
        magnitude = torch.nan_to_num(weights[name].detach().reshape(-1).to(flat.device).abs(), nan=0.0)
        kept = flat & ~smallest_k_mask_among(magnitude, flat, k)
        ranked = torch.nan_to_num(scores[name].detach().reshape(-1).to(flat.device).abs(), nan=0.0)
        grown = largest_k_mask(ranked, k)
        new[name], picks[name] = (kept | grown).view_as(mask), grown.view_as(mask)
    return new, picks


class FedDST(TalliedTasks, FedAvg):
    """FedDST on the engine's star: FedAvg's sampling and plan with a global sparse mask.

    Args:
        clients_per_round: clients the server samples each round (papers: 10 of 100).
        readjustment_ratio: alpha of the schedule, in [0, 1] (paper 0.5).
        readjust_every: R_adj; round t (from 0) readjusts when (t - 1) mod R_adj == 0 (``dst.py``).
        decay_end: t_end, after which alpha_t = 0 (``None``: T // 2, the paper's and code's default).
        schedule: ``"paper"`` (drop alpha_t = alpha/2 (1 + cos(pi t / t_end))) or ``"code"`` (``dst.py``: drop
            alpha on every readjustment round before t_end; module docstring).
        regrow_among: ``"inactive"`` (regrow among the entries inactive after the drop) or ``"all"``
            (``dst.py``: top |gradient| over the layer, picks set to 0: :func:`regrow_over_all`).
        readjust_clock: ``"round"`` (readjust at the end of a readjustment round's local training) or
            ``"epoch"`` (``dst.py``: after the client's lifetime local epoch e, counted in the store field
            ``feddst/epochs``, with (e - 9) % 10 == 0, in a readjustment round).
        reprune_ties: ``"index"`` (the server's re-prune keeps equal |w| by lower flat index) or ``"random"``
            (uniformly among the tied, seeded by the run's seed and the round: :func:`reprune`).

    The density is the module's (``model.density``; the papers' s = 0.5 is density 0.5). Logged:
    ``feddst/readjust`` (1 on readjustment rounds), ``feddst/drop_fraction`` (alpha_t),
    ``feddst/readjusted_clients`` (clients that readjusted this round), ``feddst/mask_changed`` (the global
    mask changed this round), ``flops/readjust`` (the dense gradient batch of the readjusting clients, added
    to ``flops/train_*``).
    """

    name = "feddst"
    #: FedAvg's flags, declared again for its own hooks: shardable; not reads_only_sources (it reads other models)
    shardable = True
    reads_only_sources = False
    # its messages compare a source's mask with the receiver's own (a client's current mask, or the server's
    # published one in the server's task): it reads other nodes as sources only
    partitionable = True

    def __init__(self, clients_per_round: int = 10, readjustment_ratio: float = 0.5, readjust_every: int = 10,
                 decay_end: int | None = None, schedule: str = "paper", regrow_among: str = "inactive",
                 readjust_clock: str = "round", reprune_ties: str = "index") -> None:
        super().__init__(check_int("clients_per_round", clients_per_round, 1))
        if not is_number(readjustment_ratio) or not 0.0 <= readjustment_ratio <= 1.0:
            raise ValueError(f"readjustment_ratio (alpha) must be a number in [0, 1], got {readjustment_ratio!r}")
        self.readjustment_ratio = float(readjustment_ratio)
        self.readjust_every = check_int("readjust_every (R_adj)", readjust_every, 1)
        self.decay_end = None if decay_end is None else check_int("decay_end (t_end)", decay_end, 1)
        self.schedule = _choice("schedule", schedule, SCHEDULES)
        self.regrow_among = _choice("regrow_among", regrow_among, REGROW_AMONG)
        self.readjust_clock = _choice("readjust_clock", readjust_clock, READJUST_CLOCKS)
        self.reprune_ties = _choice("reprune_ties", reprune_ties, REPRUNE_TIES)
        self._budgets: dict[str, int] | None = None
        self.tally = RoundTally(flops=0.0, tasks=0, mask_changes=0, readjusted=0)
        self._fraction = 0.0

    def state_fields(self) -> list[StateField]:
        own = [StateField(EPOCHS, dtype=torch.int64, fill=0)] if self.readjust_clock == "epoch" else []
        return [*super().state_fields(), *own]

    # -- the schedule ---------------------------------------------------------------------------
    def drop_fraction(self, round_idx: int, num_rounds: int) -> float:
        """alpha_t of round ``round_idx``: 0 unless it is a readjustment round before t_end (with alpha > 0);
        there the paper's alpha/2 (1 + cos(pi t / t_end)), or with ``schedule="code"`` alpha (``dst.py:264``)."""
        t_end = self.decay_end if self.decay_end is not None else num_rounds // 2
        alpha = self.readjustment_ratio
        if (round_idx - 1) % self.readjust_every != 0 or round_idx >= t_end or alpha == 0:
            return 0.0
        return alpha if self.schedule == "code" else alpha / 2 * (1 + math.cos(math.pi * round_idx / t_end))

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
        """Local epochs, then on readjustment rounds the client's drop-and-regrow (``Client.train``); with
        ``readjust_clock="epoch"`` one epoch at a time, readjusting after each lifetime epoch e with
        (e - 9) % 10 == 0 in a readjustment round (``dst.py:242-273``)."""
        fraction = self.drop_fraction(ctx.round_idx, ctx.num_rounds)
        self.tally.add(tasks=1)
        if self.readjust_clock == "round":
            loss = super().local_train(ctx)
            self._readjust(ctx, fraction, loss)
            return loss
        if ctx.local_steps is not None:
            raise ValueError("feddst's readjust_clock 'epoch' counts local epochs; this run trains a number of "
                             f"local steps ({ctx.local_steps}): use local_epochs, or readjust_clock 'round'")
        epoch = int(ctx.read(EPOCHS))
        losses = []
        for _ in range(ctx.local_epochs):
            losses.append(train_locally(self, ctx, epochs=1))
            if (epoch - PRUNING_BEGIN) % PRUNING_INTERVAL == 0:
                self._readjust(ctx, fraction, losses[-1])
            epoch += 1
        ctx.write(EPOCHS, epoch)
        return sum(losses) / len(losses) if losses else float("nan")

    def _readjust(self, ctx: TaskContext, fraction: float, loss: Any) -> None:
        """Drop-and-regrow on the last minibatch's dense gradient (``dst.py:263-271``) if ``fraction`` > 0."""
        batch = ctx.scratch.pop("feddst/last_batch", None)
        if not (fraction > 0 and batch is not None and math.isfinite(loss)):
            return
        mask, module = ctx.module.mask, ctx.module
        mask.apply_()
        scores = dense_gradients(module, mask, module.loss, [batch])
        weights = {n: p.detach() for n, p in mask.params.items()}
        if self.regrow_among == "all":
            new, picks = regrow_over_all(weights, mask.masks, fraction, scores)
            mask.load_(new, apply=True)
            with torch.no_grad():
                for name, param in mask.params.items():
                    param.masked_fill_(picks[name].to(param.device), 0.0)
        else:
            mask.load_(rigl_masks(weights, mask.masks, fraction, scores=scores), apply=True)
        flops = 3 * module.flops_profile.dense_forward_flops() * int(batch[1].shape[0])
        ctx.report["feddst/readjust_flops"] = ctx.report.get("feddst/readjust_flops", 0) + flops
        self.tally.add(flops=flops, readjusted=1)

    # -- the server ---------------------------------------------------------------------------------
    def budgets(self, module: Any) -> dict[str, int]:
        """Each masked layer's ERK budget: its active count in a mask at the module's density and distribution."""
        if self._budgets is None:
            masks = module.draw_initial_masks(torch.Generator().manual_seed(0))
            self._budgets = {n: int(m.sum()) for n, m in masks.items()}
        return self._budgets

    def server_step(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor]:
        weights, union = holder_average(messages, ctx.task.coefficients)
        generator = None
        if self.reprune_ties == "random":
            generator = torch.Generator().manual_seed(derive_seed(ctx.seed, "feddst/reprune", ctx.round_idx))
        new_mask = reprune(weights, union, self.budgets(ctx.module), generator)
        for name, m in new_mask.items():
            weights[name].mul_(m.to(weights[name].dtype))
        self.tally.add(mask_changes=int(_differ(new_mask, ctx.store.mask(ctx.node))))
        ctx.store.set_mask(ctx.node, new_mask)  # published with the model (the executor reads it after this)
        return weights

    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        tally = self.tally.take()
        extra, tasks = tally["flops"], tally["tasks"]
        out = {"feddst/readjust": float(self._fraction > 0), "feddst/drop_fraction": self._fraction,
               "feddst/readjusted_clients": float(tally["readjusted"]),
               "feddst/mask_changed": float(tally["mask_changes"] > 0), "flops/readjust": extra}
        if extra:
            out["flops/train_total"] = metrics.get("flops/train_total", 0.0) + extra
            out["flops/train_per_client"] = metrics.get("flops/train_per_client", 0.0) + extra / max(tasks, 1)
        return out


def _differ(a: Masks, b: Masks) -> bool:
    return any(not torch.equal(a[n], b[n].to(a[n].device)) for n in a)
