"""When to start pruning: DA-DPFL's detection score and voting rule (Sec. IV-C, Eq. 4-6).

The pure rules live in :mod:`lightning_dfl.pruning_time`; this callback feeds them with weights:

* Eq. 4: ``Delta^t(k) = ||w^t - w^0||^2`` over all floating parameters of the module (zeros
  included), after the local epochs of round ``t`` and before PQI pruning; the score is
  ``|Delta^t - Delta^(t-1)| / |Delta^1|``;
* Eq. 5: the client's vote is 1 ("stable") when its score is below ``delta_pr``;
* errata: ``t* = min{t : mean vote >= delta_v}``, decided once;
* Eq. 6 (errata): the pruning rounds ``t_1 = max(t* + b, t* + 1)``, ``t_p = t_(p-1) + I_p``,
  ``t_p < T`` (:func:`~lightning_dfl.pruning_time.pruning_rounds`).

Round numbering: the papers count rounds ``t = 1..T``; the engine counts ``round_idx = t - 1``
from 0. ``Delta^1`` is the Delta of a client's first round; in that round it has no score and
votes 0 (Eq. 4 read literally, with ``Delta^0 = ||w^0 - w^0||^2 = 0``, gives the score 1 there,
which is not stable for any ``delta_pr <= 1``). ``t*`` is reported in paper numbering
(``round_idx + 1`` of the first round whose vote share reaches ``delta_v``); a paper pruning round
``t_p`` runs at ``round_idx = t_p - 1``, so the first pruning happens in a later round than the
one that decided ``t*`` (Alg. 1 line 27).

Where the records live: a client's Deltas, score, vote and initial model are per-client records
(:mod:`~lightning_dfl.callbacks._records`): in a federation they are fields of the client store,
checkpointed with it; in a plain ``Trainer`` the callback keeps its one voter's record. The
per-round aggregates (vote shares, mean scores, ``t*``, the pruning rounds) and the shared
reference of the initial models are global: they live in the callback and its ``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_dfl.callbacks._mask_owner import module_mask
from lightning_dfl.callbacks._records import ClientRecords, OneRecord
from lightning_dfl.callbacks.base import FederatedCallback, is_federated, log_epoch_value
from lightning_dfl.checks import is_int, is_number
from lightning_dfl.pruning_time import PruningSchedule, detection_score, first_pruning_round, pruning_rounds, vote
from lightning_dfl.sparse.bits import pack_bits, unpack_bits
from lightning_dfl.state_field import StateField

#: The voter id used in a plain ``Trainer`` (one model, one vote).
PLAIN_VOTER = 0

# A voter's record (client store fields in a federation, see ``PruningTimeVoting.client_state_fields``).
HAS_INITIAL = "voting/has_initial"  #: bool: its initial model w^0 was taken
INITIAL_MASK = "voting/initial_mask"  #: uint8, one bit per masked entry: the mask of w^0 (:func:`pack_bits`)
DELTA_FIRST = "voting/delta_first"  #: float64: Delta^1, the Delta of its first round (NaN: none yet)
DELTA_LAST = "voting/delta_last"  #: float64: the Delta of its latest round (NaN: none yet)
SCORE = "voting/score"  #: float64: its latest score, Eq. 4 (NaN: none yet, before its second round)
VOTE = "voting/vote"  #: int8: its latest vote, Eq. 5 (-1: none yet)


def _floating_parameters(pl_module: Any) -> dict[str, Tensor]:
    return {name: p for name, p in pl_module.named_parameters() if p.is_floating_point()}


def _masks_by_parameter_name(pl_module: Any, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The module's ``ModelMask`` entries, renamed to ``pl_module.named_parameters()`` names."""
    mask = module_mask(pl_module)
    if mask is None:
        return {}
    name_of = {id(p): name for name, p in params.items()}
    return {name_of[id(p)]: mask.masks[m] for m, p in mask.params.items() if id(p) in name_of}


@torch.no_grad()
def distance_sq(params: Mapping[str, Tensor], initial: Mapping[str, Tensor]) -> float:
    """``||w - w^0||^2`` over ``params`` (Eq. 4's Delta), accumulated in float64 (float32 on MPS), parameter
    by parameter in ``params``' order."""
    total: Tensor | None = None
    for name, p in params.items():
        w0 = initial[name].to(p.device)
        if w0.shape != p.shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, its initial value {tuple(w0.shape)}")
        acc = torch.float32 if p.device.type == "mps" else torch.float64
        part = (p.detach().to(acc) - w0.to(acc)).square().sum()
        total = part if total is None else total + part.to(total.device)
    return float(total) if total is not None else 0.0


