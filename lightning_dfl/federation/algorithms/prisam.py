"""PRISAM (structured pruning, similar-device discovery by mask clustering, group aggregation).

Paper: Chang et al., PRISAM (Sec. III-V, Alg. 1-2, Fig. 4), read with ``docs/prisam.md``
(its errata and our protocol decisions, cited as "notes N": item N of that page).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.checks import check_bool, check_int, is_number
from lightning_dfl.federation.algorithms.base import Algorithm, TopologyAlgorithm, parallel_plan
from lightning_dfl.federation.algorithms.context import RoundContext, TaskContext
from lightning_dfl.federation.exchange.messages import Message
from lightning_dfl.federation.exchange.plan import RoundPlan, Source, Task
from lightning_dfl.federation.store import StateField
from lightning_dfl.grouping import GROUPING_METHODS, Grouping, compact, group_masks, nearest_labels
from lightning_dfl.seeding import derive_seed
from lightning_dfl.sparse.channels import (
    ChannelMasks,
    apply_channel_masks_,
    channel_groups,
    expand,
    mask_state_,
    masked_macs,
    state_channel_scores,
)

__all__ = ["CHANNELS_FIELD", "GROUPINGS", "GROUPING_MASKS", "GROUPING_VIEWS", "PARTICIPANT_DRAWS", "PRISAM", "WARMUP_FIELD",
           "ChannelMessage"]

#: the store field holding each client's published channel mask (one bit per BN channel)
CHANNELS_FIELD = "prisam/channels"
#: the store field counting the warm-up rounds a device has done (its first prune ends the last)
WARMUP_FIELD = "prisam/warmup_done"
#: how the first participants are drawn: uniformly, or the same share from each group (notes 17)
PARTICIPANT_DRAWS = ("uniform", "per_group")
#: how devices find their aggregation partners: clustering, or ``num_neighbors`` random peers (notes 13)
GROUPINGS = (*GROUPING_METHODS, "random")
#: when groups are formed: every round (Alg. 1, L204) or once, at the first grouping round (frozen)
REGROUPS = ("every_round", "frozen")
#: whose masks Alg. 2 clusters: every device that has shared one ("all": line 7 sums over the N
#: devices; an absent device with the mask it shared last) or the round's participants only
GROUPING_VIEWS = ("all", "participants")
#: which mask of a device Alg. 2 clusters: the one it shared last (Alg. 1 line 5, M_i^(t)) or the one its
#: warm-up's prune gave it (Sec. V-A: devices "clustered based on the BN masks generated during the local
#: training"), which no aggregation changes (docs/prisam.md item 22)
GROUPING_MASKS = ("current", "warmup")


@dataclass
class ChannelMessage(Message):
    """A pruned model with its channel mask (what a PRISAM device downloads, L128)."""

    channels: Tensor | None = None


def _check_ratio(name: str, value: object) -> float:
    if not (is_number(value) and 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be a pruning ratio in [0, 1), got {value!r}")
    return float(value)


class PRISAM(TopologyAlgorithm):
    """PRISAM: each device prunes whole BN channels at its ratio rho_i, devices with similar masks
    are grouped by clustering the masks, and each group averages its structurally different models.

    A round (Alg. 1 with notes 2's default order): the participants' published channel masks are
    compacted and clustered (Alg. 2, :mod:`lightning_dfl.grouping`) -> every member downloads its
    group's models and masks -> union average, each weight over the members that keep it (Fig. 4,
    L210-219, notes 7) -> re-prune at rho_i by the averaged ``|gamma|`` (L212) -> local epochs under
    that mask -> publish. ``prune_after_train`` is Alg. 1 literally: train under the union mask,
    then prune by the trained ``|gamma|``. A device's first ``warmup_rounds`` rounds of taking part are
    local and dense; the last of them ends with its first prune (L122, notes 3). A device still in its
    warm-up (one that first joins late) is neither grouped nor averaged that round.

    Pruning keeps ``C - floor(rho_i C)`` channels per BN layer (notes 6); in ResNet-20 a stage's
    residual channels share one mask (notes 8). The channel mask is expanded to the conv filters,
    biases, BN parameters and statistics and the next layers' input slices
    (:func:`~lightning_dfl.sparse.channels.expand`), so the masked model computes what the exported,
    physically smaller one computes.

    Args:
        ratio: rho, the share of each BN layer's channels pruned; a list gives mixed ratios, device
            ``k`` taking ``ratio[k % len(ratio)]`` (Sec. V-G).
        num_groups: k of KMeans (the number of similar-device groups).
        grouping: ``"kmeans"`` (default), ``"dbscan"``, or ``"random"``: no grouping, each device
            averages ``num_neighbors`` random peers (Sec. V-E's "10 random peers", notes 13).
        warmup_rounds: local, dense rounds before the first prune (L122, notes 3), counted per device:
            every device runs its own ``warmup_rounds`` local rounds the first times it takes part (in
            rounds 0.. when all take part; later for a device that first joins after them, through
            churn or ``participants_per_round``) and ends the last with its first prune; until then it
            is neither grouped nor averaged, so no unpruned (all-ones) mask enters Alg. 2 or Fig. 4.
        regroup: ``"every_round"`` (Alg. 1) or ``"frozen"`` (the first grouping is kept; a device
            seen later joins the group of the nearest mask).
        prune_after_train: Alg. 1's literal order (notes 2).
        grouping_ratio: for grouping only, each device shares the mask of its channels kept at this
            ratio (e.g. 0.5: its top half by ``|gamma|``); ``None``: its own mask (notes 5). It must be
            >= max(rho) (below a device's rho it would share pruned channels, whose gamma is 0, filled
            by index); ``"auto"``: max(rho). With it, ``prisam/ari_own_masks`` logs the ARI of the
            devices' own masks beside ``prisam/ari`` (notes 5: the ARI both ways).
        l1: lambda of an L1 penalty on the BN scaling factors (network slimming; off by default, notes 6).
        dbscan_eps, dbscan_min_samples: DBSCAN's settings (Hamming distance on compact masks; the
            paper gives none, notes 4). ``dbscan_eps="auto"`` (default) derives eps every grouping
            round from the masks (:func:`~lightning_dfl.grouping.auto_eps`: the widest gap of
            DBSCAN's density tree, capped by the k-distance rule; docs/prisam.md item 21) and logs it
            as ``prisam/dbscan_eps``; ``"kdist"`` is the k-distance rule alone (one outlier sets it for
            all). On ``configs/prisam_digits.yaml`` the within-group Hamming share of the first masks
            is 0.26-0.46 and between groups 0.44-0.57, so a fixed 0.1 left every device alone (no
            aggregation) while "auto" (0.39-0.43) finds the 5 groups.
        grouping_view: whose masks Alg. 2 compacts and clusters each round (docs/prisam.md item 20).
            ``"all"`` (default): the round's grouped participants and every absent device that has
            shared a mask in an earlier round, with the mask it shared last (the collector's memory,
            checkpointed); only the participants are grouped (they alone aggregate and count in
            ``prisam/ari``). Alg. 2's line 7 sums over the N devices, and the paper's rounds hold 100
            of 200 devices, about 20 per group; with 10 of 20 (about 2 per group) a round's masks alone
            made KMeans (k fixed) split a group or merge two whenever a joining device's mask was
            unlike its group's, and a merge lasts (notes 2). ``"participants"``: the round's grouped
            participants only (the earlier reading of notes 1). Without churn both are the same
            devices. Logged: ``prisam/view`` (masks clustered), ``prisam/grouped`` (participants).
        grouping_masks: which mask of each device Alg. 2 clusters (docs/prisam.md item 22).
            ``"warmup"`` (default): the mask it shared when first grouped, i.e. its warm-up prune's mask
            (Sec. V-A: devices are "clustered based on the BN masks generated during the local
            training"), kept by the collector and checkpointed; no aggregation changes it, so a wrong
            grouping is undone once the devices seen allow it, and a joining device is compared with
            masks of its kind. The clustering is seeded with the round in which the set of devices
            last grew (with ``grouping_view="all"``), so the same masks give the same groups.
            ``"current"``: Alg. 1's M_i^(t), the masks shared this round (absent devices: last shared).
            After a device's first aggregation that is its group's mask (notes 2), so a merge made
            under churn lasted. Without churn both give the same groups every round.
        num_neighbors, topology: the random peers of ``grouping="random"``.
        participants_per_round: devices taking part in round 0 (``None``: all); a seeded sample.
        participants_draw: how those are drawn: ``"uniform"`` over all devices, or ``"per_group"``:
            the same number from each of the data's groups (``partition: cluster``; notes 17: 100 of
            200 devices in 5 groups, 20 per group; a remainder goes to randomly chosen groups).
        churn: m of notes 18: after each round each participant leaves, and each other device joins,
            with probability m (a returning device resumes from its own state).
    """

    name = "prisam"
    #: rho, the groups and who takes part set the experiment (the paper varies them)
    settings = ("ratio", "num_groups", "participants_per_round", "churn", "participants_draw")
    shardable = True
    reads_only_sources = True
    partitionable = True  # its planning reads the clients' shared masks through the store's gather_nodes

    def __init__(self, ratio: float | list[float] = 0.5, num_groups: int = 5, grouping: str = "kmeans",
                 warmup_rounds: int = 3, regroup: str = "every_round", prune_after_train: bool = False,
                 grouping_ratio: float | str | None = None, l1: float = 0.0, dbscan_eps: float | str = "auto",
                 dbscan_min_samples: int = 2, num_neighbors: int = 10, topology: str = "time_varying",
                 participants_per_round: int | None = None, churn: float = 0.0,
                 participants_draw: str = "uniform", grouping_view: str = "all",
                 grouping_masks: str = "warmup") -> None:
        super().__init__(num_neighbors, topology)
        ratios = list(ratio) if isinstance(ratio, (list, tuple)) else [ratio]
        if not ratios:
            raise ValueError("ratio must be a number in [0, 1) or a non-empty list of them, got []")
        self._ratios = [_check_ratio("ratio", r) for r in ratios]
        self.ratio = ratio if not isinstance(ratio, tuple) else list(ratio)
        self.num_groups = check_int("num_groups", num_groups, 1)
        if grouping not in GROUPINGS:
            raise ValueError(f"unknown grouping {grouping!r}; allowed: {', '.join(GROUPINGS)}")
        self.grouping = grouping
        self.warmup_rounds = check_int("warmup_rounds", warmup_rounds, 0)
        if regroup not in REGROUPS:
            raise ValueError(f"unknown regroup {regroup!r}; allowed: {', '.join(REGROUPS)}")
        self.regroup = regroup
        self.prune_after_train = check_bool("prune_after_train", prune_after_train)
        if grouping_ratio == "auto":
            self.grouping_ratio: float | str | None = "auto"
        else:
            self.grouping_ratio = None if grouping_ratio is None else _check_ratio("grouping_ratio", grouping_ratio)
            if self.grouping_ratio is not None and self.grouping_ratio < max(self._ratios):
                raise ValueError(f"grouping_ratio={self.grouping_ratio} is below max(rho)={max(self._ratios)}: a device "
                                 f"pruned at rho={max(self._ratios)} would share channels it pruned (gamma 0, filled "
                                 f"by index); use grouping_ratio >= {max(self._ratios)} or 'auto' (notes 5)")
        self._grouping_ratio = max(self._ratios) if grouping_ratio == "auto" else self.grouping_ratio
        if not (is_number(l1) and l1 >= 0):
            raise ValueError(f"l1 must be a number >= 0, got {l1!r}")
        self.l1 = float(l1)
        if dbscan_eps not in ("auto", "kdist") and not (is_number(dbscan_eps) and 0 < dbscan_eps <= 1):
            raise ValueError(f"dbscan_eps must be in (0, 1] (a Hamming distance), 'auto' or 'kdist', got {dbscan_eps!r}")
        self.dbscan_eps = dbscan_eps if dbscan_eps in ("auto", "kdist") else float(dbscan_eps)
        self.dbscan_min_samples = check_int("dbscan_min_samples", dbscan_min_samples, 1)
        self.participants_per_round = (None if participants_per_round is None
                                       else check_int("participants_per_round", participants_per_round, 1))
        if not (is_number(churn) and 0 <= churn < 1):
            raise ValueError(f"churn must be a probability in [0, 1), got {churn!r}")
        self.churn = float(churn)
        if participants_draw not in PARTICIPANT_DRAWS:
            raise ValueError(f"unknown participants_draw {participants_draw!r}; allowed: {', '.join(PARTICIPANT_DRAWS)}")
        self.participants_draw = participants_draw
        if grouping_view not in GROUPING_VIEWS:
            raise ValueError(f"unknown grouping_view {grouping_view!r}; allowed: {', '.join(GROUPING_VIEWS)}")
        self.grouping_view = grouping_view
        if grouping_masks not in GROUPING_MASKS:
            raise ValueError(f"unknown grouping_masks {grouping_masks!r}; allowed: {', '.join(GROUPING_MASKS)}")
        self.grouping_masks = grouping_masks
        self._groups: tuple = ()
        self._bits = 0
        self._true_groups: np.ndarray | None = None
        self._history: list[tuple[int, ...]] = []  # participants of rounds 0, 1, ... (pure in the seed)
        self._frozen: dict[str, Tensor] | None = None
        # the masks the grouped devices shared (Alg. 1 line 5), for grouping_view="all": the collector's
        # memory as of the rounds before the current one, and this round's, committed when the next is planned
        self._shared: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._shared_pending: tuple[int, dict[int, tuple[Tensor, Tensor | None]]] | None = None
        # grouping_masks="warmup": the mask each device shared in its first grouping round (its warm-up
        # mask), and the round in which the set of those devices last grew (it seeds the clustering)
        self._warmup: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._warmup_round = -1
        self._kept_cache: dict[bytes, tuple[int, int, int]] = {}
        self._info: dict[str, float] = {}
        self._published: dict[int, tuple[int, int]] = {}

    # -- set-up -----------------------------------------------------------------------------
    def validate(self, num_clients: int) -> None:
        if self.grouping == "random":
            super().validate(num_clients)  # M random peers need M < K
        else:
            Algorithm.validate(self, num_clients)
        if self.num_groups > num_clients:
            raise ValueError(f"num_groups={self.num_groups} exceeds the {num_clients} clients: every group needs a "
                             f"client; allowed: at most {num_clients}")
        if self.participants_per_round is not None and self.participants_per_round > num_clients:
            raise ValueError(f"participants_per_round={self.participants_per_round} exceeds the "
                             f"{num_clients} clients")

    def setup(self, module: Any, datamodule: Any) -> None:
        try:
            self._groups = channel_groups(module.model)
        except ValueError as err:
            raise ValueError(f"PRISAM prunes BN channels: {err}") from None
        if module.hparams.density != 1.0:
            raise ValueError(f"PRISAM starts dense and prunes whole channels; set model.density to 1.0, "
                             f"got {module.hparams.density}")
        layers = {n for g in self._groups for n in g.producers + g.consumers}  # the convs and the Linear
        missing = sorted(f"{n}.weight" for n in layers if f"{n}.weight" not in module.mask.masks)
        if missing:
            raise ValueError(f"PRISAM masks every conv and linear weight, but the model leaves {missing} unmasked; "
                             f"remove model.mask_exclude and set model.mask_shortcuts: true")
        self._bits = sum(g.size for g in self._groups)
        groups = getattr(datamodule, "client_groups", None)
        self._true_groups = None if groups is None else np.asarray(groups, dtype=np.int64)
        if self.participants_draw == "per_group" and self.participants_per_round is not None:
            if self._true_groups is None:
                raise ValueError("participants_draw='per_group' draws from each of the data's groups: use a "
                                 "partition with client groups (data.partition: cluster)")
            sizes = np.bincount(self._true_groups)
            share = -(-self.participants_per_round // len(sizes))  # the most any group must give
            if sizes.min() < share:
                raise ValueError(f"participants_draw='per_group': {self.participants_per_round} participants need up "
                                 f"to {share} from each of {len(sizes)} groups, but a group has only {sizes.min()}")

    def state_fields(self) -> list[StateField]:
        return [StateField(CHANNELS_FIELD, shape=(self._bits,), dtype=torch.bool, fill=1.0, published=True),
                StateField(WARMUP_FIELD, dtype=torch.int64, fill=0, published=True)]

    def rho(self, client: int) -> float:
        """Device ``client``'s pruning ratio."""
        return self._ratios[client % len(self._ratios)]

    # -- participation (notes 18) -----------------------------------------------------------
    def participants(self, ctx: RoundContext) -> Sequence[int] | None:
        if self.participants_per_round is None and self.churn == 0.0:
            return None
        while len(self._history) <= ctx.round_idx:
            r = len(self._history)
            if r == 0:
                count = self.participants_per_round or ctx.num_clients
                rng = np.random.default_rng(derive_seed(ctx.seed, "prisam/participants"))
                if self.participants_draw == "per_group" and self._true_groups is not None:
                    chosen = self._draw_per_group(count, rng)
                else:
                    chosen = set(rng.choice(ctx.num_clients, size=count, replace=False).tolist())
            else:
                draws = np.random.default_rng(derive_seed(ctx.seed, "prisam/churn", r)).random(ctx.num_clients)
                before = set(self._history[-1])
                chosen = {k for k in range(ctx.num_clients) if (k in before) != (draws[k] < self.churn)}
                chosen = chosen or before  # a round with nobody keeps the previous participants
            self._history.append(tuple(sorted(chosen)))
        return self._history[ctx.round_idx]

    def _draw_per_group(self, count: int, rng: np.random.Generator) -> set[int]:
        """``count`` devices, the same number from each group (notes 17); a remainder r goes to r
        groups drawn at random (one more each)."""
        groups = np.unique(self._true_groups)
        share, extra = divmod(count, len(groups))
        more = set(rng.choice(groups, size=extra, replace=False).tolist()) if extra else set()
        chosen: set[int] = set()
        for g in groups:
            members = np.flatnonzero(self._true_groups == g)
            chosen |= set(rng.choice(members, size=share + (g in more), replace=False).tolist())
        return chosen

    # -- planning ---------------------------------------------------------------------------
    def warming(self, ctx: RoundContext, active: list[int]) -> list[int]:
        """The participants still in their warm-up (fewer than ``warmup_rounds`` warm-up rounds done)."""
        if not self.warmup_rounds:
            return []
        store = ctx.store
        done = store.gather_nodes(lambda k: int(store.read(k, WARMUP_FIELD)), active)  # each from its owner
        return [k for k, d in zip(active, done) if d < self.warmup_rounds]

    def plan_round(self, ctx: RoundContext) -> RoundPlan:
        self._info, self._published = {}, {}
        active = ctx.active_clients
        if ctx.round_idx < self.warmup_rounds and ctx.store is None:  # planning without a store (tests)
            return RoundPlan(ctx.round_idx, [Task(node=k) for k in active])
        warming = self.warming(ctx, active)
        if len(warming) == len(active):  # everyone warms up: local, dense rounds (L122, notes 3)
            return RoundPlan(ctx.round_idx, [Task(node=k) for k in active])
        local = [Task(node=k) for k in warming]  # a device's own warm-up rounds; it is neither grouped nor averaged
        self._info["prisam/warming"] = float(len(warming))
        if self.grouping == "random":
            plan = parallel_plan(ctx, self.neighbors(ctx))
            if not warming:
                return plan
            out = set(warming)
            tasks = [Task(node=t.node, sources=tuple(s for s in t.sources if s.node not in out))
                     for t in plan.tasks if t.node not in out]
            return RoundPlan(ctx.round_idx, sorted(tasks + local, key=lambda t: t.node))
        ready = set(warming)
        active = [k for k in active if k not in ready]  # the grouped devices: every one has pruned
        shared = dict(zip(active, ctx.store.gather_nodes(lambda k: self._shared_masks(ctx, k), active)))
        if self.grouping_masks == "warmup":  # a device first grouped now shares its warm-up mask (item 22)
            new = {k: shared[k] for k in active if k not in self._warmup}
            if new:
                self._warmup.update(new)
                self._warmup_round = ctx.round_idx
            remembered = self._warmup
        view = self.view(ctx, active)
        if self.grouping_masks == "current":
            remembered = {**self._shared, **shared}
        vectors = torch.stack([remembered[k][0] for k in view]).numpy()
        rows = np.searchsorted(view, active)  # the participants' rows in the view (both sorted)
        clustered = self._group(ctx, view, vectors)
        grouping = clustered.restrict(rows)
        if self.grouping_view == "all" and self.grouping_masks == "current":
            self._shared_pending = (ctx.round_idx, shared)  # a plan made again for this round replaces it
        tasks = list(local)
        for members in grouping.members():
            nodes = [active[i] for i in members]
            for k in nodes:
                tasks.append(Task(node=k, sources=(Source(k), *(Source(j) for j in nodes if j != k))))
        side = self._grouping_traffic(active)
        self._info.update({"prisam/groups": float(grouping.num_groups), "prisam/view": float(len(view)),
                           "prisam/grouped": float(len(active)),
                           "prisam/differing_dims": float(grouping.differing_dims),
                           "prisam/distinct_masks": float(grouping.distinct_masks),
                           "prisam/grouping_fallback": float(grouping.fallback),
                           "prisam/grouping_bytes": float(sum(b for _, _, b in side))})
        if grouping.eps is not None:
            self._info["prisam/dbscan_eps"] = grouping.eps
        if self._true_groups is not None:
            from sklearn.metrics import adjusted_rand_score

            truth = self._true_groups[np.asarray(active)]
            self._info["prisam/ari"] = float(adjusted_rand_score(truth, grouping.labels))
            if self._grouping_ratio is not None:  # notes 5: the ARI both ways
                own = torch.stack([remembered[k][1] for k in view]).numpy()
                seed = derive_seed(ctx.seed, "prisam/grouping", self._seed_round(ctx)) % (2 ** 32)
                labels = group_masks(own, self.num_groups, self.grouping, seed, eps=self.dbscan_eps,
                                     min_samples=self.dbscan_min_samples).restrict(rows).labels
                self._info["prisam/ari_own_masks"] = float(adjusted_rand_score(truth, labels))
        tasks.sort(key=lambda t: t.node)
        return RoundPlan(ctx.round_idx, tasks, side_transfers=side)

    def view(self, ctx: RoundContext, grouped: list[int]) -> list[int]:
        """The devices whose masks Alg. 2 clusters this round, in id order: the ``grouped`` participants
        and, with ``grouping_view="all"``, every absent device that has shared a mask in an earlier
        round (it is clustered with the mask it shared last, which the collector kept). PRISAM Alg. 2
        compacts and clusters the masks of all N devices (line 7 sums over k = 1..N; L204: one elected
        device collects all masks and clusters them in each iteration); a device that is absent this
        round is still one of the N. Only the participants are grouped: absent devices neither
        aggregate nor count in the ARI (notes 18)."""
        if self.grouping_view == "participants":
            return list(grouped)
        taking_part = set(ctx.active_clients)
        if self.grouping_masks == "warmup":
            return sorted([*grouped, *(k for k in self._warmup if k not in taking_part)])
        pending = self._shared_pending
        if pending is not None and pending[0] < ctx.round_idx:  # the last round's masks join the memory
            self._shared.update(pending[1])
            self._shared_pending = None
        return sorted([*grouped, *(k for k in self._shared if k not in taking_part)])

    def _shared_masks(self, ctx: RoundContext, client: int) -> tuple[Tensor, Tensor | None]:
        """What ``client`` shares for grouping: :meth:`_grouping_vector`, and (``grouping_ratio``) its own
        published channel mask too (computed by its owner where each process holds its own clients)."""
        own = None if self._grouping_ratio is None else ctx.store.read(client, CHANNELS_FIELD).cpu().clone()
        return self._grouping_vector(ctx, client), own

    def _grouping_vector(self, ctx: RoundContext, client: int) -> Tensor:
        """The mask ``client`` shares for grouping: its published channel mask, or (``grouping_ratio``)
        the channels its published model keeps at that ratio (notes 5)."""
        if self._grouping_ratio is None:
            return ctx.store.read(client, CHANNELS_FIELD).cpu().clone()
        weights, _ = ctx.store.published(client)
        scores = state_channel_scores(weights, self._groups)
        return ChannelMasks.from_scores(self._groups, scores, self._grouping_ratio).to_vector()

    def _group(self, ctx: RoundContext, nodes: list[int], vectors: np.ndarray) -> Grouping:
        """Alg. 2 over the masks ``vectors`` of ``nodes`` (the round's :meth:`view`): compaction and
        clustering, seeded per round; with ``regroup="frozen"`` the first grouping's labels, a device
        not in it joining the group of the nearest mask."""
        seed = derive_seed(ctx.seed, "prisam/grouping", self._seed_round(ctx)) % (2 ** 32)
        if self.regroup == "frozen" and self._frozen is not None:
            known = {int(n): int(lab) for n, lab in zip(self._frozen["nodes"], self._frozen["labels"])}
            new = [i for i, k in enumerate(nodes) if k not in known]
            labels = np.array([known.get(k, -1) for k in nodes], dtype=np.int64)
            if new:
                labels[new] = nearest_labels(self._frozen["vectors"].numpy(), self._frozen["labels"].numpy(),
                                             vectors[new])
            dims, _ = compact(vectors)
            _, relabel = np.unique(labels, return_inverse=True)
            return Grouping(np.asarray(relabel).reshape(-1), dims.shape[1], len(np.unique(dims, axis=0)), False)
        grouping = group_masks(vectors, self.num_groups, self.grouping if self.grouping != "random" else "kmeans",
                               seed, eps=self.dbscan_eps, min_samples=self.dbscan_min_samples)
        if self.regroup == "frozen":
            self._frozen = {"nodes": torch.tensor(nodes), "labels": torch.from_numpy(grouping.labels.copy()),
                            "vectors": torch.from_numpy(vectors.copy())}
        return grouping

    def _seed_round(self, ctx: RoundContext) -> int:
        """The round whose seed the clustering takes: this one, or with ``grouping_masks="warmup"`` and
        ``grouping_view="all"`` the round in which the clustered set last grew, so the same warm-up masks
        give the same groups in every round until a new device is grouped (item 22)."""
        if self.grouping_masks == "warmup" and self.grouping_view == "all" and self._warmup_round >= 0:
            return self._warmup_round
        return ctx.round_idx

    def _grouping_traffic(self, active: list[int]) -> tuple[tuple[int, int, int], ...]:
        """Alg. 2 run by one elected device (the lowest id): every other participant uploads its
        mask bits to it and receives the label vector (one byte per participant, two above 256 groups)."""
        collector, others = active[0], active[1:]
        mask_bytes = math.ceil(self._bits / 8)
        label_bytes = len(active) * (1 if self.num_groups <= 256 else 2)
        return tuple((k, collector, mask_bytes) for k in others) + tuple((collector, k, label_bytes) for k in others)

    # -- one task ---------------------------------------------------------------------------
    def _kept(self, ctx: TaskContext, vector: Tensor) -> tuple[int, int, int]:
        """(values sent, parameters kept, forward MACs) of a model with channel mask ``vector``."""
        key = np.packbits(vector.cpu().numpy()).tobytes()
        cached = self._kept_cache.get(key)
        if cached is None:
            model = ctx.module.model
            masks = ChannelMasks.from_vector(model, vector.cpu())
            expanded = expand(model, masks, include_buffers=True)
            values = sum(int(expanded[n].sum()) if n in expanded else t.numel() for n, t in ctx.worker.tensors.items())
            params = sum(int(expanded[n].sum()) if n in expanded else p.numel()
                         for n, p in model.named_parameters())
            macs = masked_macs(model, masks, profile=ctx.module.flops_profile)
            if len(self._kept_cache) > 4096:
                self._kept_cache.clear()
            cached = self._kept_cache[key] = (values, params, macs)
        return cached

    def message(self, ctx: TaskContext, source: Source) -> Message:
        """The source's published model (kept values x their bytes) and its channel mask (bits)."""
        weights, _ = ctx.store.published(source.node, source.fresh)
        channels = ctx.store.read(source.node, CHANNELS_FIELD, source.fresh)
        values, _, _ = self._kept(ctx, channels)
        itemsize = next(iter(weights.values())).element_size()
        return ChannelMessage(sender=source.node, weights=weights, mask=None, value_bytes=values * itemsize,
                              index_bytes=math.ceil(self._bits / 8), channels=channels)

    @torch.no_grad()
    def union_average(self, model: torch.nn.Module, messages: list[Message]) -> dict[str, Tensor]:
        """Fig. 4 (L210-219, notes 7): each entry averaged uniformly over the messages whose channel
        masks keep it; an entry kept by none is 0 (a BN variance 1); entries no channel touches (the
        classifier's bias) are averaged over all."""
        numerator: dict[str, Tensor] = {}
        count: dict[str, Tensor] = {}
        for message in messages:
            kept = expand(model, ChannelMasks.from_vector(model, message.channels.cpu()), include_buffers=True)
            for name, value in message.weights.items():
                if not value.is_floating_point():
                    numerator.setdefault(name, value.clone())
                    continue
                mask = kept.get(name)
                term = value if mask is None else value * mask.to(value.device)
                if name in numerator:
                    numerator[name].add_(term)
                    count[name].add_(1 if mask is None else mask.to(value.device, value.dtype))
                else:
                    numerator[name] = term.clone()
                    count[name] = (torch.ones_like(value) if mask is None
                                   else mask.to(value.device, value.dtype).clone())
        out = {}
        for name, total in numerator.items():
            if name not in count:
                out[name] = total
                continue
            averaged = total.div_(count[name].clamp_min(1.0))
            if name.endswith(".running_var"):
                averaged.masked_fill_(count[name] == 0, 1.0)
            out[name] = averaged
        return out

    def aggregate(self, ctx: TaskContext, messages: list[Message]) -> dict[str, Tensor] | None:
        model = ctx.module.model
        ctx.scratch["prisam/warmup_done"] = int(ctx.store.read(ctx.node, WARMUP_FIELD))
        if not messages:  # a warm-up round (or a lone device): local training under the current channels
            channels = ChannelMasks.from_vector(model, ctx.store.read(ctx.node, CHANNELS_FIELD).cpu())
            self._use_channels(ctx, channels)
            return None
        averaged = self.union_average(model, messages)
        if self.prune_after_train:  # train under the union of the group's channels (Alg. 1 literally)
            union = torch.stack([m.channels.cpu() for m in messages]).any(dim=0)
            channels = ChannelMasks.from_vector(model, union)
        else:  # re-prune by the averaged |gamma| (L212, notes 2)
            scores = state_channel_scores(averaged, self._groups)
            channels = ChannelMasks.from_scores(self._groups, scores, self.rho(ctx.node))
        mask_state_(model, averaged, channels)
        self._use_channels(ctx, channels)
        return averaged

    def _use_channels(self, ctx: TaskContext, channels: ChannelMasks) -> None:
        """Train under ``channels``: the worker's weight masks and the masks of the other parameters
        a channel touches (conv biases, BN gamma and beta), enforced after every step."""
        model = ctx.module.model
        expanded = expand(model, channels, include_buffers=False)
        weight_masks = {n: expanded.get(n, torch.ones_like(m)) for n, m in ctx.module.mask.masks.items()}
        ctx.module.mask.load_(weight_masks, apply=False)
        params = dict(model.named_parameters())
        ctx.scratch["prisam/other"] = [(params[n], m.to(params[n].device, params[n].dtype))
                                       for n, m in expanded.items() if n not in ctx.module.mask.masks]
        ctx.scratch["prisam/channels"] = channels

    def loss(self, ctx: TaskContext, batch: Any) -> Tensor:
        loss = ctx.module.loss(batch)
        if self.l1:
            modules = dict(ctx.module.model.named_modules())
            loss = loss + self.l1 * sum(modules[n].weight.abs().sum() for g in self._groups for n in g.norms)
        return loss

    def optimizer_step(self, ctx: TaskContext, closure: Any) -> Tensor:
        loss = closure()
        ctx.optimizer.step()
        with torch.no_grad():
            for param, mask in ctx.scratch.get("prisam/other", ()):
                param.mul_(mask)
        return loss

    def local_train(self, ctx: TaskContext) -> float:
        loss = super().local_train(ctx)
        done = ctx.scratch.get("prisam/warmup_done", self.warmup_rounds)
        first_prune = done == self.warmup_rounds - 1  # the device's last warm-up round ends with its first prune
        if first_prune or (self.prune_after_train and done >= self.warmup_rounds):
            model = ctx.module.model
            try:
                channels = ChannelMasks.from_bn_scaling(model, self.rho(ctx.node))
            except ValueError:  # non-finite gammas: the executor finds the weights non-finite and discards them
                return loss
            apply_channel_masks_(model, channels)
            self._use_channels(ctx, channels)
            ctx.module.mask.apply_()
        return loss

    def publish_fields(self, ctx: TaskContext) -> dict[str, Any]:
        channels = ctx.scratch.get("prisam/channels")
        if channels is None:
            return {}
        vector = channels.to_vector()
        values, params, macs = self._kept(ctx, vector)
        self._published[ctx.node] = (params, macs)
        ctx.report["kept_channels"] = float(vector.sum())
        ctx.report["compact_mmacs"] = macs / 1e6
        done = ctx.scratch.get("prisam/warmup_done", self.warmup_rounds)
        if done < self.warmup_rounds:
            return {CHANNELS_FIELD: vector, WARMUP_FIELD: done + 1}
        return {CHANNELS_FIELD: vector}

    # -- round end --------------------------------------------------------------------------
    def round_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        out = dict(self._info)
        if self._published:
            params = [p for p, _ in self._published.values()]
            macs = [m for _, m in self._published.values()]
            out["prisam/compact_mmacs_mean"] = sum(macs) / len(macs) / 1e6
            out["prisam/compact_params_mean"] = sum(params) / len(params)
            # Table I's communication column: 10 x the published model's MiB (notes 11)
            out["prisam/published_mib_x10"] = 10 * (sum(params) / len(params)) * 4 / 2 ** 20
        return out

    # -- sharded federations (lightning_dfl.federation.loop.sharded) ----------------------------
    def shard_snapshot(self) -> frozenset[int]:
        return frozenset(self._published)

    def shard_delta(self, snapshot: frozenset[int]) -> dict[int, tuple[int, int]]:
        return {k: v for k, v in self._published.items() if k not in snapshot}

    def shard_rollback(self, snapshot: frozenset[int]) -> None:
        self._published = {k: v for k, v in self._published.items() if k in snapshot}

    def shard_apply(self, delta: dict[int, tuple[int, int]]) -> None:
        self._published.update(delta)

    # -- checkpoints ------------------------------------------------------------------------
    @staticmethod
    def _pack(masks: dict[int, tuple[Tensor, Tensor | None]]) -> dict[str, Tensor] | None:
        if not masks:
            return None
        nodes = sorted(masks)
        packed = {"nodes": torch.tensor(nodes, dtype=torch.int64),
                  "vectors": torch.stack([masks[k][0] for k in nodes])}
        if masks[nodes[0]][1] is not None:
            packed["own"] = torch.stack([masks[k][1] for k in nodes])
        return packed

    @staticmethod
    def _unpack(packed: dict[str, Tensor] | None) -> dict[int, tuple[Tensor, Tensor | None]]:
        if not packed:
            return {}
        own = packed.get("own")
        return {int(k): (packed["vectors"][i].clone(), None if own is None else own[i].clone())
                for i, k in enumerate(packed["nodes"].tolist())}

    def state_dict(self) -> dict[str, Any]:
        pending = self._shared_pending
        return {"frozen": None if self._frozen is None else dict(self._frozen), "shared": self._pack(self._shared),
                "shared_pending": None if pending is None else {"round": pending[0], **(self._pack(pending[1]) or {})},
                "warmup": self._pack(self._warmup), "warmup_round": self._warmup_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        frozen = state.get("frozen")
        self._frozen = None if frozen is None else dict(frozen)
        self._shared = self._unpack(state.get("shared"))
        self._warmup = self._unpack(state.get("warmup"))
        self._warmup_round = int(state.get("warmup_round", -1))
        pending = state.get("shared_pending")
        self._shared_pending = (None if pending is None
                                else (int(pending["round"]), self._unpack({k: v for k, v in pending.items()
                                                                           if k != "round"})))
