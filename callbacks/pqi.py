"""Sparse to sparser: PQ-index-driven further pruning as a callback (DA-DPFL Alg. 1 lines 18-25, Alg. 2).

In a pruning round, a client whose sparsity ``s_k`` (share of zeros over the masked set) is below
the target ``s*`` prunes, layer by layer, the smallest active weights, as many as the PQ index
of the layer's active weights says it can spare (:func:`~lightning_dfl.sparse.pqi.pqi_prune_masks`).
When a step would pass ``s*``, every layer's count is scaled by one common factor so that the
masked set lands on ``s*`` exactly (:func:`~lightning_dfl.sparse.pqi.prune_budget`). The pruned
weights are zeroed at once, so the model a client publishes is the pruned one (line 25).

Each client's sparsity after its latest task is a per-client record (the client store's field
``pqi/sparsity`` in a federation, the callback's one record in a plain ``Trainer``, see
:mod:`~lightning_dfl.callbacks._records`); the log of prune events is global.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dfl.callbacks._mask_owner import MaskOwner, federated_mask, module_mask
from lightning_dfl.callbacks._records import ClientRecords, OneRecord
from lightning_dfl.callbacks.base import FederatedCallback, is_federated, log_epoch_value
from lightning_dfl.checks import is_int, is_number
from lightning_dfl.sparse.masks import ModelMask, maskable_parameters
from lightning_dfl.sparse.pqi import (
    DEFAULT_BETA,
    DEFAULT_ETA_C,
    DEFAULT_GAMMA,
    DEFAULT_P,
    DEFAULT_Q,
    pqi_prune_masks,
    prune_budget,
)
from lightning_dfl.state_field import StateField
from lightning_dfl.stats import mean_std

SPARSITY = "pqi/sparsity"  #: float64: a client's sparsity after its latest task, after pruning (NaN: none yet)
_FIELDS = (StateField(SPARSITY, dtype=torch.float64, fill=math.nan),)


@dataclass(frozen=True)
class PruneEvent:
    """One run of Alg. 2 on one client (``client`` is 0 in a plain ``Trainer``); plain numbers only."""

    round_idx: int
    client: int
    pruned: int
    sparsity_before: float
    sparsity_after: float
    counts: dict[str, int] = field(default_factory=dict)


class PQIPruning(FederatedCallback):
    r"""Prune further by the PQ index in the pruning rounds, up to ``target_sparsity`` (DA-DPFL Alg. 2).

    .. code-block:: python

        trainer = FederatedTrainer(callbacks=[PruningTimeVoting(), PQIPruning(target_sparsity=0.8)])
        trainer = Trainer(max_epochs=30, callbacks=[PQIPruning(0.5, schedule=[10, 20])])

    When to prune: ``schedule`` is a callable ``round_idx -> bool`` or a list of 0-based round
    (epoch) indices; with ``None`` the rounds come from the one callback in ``trainer.callbacks``
    that has ``is_pruning_round`` (:class:`~lightning_dfl.callbacks.voting.PruningTimeVoting`),
    found at ``setup``; it must come before this callback, since its score is taken before
    pruning.

    Federation: in ``on_client_train_end`` (after the vote, before the model is published and
    before RigL), a client in a pruning round that can still prune at least one weight without
    passing ``s*`` runs Alg. 2 on the module's own
    :class:`~lightning_dfl.sparse.masks.ModelMask` and zeros the pruned weights. At
    ``on_federated_round_end`` ``trainer.log_metrics`` gets ``pqi/pruned_clients`` (clients on
    which Alg. 2 ran), ``pqi/pruned_weights`` and ``sparsity/mean``, ``sparsity/std`` over the
    clients that trained (population std, after pruning). Each client's sparsity after its latest
    task is its store field ``pqi/sparsity`` (float64, NaN: none yet; :meth:`client_state_fields`).

    Plain ``Trainer``: prunes at ``on_train_epoch_end`` of the scheduled epochs and logs
    ``pqi/pruned_weights`` and ``sparsity/mean`` with ``pl_module.log``. The module's own mask is the one
    pruned (:class:`~lightning_dfl.module.SparseClassifier`'s); a module without one gets one from
    the callback at ``on_fit_start`` (once the module built its layers) over its Conv/Linear weights, active
    where the weight is nonzero (dense for a fresh model); its hooks keep pruned weights at zero
    (as :class:`~lightning_dfl.callbacks.rigl.RigL` does; the two do not share such a mask).

    Checkpoints: :meth:`state_dict` holds :attr:`history` (plain dicts), an owned mask and, in a
    plain ``Trainer``, the one client's record (in a federation the records go with the store).

    Args:
        target_sparsity: ``s*``, the share of zeros over the masked set to reach, in ``[0, 1)``.
        p, q: norm indices of the PQ index, ``0 < p < q``, ``q >= 1`` (SAP: 0.5 and 1).
        eta_c: compression hyper-parameter, >= 0 (SAP: 0; DA-DPFL prints 1, see the errata).
        gamma: scaling factor, >= 0 (SAP: 1).
        beta: the largest share of a layer's active weights one event may prune, in [0, 1].
        schedule: the pruning rounds (see above).
        verbose: 0 silent, 1 one line per pruning event, 2 also one line per layer.

    Raises:
        MisconfigurationException: if an argument is out of range or of the wrong type.
    """

    def __init__(
        self,
        target_sparsity: float = 0.8,
        p: float = DEFAULT_P,
        q: float = DEFAULT_Q,
        eta_c: float = DEFAULT_ETA_C,
        gamma: float = DEFAULT_GAMMA,
        beta: float = DEFAULT_BETA,
        schedule: Callable[[int], bool] | Sequence[int] | None = None,
        verbose: int = 0,
    ) -> None:
        if not is_number(target_sparsity) or not 0 <= target_sparsity < 1:
            raise MisconfigurationException(f"`target_sparsity` must be a float in [0, 1), got {target_sparsity!r}")
        if not is_number(p) or not p > 0:
            raise MisconfigurationException(f"`p` must be a float > 0, got {p!r}")
        if not is_number(q) or not q >= 1:
            raise MisconfigurationException(f"`q` must be a float >= 1, got {q!r}")
        if not p < q:
            raise MisconfigurationException(f"the PQ index needs `p` < `q`, got p={p!r}, q={q!r}")
        if not is_number(eta_c) or not eta_c >= 0:
            raise MisconfigurationException(f"`eta_c` must be a float >= 0, got {eta_c!r}")
        if not is_number(gamma) or not gamma >= 0:
            raise MisconfigurationException(f"`gamma` must be a float >= 0, got {gamma!r}")
        if not is_number(beta) or not 0 <= beta <= 1:
            raise MisconfigurationException(f"`beta` must be a float in [0, 1], got {beta!r}")
        self._schedule_fn: Callable[[int], bool] | None = None
        self._schedule_set: frozenset[int] | None = None
        if callable(schedule):
            self._schedule_fn = schedule
        elif schedule is not None:
            is_list = isinstance(schedule, Sequence) and not isinstance(schedule, (str, bytes))
            if not is_list or not all(is_int(i) and i >= 0 for i in schedule):
                raise MisconfigurationException(
                    "`schedule` must be a callable round_idx -> bool, a list of round indices (ints >= 0) "
                    f"or None (take the rounds from a voting callback), got {schedule!r}")
            self._schedule_set = frozenset(int(i) for i in schedule)
        if not is_int(verbose) or verbose not in (0, 1, 2):
            raise MisconfigurationException(f"`verbose` must be any of (0, 1, 2), got {verbose!r}")

        self.target_sparsity = float(target_sparsity)
        self.p, self.q = float(p), float(q)
        self.eta_c, self.gamma, self.beta = float(eta_c), float(gamma), float(beta)
        self.schedule = schedule
        self.verbose = verbose

        self._masks = MaskOwner("PQIPruning")
        self._voter: Any = None
        self._records = ClientRecords("PQIPruning")
        #: every run of Alg. 2, in order (a global log, not per-client state).
        self.history: list[PruneEvent] = []
        self._round: int | None = None
        self._round_sparsity: list[tuple[int, float]] = []  # this round's (client, sparsity)
        self._round_events = 0
        self._round_pruned = 0

    # -- schedule ------------------------------------------------------------------------
    @property
    def owns_mask(self) -> bool:
        """True when the callback built the mask (the module brought none)."""
        return self._masks.owns_mask

    def should_prune(self, round_idx: int) -> bool:
        """Whether the 0-based round (epoch) ``round_idx`` is a pruning round."""
        if self._schedule_fn is not None:
            result = self._schedule_fn(round_idx)
            if not isinstance(result, (bool, np.bool_)):
                raise ValueError(f"the `schedule` callable returned {result!r} at round {round_idx}; expected a bool")
            return bool(result)
        if self._schedule_set is not None:
            return round_idx in self._schedule_set
        if self._voter is None:
            raise RuntimeError("PQIPruning has no schedule yet: with schedule=None it finds the voting callback "
                               "in `setup('fit')`")
        return bool(self._voter.is_pruning_round(round_idx))

    def client_state_fields(self, trainer: Any, pl_module: Any) -> list[StateField]:
        """A client's record, declared for the federation's client store: ``pqi/sparsity``."""
        return list(_FIELDS)

    def _find_voter(self, trainer: Any) -> Any:
        callbacks = list(getattr(trainer, "callbacks", None) or [])
        voters = [c for c in callbacks if c is not self and callable(getattr(c, "is_pruning_round", None))]
        if not voters:
            raise MisconfigurationException(
                "PQIPruning(schedule=None) takes its pruning rounds from a callback with `is_pruning_round` "
                "(e.g. PruningTimeVoting) in the trainer's callbacks, and there is none; add one or pass `schedule`")
        if len(voters) > 1:
            raise MisconfigurationException(
                f"PQIPruning(schedule=None) found {len(voters)} callbacks with `is_pruning_round` "
                f"({', '.join(type(v).__name__ for v in voters)}); keep one or pass `schedule`")
        voter = voters[0]
        position = {id(c): i for i, c in enumerate(callbacks)}
        if id(self) in position and position[id(voter)] > position[id(self)]:
            raise MisconfigurationException(
                f"{type(voter).__name__} must come before PQIPruning in the callbacks: the detection score "
                "is taken after local training and before pruning")
        return voter

    # -- setup ---------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self._schedule_fn is None and self._schedule_set is None:
            self._voter = self._find_voter(trainer)
        if is_federated(trainer):
            if module_mask(pl_module) is None:
                raise MisconfigurationException(
                    "PQIPruning in a federation needs the module's own ModelMask (`pl_module.mask`), so that each "
                    f"client's mask travels with its state; {type(pl_module).__name__} has none")
            return
        if SPARSITY not in self._records.plain:
            self._records.plain = OneRecord(_FIELDS)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Build the callback's own mask for a module without one, once the module built its layers (in its
        ``setup``) and a checkpoint was restored."""
        if is_federated(trainer):
            return
        self._masks.setup(pl_module, lambda: {name: p.detach() != 0
                                              for name, p in maskable_parameters(pl_module).items()})
        self._masks.follow_device(pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._masks.teardown()

    # -- pruning -------------------------------------------------------------------------
    def _prune(self, trainer: Any, mask: ModelMask, round_idx: int, client: int, when: str) -> PruneEvent | None:
        """Alg. 2 on ``mask`` when it can still prune a weight without passing ``s*``."""
        budget = prune_budget(mask.masks, self.target_sparsity)
        if budget == 0:
            return None
        mask.apply_()  # magnitudes of the masked weights
        before = mask.sparsity()
        weights = {name: param.detach() for name, param in mask.params.items()}
        new, counts = pqi_prune_masks(weights, mask.masks, self.p, self.q, self.eta_c, self.gamma, self.beta,
                                      max_prune=budget)
        if not is_federated(trainer) and getattr(trainer, "world_size", 1) > 1:  # identical masks on every rank
            new = trainer.strategy.broadcast(new, src=0)
        mask.load_(new, apply=True)
        event = PruneEvent(int(round_idx), int(client), int(sum(counts.values())), float(before),
                           float(mask.sparsity()), {str(n): int(c) for n, c in counts.items()})
        self.history.append(event)
        if self.verbose >= 1:
            rank_zero_info(f"PQI {when}: pruned {event.pruned} weights, sparsity {before:.4f} -> "
                           f"{event.sparsity_after:.4f} (target {self.target_sparsity})")
        if self.verbose >= 2:
            for name, count in counts.items():
                rank_zero_info(f"PQI   {name}: pruned {count}, density {mask.masks[name].float().mean().item():.4f}")
        return event

    # -- federation ----------------------------------------------------------------------
    def on_federated_round_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin_round(int(trainer.current_round))

    def _begin_round(self, round_idx: int) -> None:
        if self._round != round_idx:
            self._round = round_idx
            self._round_sparsity.clear()
            self._round_events = self._round_pruned = 0

    def on_client_train_end(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        mask = federated_mask(pl_module, "PQIPruning")
        round_idx, client = int(trainer.current_round), int(client_id)
        self._begin_round(round_idx)
        if self.should_prune(round_idx):
            event = self._prune(trainer, mask, round_idx, client, f"round {round_idx} client {client}")
            if event is not None:
                self._round_events += 1
                self._round_pruned += event.pruned
        self._round_sparsity.append((client, self._note_sparsity(trainer, client, mask)))

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        if self._round != int(trainer.current_round) or not self._round_sparsity:
            return
        mean, std = mean_std([v for _, v in sorted(self._round_sparsity)])  # by client: order-free sums
        trainer.log_metrics({"pqi/pruned_clients": float(self._round_events),
                             "pqi/pruned_weights": float(self._round_pruned),
                             "sparsity/mean": mean, "sparsity/std": std})
        self._round_sparsity.clear()

    # -- sharded federations (lightning_dfl.federation.loop.sharded) --------------------------
    def shard_snapshot(self) -> tuple[int, int, int, int]:
        return len(self.history), len(self._round_sparsity), self._round_events, self._round_pruned

    def shard_delta(self, snapshot: tuple[int, int, int, int]) -> tuple[list, list, int, int]:
        history, sparsity, events, pruned = snapshot
        return (self.history[history:], self._round_sparsity[sparsity:], self._round_events - events,
                self._round_pruned - pruned)

    def shard_rollback(self, snapshot: tuple[int, int, int, int]) -> None:
        history, sparsity, self._round_events, self._round_pruned = snapshot
        del self.history[history:], self._round_sparsity[sparsity:]

    def shard_apply(self, delta: tuple[list, list, int, int]) -> None:
        history, sparsity, events, pruned = delta
        self.history.extend(history)
        self._round_sparsity.extend(sparsity)
        self._round_events += events
        self._round_pruned += pruned

    def _note_sparsity(self, trainer: Any, client: int, mask: ModelMask) -> float:
        """Write ``client``'s sparsity after its task (after pruning) into its record; return it."""
        sparsity = mask.sparsity()
        self._records.of(trainer, client)[SPARSITY] = sparsity
        return sparsity

    #: the batch hooks it acts in within a federation: none (its on_train_batch_end re-applies a mask the module
    #: itself keeps there), so a batched step may train its clients (the engine reads it: federated_batch_hooks)
    federated_batch_hooks: tuple[str, ...] = ()

    # -- plain Trainer -------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._masks.apply_()  # after the optimizer step; no-op when the module owns its mask

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_federated(trainer):
            return  # a client's local epoch; the federation prunes after the last one
        epoch = int(trainer.current_epoch)
        mask = self._masks.get(pl_module)
        event = None
        if self.should_prune(epoch):
            event = self._prune(trainer, mask, epoch, 0, f"epoch {epoch}")
        sparsity = self._note_sparsity(trainer, 0, mask)
        log_epoch_value(pl_module, "pqi/pruned_weights", float(event.pruned if event else 0))
        log_epoch_value(pl_module, "sparsity/mean", sparsity)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"history": [asdict(e) for e in self.history],
                                 "plain": self._records.plain.state()}
        masks = self._masks.state()
        if masks is not None:
            state["masks"] = masks
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [PruneEvent(**e) for e in state_dict.get("history", [])]
        self._records.plain.load(state_dict.get("plain") or {})
        self._masks.load_state(state_dict.get("masks"))