class InitialModels:
    """The voters' initial models ``w^0``: one shared reference model, and per voter its mask's bits.

    Clients start from one shared dense model, each masked by its own initial mask. The first
    model becomes a CPU *reference*; a later one is compatible with it when it equals the
    reference on the active entries both know (masked parameters), is zero on its inactive ones,
    and equals it everywhere on unmasked parameters; the entries it knows and the reference does
    not are filled in from it. A compatible voter's ``w^0`` is ``where(mask, reference, 0)``,
    exact up to the sign of zeros, so it is kept as its mask's packed bits (:func:`pack_bits`,
    one bit per masked entry, in the order of :attr:`known`). The reference is global (the
    callback's ``state_dict``); the bits are per voter (its record).
    """

    def __init__(self) -> None:
        self.reference: dict[str, Tensor] | None = None
        self.known: dict[str, Tensor] = {}  # masked names, in packing order: entries of the reference seen so far
        self._version = 0
        self._cache: tuple[torch.device, int, dict[str, Tensor]] | None = None

    def nbytes(self) -> int:
        """Memory held by the reference and :attr:`known` (the part shared by all voters)."""
        tensors = list((self.reference or {}).values()) + list(self.known.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def incompatibility(self, params: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> str | None:
        """Why the CPU ``params`` (masked by the bool ``masks``, names a subset) are not the reference
        under a mask, or None when they are."""
        for n, m in masks.items():
            if m.shape != params[n].shape:
                return f"the mask of {n!r} has shape {tuple(m.shape)}, the parameter {tuple(params[n].shape)}"
            if bool(params[n][~m].ne(0).any()):
                return f"{n!r} is nonzero (or NaN) outside its mask"
        if self.reference is None:
            return None
        if set(params) != set(self.reference) or set(masks) != set(self.known):
            return (f"its parameters {sorted(params)} (masked {sorted(masks)}) are not the reference's "
                    f"{sorted(self.reference)} (masked {sorted(self.known)})")
        for n, w in params.items():
            ref = self.reference[n]
            if w.shape != ref.shape or w.dtype != ref.dtype:
                return f"{n!r} is {w.dtype} {tuple(w.shape)}, the reference's {ref.dtype} {tuple(ref.shape)}"
            if n in masks:
                both = masks[n] & self.known[n]
                if not torch.equal(w[both], ref[both]):
                    return f"{n!r} differs from the reference on active entries (or holds NaN)"
            elif not torch.equal(w, ref):
                return f"the unmasked {n!r} differs from the reference (or holds NaN)"
        return None

    @torch.no_grad()
    def add(self, params: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> Tensor:
        """Merge a compatible initial model (CPU ``params`` under the bool ``masks``, see
        :meth:`incompatibility`) into the reference; return its mask's packed bits."""
        if self.reference is None:
            self.reference = {n: torch.where(masks[n], w, torch.zeros_like(w)) if n in masks else w.clone()
                              for n, w in params.items()}
            self.known = {n: m.clone() for n, m in masks.items()}
        else:
            for n, m in masks.items():
                new = m & ~self.known[n]
                self.reference[n][new] = params[n][new]
                self.known[n] |= m
        self._version += 1
        return pack_bits(torch.cat([masks[n].reshape(-1) for n in self.known] or [torch.zeros(0, dtype=torch.bool)]),
                         bitorder="big")

    def _reference_on(self, device: torch.device) -> dict[str, Tensor]:
        assert self.reference is not None
        if self._cache is None or self._cache[0] != device or self._cache[1] != self._version:
            self._cache = (device, self._version, {n: t.to(device) for n, t in self.reference.items()})
        return self._cache[2]

    def model(self, bits: Tensor, device: torch.device) -> dict[str, Tensor]:
        """The initial model whose mask :meth:`add` packed into ``bits``, on ``device``."""
        if self.reference is None:
            raise RuntimeError("no initial model was added yet: there is no reference")
        reference = self._reference_on(device)
        flat = unpack_bits(bits.to(device), sum(m.numel() for m in self.known.values()), bitorder="big")
        model, offset = dict(reference), 0
        for n, known in self.known.items():
            mask = flat[offset:offset + known.numel()].view(known.shape)
            offset += known.numel()
            ref = reference[n]
            model[n] = torch.where(mask, ref, torch.zeros((), dtype=ref.dtype, device=device))
        return model

    @torch.no_grad()
    def merge(self, state: Mapping[str, Any]) -> None:
        """Add another copy's known entries (both hold the same shared initial model, so the union
        does not depend on the order of merges)."""
        reference, known = state.get("reference"), state.get("known") or {}
        if reference is None:
            return
        if self.reference is None:
            self.reference = {n: t.clone() for n, t in reference.items()}
            self.known = {n: m.clone() for n, m in known.items()}
        else:
            for n, m in known.items():
                new = m & ~self.known[n]
                self.reference[n][new] = reference[n][new]
                self.known[n] |= m
        self._version += 1

    def state(self) -> dict[str, Any]:
        return {"reference": self.reference, "known": self.known}

    def load(self, state: Mapping[str, Any]) -> None:
        self.reference = state.get("reference")
        self.known = dict(state.get("known") or {})
        self._version += 1
        self._cache = None


class PruningTimeVoting(FederatedCallback):
    r"""Decide when to start pruning by the clients' majority vote (DA-DPFL Eq. 4-6).

    .. code-block:: python

        voting = PruningTimeVoting(delta_pr=0.03)
        trainer = FederatedTrainer(callbacks=[voting, PQIPruning(target_sparsity=0.8)])

    Federation (``trainer.is_federated``): a client's initial model ``w^0`` is its model at its
    first ``on_client_before_aggregation`` (its own state, before aggregating). After its local
    epochs (``on_client_train_end``, before PQI) it computes ``Delta``, its score and its vote.
    At ``on_federated_round_end`` the vote share over the clients that trained this round
    decides ``t*`` once (``>= delta_v``), then the pruning rounds; ``trainer.log_metrics`` gets
    ``voting/share``, ``voting/score_mean`` (when some client has a score) and, once decided,
    ``voting/t_star``. A client that skipped rounds compares with its own last Delta.

    Each client's record lives in the client store (:meth:`client_state_fields`, read with
    ``trainer.client_state(k)``): ``voting/delta_first`` (``Delta^1``), ``voting/delta_last``,
    ``voting/score`` (float64, NaN: none yet), ``voting/vote`` (int8, -1: none yet),
    ``voting/has_initial`` (bool) and ``voting/initial_mask``, the mask of ``w^0`` as packed bits
    (uint8, one bit per masked entry). ``w^0`` itself is the callback's shared reference model
    under that mask (:class:`InitialModels`; :meth:`initial_model` rebuilds it): every client
    starts from the shared initial model masked by its own mask, and a client whose initial
    model is not of that form is refused with an error that says why.

    Plain ``Trainer``: one voter whose record the callback keeps; ``w^0`` is taken at
    ``on_fit_start`` (a fresh fit resets the history unless a checkpoint state was loaded), as
    the reference plus its mask's bits, or as a full copy when it is nonzero (or NaN) outside its
    mask; a round is an epoch (``t`` = epoch + 1), ``T = max_epochs`` (must be finite) and the
    metrics are logged with ``pl_module.log``.

    Checkpoints: :meth:`state_dict` holds the per-round vote shares and mean scores, ``t*``, the
    reference of the initial models and, in a plain ``Trainer``, the one voter's record (in a
    federation the records are checkpointed with the store). Use one callback instance per run.

    Args:
        delta_pr: pruning threshold of Eq. 5, > 0 (the papers use 0.01-0.03).
        delta_v: voting threshold, the share of stable votes that decides ``t*``, in (0, 1].
        b: delay of the first pruning round (Eq. 6), >= 0.
        c: scale of the pruning frequency (Eq. 6), > 0; with ``c > 1`` pruning intensifies.
        verbose: 0 silent, 1 one line when ``t*`` is decided, 2 also one line per round.

    Raises:
        MisconfigurationException: if an argument is out of range or of the wrong type.
    """

    def __init__(self, delta_pr: float = 0.03, delta_v: float = 0.5, b: float = 0.0, c: float = 1.3,
                 verbose: int = 0) -> None:
        if not is_number(delta_pr) or not delta_pr > 0:
            raise MisconfigurationException(f"`delta_pr` must be a float > 0, got {delta_pr!r}")
        if not is_number(delta_v) or not 0 < delta_v <= 1:
            raise MisconfigurationException(f"`delta_v` must be a float in (0, 1], got {delta_v!r}")
        if not is_number(b) or not b >= 0:
            raise MisconfigurationException(f"`b` must be a float >= 0, got {b!r}")
        if not is_number(c) or not c > 0:
            raise MisconfigurationException(f"`c` must be a float > 0, got {c!r}")
        if not is_int(verbose) or verbose not in (0, 1, 2):
            raise MisconfigurationException(f"`verbose` must be any of (0, 1, 2), got {verbose!r}")
        self.delta_pr = float(delta_pr)
        self.delta_v = float(delta_v)
        self.b = float(b)
        self.c = float(c)
        self.verbose = verbose
        self._reset()
        self._restored = False

    def _reset(self) -> None:
        self._initial = InitialModels()
        self._records = ClientRecords("PruningTimeVoting")
        #: a plain ``Trainer``'s one voter: its full initial model when it is no masked reference.
        self._plain_initial: dict[str, Tensor] | None = None
        #: per round index: the vote share and the mean score of the clients that trained.
        self.vote_shares: dict[int, float] = {}
        self.score_means: dict[int, float] = {}
        #: the first pruning time in paper numbering (round index + 1), once decided.
        self.t_star: int | None = None
        self.total_rounds: int | None = None
        #: the pruning rounds of Eq. 6 as 0-based round (epoch) indices.
        self.pruning_round_indices: tuple[int, ...] = ()
        self._round: int | None = None
        self._round_votes: list[int] = []  # this round's votes and scores, in the order the clients trained
        self._round_scores: list[float] = []

    # -- public --------------------------------------------------------------------------
    def is_pruning_round(self, round_idx: int) -> bool:
        """Whether the 0-based round (epoch) ``round_idx`` is a pruning round (False before ``t*``)."""
        return round_idx in self.pruning_round_indices

    @property
    def schedule(self) -> PruningSchedule | None:
        """The pruning rounds in paper numbering, once ``t*`` is decided."""
        if self.t_star is None or self.total_rounds is None:
            return None
        return PruningSchedule(self.t_star, self.total_rounds, self.b, self.c)

    def client_state_fields(self, trainer: Any, pl_module: Any) -> list[StateField]:
        """A voter's record, declared for the federation's client store (see the class docstring)."""
        params = _floating_parameters(pl_module)
        masked = sum(m.numel() for m in _masks_by_parameter_name(pl_module, params).values())
        return [
            StateField(HAS_INITIAL, dtype=torch.bool),
            StateField(INITIAL_MASK, shape=(-(-masked // 8),), dtype=torch.uint8),
            StateField(DELTA_FIRST, dtype=torch.float64, fill=math.nan),
            StateField(DELTA_LAST, dtype=torch.float64, fill=math.nan),
            StateField(SCORE, dtype=torch.float64, fill=math.nan),
            StateField(VOTE, dtype=torch.int8, fill=-1.0),
        ]

    def initial_model(self, trainer: Any, client: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """``client``'s initial model ``w^0`` by ``pl_module.named_parameters()`` name, on ``device``."""
        record = self._records.of(trainer, client)
        if not bool(record[HAS_INITIAL]):
            raise RuntimeError(f"PruningTimeVoting has no initial model of client {client}: it is taken at the "
                               "client's first `on_client_before_aggregation` (in a plain Trainer at "
                               "`on_fit_start`), which was not called")
        if self._plain_initial is not None and not is_federated(trainer):
            return {n: t.to(device) for n, t in self._plain_initial.items()}
        return self._initial.model(record[INITIAL_MASK], torch.device(device))

    def latest_scores(self, trainer: Any) -> dict[int, float]:
        """Each client's latest score (Eq. 4) from its record; clients without one are left out."""
        scores = {k: float(self._records.of(trainer, k)[SCORE]) for k in self._records.clients(trainer)}
        return {k: s for k, s in scores.items() if not math.isnan(s)}

    # -- the rules -----------------------------------------------------------------------
    @torch.no_grad()
    def _take_initial(self, trainer: Any, pl_module: Any, client: int) -> None:
        """Keep the module's current model as ``client``'s ``w^0``: the reference plus its mask's bits."""
        params = _floating_parameters(pl_module)
        cpu = {n: t.detach().to("cpu", copy=True) for n, t in params.items()}
        masks = {n: m.detach().to("cpu", dtype=torch.bool)
                 for n, m in _masks_by_parameter_name(pl_module, params).items()}
        problem = self._initial.incompatibility(cpu, masks)
        record = self._records.of(trainer, client)
        if problem is None:
            record[INITIAL_MASK] = self._initial.add(cpu, masks)
        elif is_federated(trainer):
            raise RuntimeError(
                f"PruningTimeVoting: client {client}'s initial model is not the shared initial model under its "
                f"mask: {problem}. In a federation every client starts from the shared initial model masked by "
                "its own mask, and w^0 is kept as that model plus one bit per masked entry; start every client "
                "from the same model")
        else:
            self._plain_initial = cpu
        record[HAS_INITIAL] = True

    def _delta(self, trainer: Any, pl_module: Any, client: int) -> float:
        """Eq. 4's ``Delta = ||w^t - w^0||^2`` of the module's floating parameters."""
        params = _floating_parameters(pl_module)
        initial = self.initial_model(trainer, client, next(iter(params.values())).device if params else "cpu")
        if set(params) != set(initial):
            raise ValueError(f"client {client}'s parameters changed since its initial model was stored: "
                             f"missing {sorted(set(initial) - set(params))}, new {sorted(set(params) - set(initial))}")
        return distance_sq(params, initial)

    def _begin_round(self, round_idx: int) -> None:
        if self._round != round_idx:
            self._round = round_idx
            self._round_votes.clear()
            self._round_scores.clear()

    def _record(self, record: Any, delta: float) -> None:
        """Eq. 4-5 for one client's Delta, in its record; a client's first Delta gives no score, vote 0."""
        if int(record[VOTE]) < 0:
            record[DELTA_FIRST] = delta
            record[DELTA_LAST] = delta
            v = 0
        else:
            score = detection_score(delta, float(record[DELTA_LAST]), float(record[DELTA_FIRST]))
            v = vote(score, self.delta_pr)
            record[DELTA_LAST] = delta
            # inf: Delta_1 = 0 (the client did not move in its first round), Eq. 4's ratio is undefined; it votes
            # "not stable", is recorded as NaN ("no score") and left out of the score mean: records stay finite
            record[SCORE] = score if math.isfinite(score) else math.nan
            if math.isfinite(score):
                self._round_scores.append(score)
        record[VOTE] = v
        self._round_votes.append(v)

    def _close_round(self, round_idx: int, total: int) -> dict[str, float]:
        """The round's vote share, ``t*`` (once) and the metrics to log."""
        if self._round != round_idx or not self._round_votes:
            return {}
        share = sum(self._round_votes) / len(self._round_votes)
        self.vote_shares[round_idx] = share
        metrics = {"voting/share": share}
        if self._round_scores:
            mean = math.fsum(self._round_scores) / len(self._round_scores)
            self.score_means[round_idx] = mean
            metrics["voting/score_mean"] = mean
        if self.t_star is None:
            t_star = first_pruning_round([share], self.delta_v, first_round=round_idx + 1)
            if t_star is not None:
                self._decide(t_star, total)
        if self.t_star is not None:
            metrics["voting/t_star"] = float(self.t_star)
        if self.verbose >= 2:
            rank_zero_info(f"Voting round {round_idx}: share {share:.3f}, mean score "
                           f"{metrics.get('voting/score_mean', float('nan')):.4f}")
        self._round_votes.clear()
        self._round_scores.clear()
        return metrics

    def _follow(self, total: int) -> None:
        """A run resumed with another T: the pruning rounds after ``t*`` (decided with the checkpoint's T) are
        those of the new T, as RigL's schedule follows it (Eq. 6 stops at T: a longer run goes on pruning)."""
        if self.t_star is not None and self.total_rounds != total:
            self._decide(self.t_star, total)

    def _decide(self, t_star: int, total: int) -> None:
        self.t_star, self.total_rounds = int(t_star), int(total)
        self.pruning_round_indices = tuple(t - 1 for t in pruning_rounds(self.t_star, self.total_rounds,
                                                                          self.b, self.c))
        if self.verbose >= 1:
            rank_zero_info(f"Voting: t* = {self.t_star} (round index {self.t_star - 1}); pruning at round indices "
                           f"{list(self.pruning_round_indices)}")

    # -- federation ----------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and is_federated(trainer):
            total = getattr(trainer, "max_rounds", None)
            if isinstance(total, bool) or not isinstance(total, int) or total < 1:
                raise MisconfigurationException(f"PruningTimeVoting needs the number of rounds T "
                                                f"(`trainer.max_rounds`) as an int >= 1, got {total!r}")
            self._reset()  # the records start afresh in the new store; a checkpoint is loaded after setup

    def on_federated_round_start(self, trainer: Any, pl_module: Any) -> None:
        self._follow(int(trainer.max_rounds))  # after a resume with another number of rounds
        self._begin_round(int(trainer.current_round))

    def on_client_before_aggregation(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        client = int(client_id)
        if not bool(self._records.of(trainer, client)[HAS_INITIAL]):
            self._take_initial(trainer, pl_module, client)

    def on_client_train_end(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        client = int(client_id)
        delta = self._delta(trainer, pl_module, client)
        self._begin_round(int(trainer.current_round))
        self._record(self._records.of(trainer, client), delta)

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        metrics = self._close_round(int(trainer.current_round), int(trainer.max_rounds))
        if metrics:
            trainer.log_metrics(metrics)

    # -- sharded federations (lightning_dfl.federation.loop.sharded) --------------------------
    def shard_snapshot(self) -> tuple[int, int, int]:
        return len(self._round_votes), len(self._round_scores), self._initial._version

    def shard_delta(self, snapshot: tuple[int, int, int]) -> tuple[list, list, dict | None]:
        votes, scores, version = snapshot
        initial = self._initial.state() if self._initial._version != version else None
        return self._round_votes[votes:], self._round_scores[scores:], initial

    def shard_rollback(self, snapshot: tuple[int, int, int]) -> None:
        votes, scores, _ = snapshot  # the initial models' union is kept: merging it again changes nothing
        del self._round_votes[votes:], self._round_scores[scores:]

    def shard_apply(self, delta: tuple[list, list, dict | None]) -> None:
        votes, scores, initial = delta
        self._round_votes.extend(votes)
        self._round_scores.extend(scores)
        if initial is not None:
            self._initial.merge(initial)

    # -- plain Trainer -------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_federated(trainer):
            return
        total = trainer.max_epochs
        if total is None or total < 1:
            raise MisconfigurationException(f"PruningTimeVoting needs a finite number of epochs T, got "
                                            f"max_epochs={total!r}; set max_epochs")
        restored, self._restored = self._restored, False
        if not restored:
            self._reset()
        self._follow(int(total))  # resumed with another max_epochs
        if HAS_INITIAL not in self._records.plain:
            self._records.plain = OneRecord(self.client_state_fields(trainer, pl_module))
        if not bool(self._records.plain[HAS_INITIAL]):
            self._take_initial(trainer, pl_module, PLAIN_VOTER)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_federated(trainer):
            return  # a local epoch of a client; the federation votes per round
        epoch = int(trainer.current_epoch)
        self._begin_round(epoch)
        delta = self._delta(trainer, pl_module, PLAIN_VOTER)
        if getattr(trainer, "world_size", 1) > 1:  # one vote on every rank: PQIPruning prunes in the same epochs
            delta = trainer.strategy.broadcast(delta, src=0)
        self._record(self._records.plain, delta)
        for name, value in self._close_round(epoch, int(trainer.max_epochs)).items():
            log_epoch_value(pl_module, name, value)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "vote_shares": dict(self.vote_shares), "score_means": dict(self.score_means),
            "t_star": self.t_star, "total_rounds": self.total_rounds,
            "initial": self._initial.state(),
            "plain": {"record": self._records.plain.state(), "initial": self._plain_initial},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset()

        def ints(key: str) -> dict[int, float]:
            return {int(k): float(v) for k, v in (state_dict.get(key) or {}).items()}

        self.vote_shares, self.score_means = ints("vote_shares"), ints("score_means")
        self._initial.load(state_dict.get("initial") or {})
        plain = state_dict.get("plain") or {}
        self._records.plain.load(plain.get("record") or {})
        self._plain_initial = plain.get("initial")
        t_star, total = state_dict.get("t_star"), state_dict.get("total_rounds")
        if t_star is not None and total is not None:
            verbose, self.verbose = self.verbose, 0
            self._decide(int(t_star), int(total))
            self.verbose = verbose
        self._restored = True
