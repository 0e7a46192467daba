"""When to start pruning: DA-DPFL's detection score and voting rule (Sec. IV-C, Eq. 4-6).

The pure rules live in :mod:`lightning_dfl.scheduling`; this callback feeds them with weights:

* Eq. 4: ``Delta^t(k) = ||w^t - w^0||^2`` over all floating parameters of the module (zeros
  included), after the local epochs of round ``t`` and before PQI pruning; the score is
  ``|Delta^t - Delta^(t-1)| / |Delta^1|``;
* Eq. 5: the client's vote is 1 ("stable") when its score is below ``delta_pr``;
* errata: ``t* = min{t : mean vote >= delta_v}``, decided once;
* Eq. 6 (errata): the pruning rounds ``t_1 = max(t* + b, t* + 1)``, ``t_p = t_(p-1) + I_p``,
  ``t_p < T`` (:func:`~lightning_dfl.scheduling.pruning_rounds`).

Round numbering: the papers count rounds ``t = 1..T``; the engine counts ``round_idx = t - 1``
from 0. ``Delta^1`` is the Delta of a client's first round; in that round it has no score and
votes 0 (Eq. 4 read literally, with ``Delta^0 = ||w^0 - w^0||^2 = 0``, gives the score 1 there,
which is not stable for any ``delta_pr <= 1``). ``t*`` is reported in paper numbering (``round_idx + 1`` of the first round whose vote
share reaches ``delta_v``); a paper pruning round ``t_p`` runs at ``round_idx = t_p - 1``, so the
first pruning happens in a later round than the one that decided ``t*`` (Alg. 1 line 27).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_dfl.callbacks._mask_owner import module_mask
from lightning_dfl.callbacks.base import FederatedCallback, is_federated
from lightning_dfl.checks import is_number
from lightning_dfl.scheduling import PruningSchedule, detection_score, first_pruning_round, pruning_rounds, vote

#: The voter id used in a plain ``Trainer`` (one model, one vote).
PLAIN_VOTER = 0


def _floating_parameters(pl_module: Any) -> dict[str, Tensor]:
    return {name: p for name, p in pl_module.named_parameters() if p.is_floating_point()}


def _masks_by_parameter_name(pl_module: Any, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The module's ``ModelMask`` entries, renamed to ``pl_module.named_parameters()`` names."""
    mask = module_mask(pl_module)
    if mask is None:
        return {}
    name_of = {id(p): name for name, p in params.items()}
    return {name_of[id(p)]: mask.masks[m] for m, p in mask.params.items() if id(p) in name_of}


class InitialModels:
    """Each voter's initial model ``w^0``, stored compactly and reconstructed exactly.

    Clients usually start from one shared dense model, each masked by its own initial mask.
    The first consistent model becomes a CPU *reference*; a client whose model equals the
    reference on its active entries (masked parameters), is zero on its inactive ones, and
    equals it everywhere on unmasked parameters is stored as its mask's packed bits
    (``numpy.packbits``, 1 bit per masked entry); entries the reference does not know yet are
    filled in from that client. Any other client (another initialization, a foreign module
    without a mask that differs from the reference, NaNs) is stored as a full CPU copy. The
    reconstruction ``where(mask, reference, 0)`` is therefore exact, up to the sign of zeros.
    """

    def __init__(self) -> None:
        self.reference: dict[str, Tensor] | None = None
        self.known: dict[str, Tensor] = {}  # masked names: entries of the reference seen so far
        self.clients: dict[int, dict[str, dict[str, Tensor]]] = {}  # {"bits": ...} or {"full": ...}
        self._version = 0
        self._cache: tuple[torch.device, int, dict[str, Tensor]] | None = None

    def __contains__(self, client: int) -> bool:
        return client in self.clients

    @property
    def num_full_copies(self) -> int:
        """Clients stored as a full copy rather than as bits over the shared reference."""
        return sum("full" in entry for entry in self.clients.values())

    def nbytes(self) -> int:
        tensors = list((self.reference or {}).values()) + list(self.known.values())
        for entry in self.clients.values():
            for part in entry.values():
                tensors += list(part.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def add(self, client: int, params: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> None:
        """Store ``client``'s initial model ``params`` (masked by ``masks``, names a subset)."""
        cpu = {n: t.detach().to("cpu", copy=True) for n, t in params.items()}
        bool_masks = {n: masks[n].detach().to("cpu", dtype=torch.bool) for n in masks}
        if self._compatible(cpu, bool_masks):
            if self.reference is None:
                self.reference = {n: torch.where(bool_masks[n], w, torch.zeros_like(w)) if n in bool_masks else w
                                  for n, w in cpu.items()}
                self.known = {n: m.clone() for n, m in bool_masks.items()}
            else:
                for n, m in bool_masks.items():
                    new = m & ~self.known[n]
                    self.reference[n][new] = cpu[n][new]
                    self.known[n] |= m
            self._version += 1
            self.clients[client] = {"bits": {n: torch.from_numpy(np.packbits(m.numpy().reshape(-1)))
                                             for n, m in bool_masks.items()}}
        else:
            self.clients[client] = {"full": cpu}

    def _compatible(self, cpu: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> bool:
        for n, m in masks.items():
            if m.shape != cpu[n].shape or bool(cpu[n][~m].ne(0).any()):
                return False  # nonzero (or NaN) outside its mask
        if self.reference is None:
            return True
        if set(cpu) != set(self.reference) or set(masks) != set(self.known):
            return False
        for n, w in cpu.items():
            ref = self.reference[n]
            if w.shape != ref.shape or w.dtype != ref.dtype:
                return False
            if n in masks:
                both = masks[n] & self.known[n]
                if not torch.equal(w[both], ref[both]):
                    return False
            elif not torch.equal(w, ref):
                return False
        return True

    def _reference_on(self, device: torch.device) -> dict[str, Tensor]:
        assert self.reference is not None
        if self._cache is None or self._cache[0] != device or self._cache[1] != self._version:
            self._cache = (device, self._version, {n: t.to(device) for n, t in self.reference.items()})
        return self._cache[2]

    def get(self, client: int, name: str, device: torch.device) -> Tensor:
        """Parameter ``name`` of ``client``'s initial model, on ``device``."""
        entry = self.clients[client]
        if "full" in entry:
            return entry["full"][name].to(device)
        ref = self._reference_on(device)[name]
        bits = entry["bits"].get(name)
        if bits is None:
            return ref
        mask = np.unpackbits(bits.numpy(), count=ref.numel()).astype(bool).reshape(tuple(ref.shape))
        return torch.where(torch.from_numpy(mask).to(device), ref, torch.zeros((), dtype=ref.dtype, device=device))

    @torch.no_grad()
    def distance_sq(self, client: int, params: Mapping[str, Tensor]) -> float:
        """``||w - w^0||^2`` over ``params`` (Eq. 4's Delta), accumulated in float64."""
        entry = self.clients[client]
        names = set(entry.get("full", self.reference) or {})
        if set(params) != names:
            raise ValueError(f"client {client}'s parameters changed since its initial model was stored: "
                             f"missing {sorted(names - set(params))}, new {sorted(set(params) - names)}")
        total: Tensor | None = None
        for name, p in params.items():
            w0 = self.get(client, name, p.device)
            if w0.shape != p.shape:
                raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, its initial value "
                                 f"{tuple(w0.shape)}")
            acc = torch.float32 if p.device.type == "mps" else torch.float64
            part = (p.detach().to(acc) - w0.to(acc)).square().sum()
            total = part if total is None else total + part.to(total.device)
        return float(total) if total is not None else 0.0

    def state(self) -> dict[str, Any]:
        return {"reference": self.reference, "known": self.known, "clients": self.clients}

    def load(self, state: Mapping[str, Any]) -> None:
        self.reference = state.get("reference")
        self.known = dict(state.get("known") or {})
        self.clients = {int(k): v for k, v in (state.get("clients") or {}).items()}
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

    Plain ``Trainer``: one voter; ``w^0`` is taken at ``on_fit_start`` (a fresh fit resets the
    history unless a checkpoint state was loaded), a round is an epoch (``t`` = epoch + 1),
    ``T = max_epochs`` (must be finite) and the metrics are logged with ``pl_module.log``.

    Checkpoints: :meth:`state_dict` holds the Deltas, scores, votes, shares, ``t*`` and the
    initial models in their compact form (one reference model plus one bit per masked entry per
    client; full copies only for clients that need them), since a resumed run can no longer see
    ``w^0``. Use one callback instance per run.

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
        if verbose not in (0, 1, 2) or isinstance(verbose, bool):
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
        #: per client: Delta of its first round (Delta^1) and of its latest round.
        self.delta_first: dict[int, float] = {}
        self.delta_last: dict[int, float] = {}
        #: per client: its latest score (absent before its second round) and vote.
        self.scores: dict[int, float] = {}
        self.votes: dict[int, int] = {}
        #: per round index: the vote share and the mean score of the clients that trained.
        self.vote_shares: dict[int, float] = {}
        self.score_means: dict[int, float] = {}
        #: the first pruning time in paper numbering (round index + 1), once decided.
        self.t_star: int | None = None
        self.total_rounds: int | None = None
        #: the pruning rounds of Eq. 6 as 0-based round (epoch) indices.
        self.pruning_round_indices: tuple[int, ...] = ()
        self._round: int | None = None
        self._round_votes: dict[int, int] = {}
        self._round_scores: dict[int, float] = {}

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

    @property
    def num_full_copies(self) -> int:
        """Clients whose initial model is kept as a full copy (the others cost one bit per masked entry)."""
        return self._initial.num_full_copies

    # -- the rules -----------------------------------------------------------------------
    def _begin_round(self, round_idx: int) -> None:
        if self._round != round_idx:
            self._round = round_idx
            self._round_votes.clear()
            self._round_scores.clear()

    def _record(self, client: int, delta: float) -> tuple[float | None, int]:
        """Eq. 4-5 for one client's Delta; the first Delta of a client gives no score, vote 0."""
        if client not in self.delta_first:
            self.delta_first[client] = self.delta_last[client] = delta
            score, v = None, 0
        else:
            score = detection_score(delta, self.delta_last[client], self.delta_first[client])
            v = vote(score, self.delta_pr)
            self.delta_last[client] = delta
            self.scores[client] = score
            self._round_scores[client] = score
        self.votes[client] = v
        self._round_votes[client] = v
        return score, v

    def _close_round(self, round_idx: int, total: int) -> dict[str, float]:
        """The round's vote share, ``t*`` (once) and the metrics to log."""
        if self._round != round_idx or not self._round_votes:
            return {}
        share = sum(self._round_votes.values()) / len(self._round_votes)
        self.vote_shares[round_idx] = share
        metrics = {"voting/share": share}
        if self._round_scores:
            mean = math.fsum(self._round_scores.values()) / len(self._round_scores)
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

    def on_federated_round_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin_round(int(trainer.current_round))

    def on_client_before_aggregation(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        client = int(client_id)
        if client not in self._initial:
            params = _floating_parameters(pl_module)
            self._initial.add(client, params, _masks_by_parameter_name(pl_module, params))

    def on_client_train_end(self, trainer: Any, pl_module: Any, client_id: int) -> None:
        client = int(client_id)
        if client not in self._initial:
            raise RuntimeError(f"PruningTimeVoting has no initial model of client {client}: it is taken at the "
                               "client's first `on_client_before_aggregation`, which was not called")
        self._begin_round(int(trainer.current_round))
        self._record(client, self._initial.distance_sq(client, _floating_parameters(pl_module)))

    def on_federated_round_end(self, trainer: Any, pl_module: Any) -> None:
        metrics = self._close_round(int(trainer.current_round), int(trainer.max_rounds))
        if metrics:
            trainer.log_metrics(metrics)

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
        if PLAIN_VOTER not in self._initial:
            params = _floating_parameters(pl_module)
            self._initial.add(PLAIN_VOTER, params, _masks_by_parameter_name(pl_module, params))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_federated(trainer):
            return  # a local epoch of a client; the federation votes per round
        epoch = int(trainer.current_epoch)
        self._begin_round(epoch)
        self._record(PLAIN_VOTER, self._initial.distance_sq(PLAIN_VOTER, _floating_parameters(pl_module)))
        for name, value in self._close_round(epoch, int(trainer.max_epochs)).items():
            pl_module.log(name, value, on_step=False, on_epoch=True)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "delta_first": dict(self.delta_first), "delta_last": dict(self.delta_last),
            "scores": dict(self.scores), "votes": dict(self.votes),
            "vote_shares": dict(self.vote_shares), "score_means": dict(self.score_means),
            "t_star": self.t_star, "total_rounds": self.total_rounds,
            "initial": self._initial.state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset()

        def ints(key: str, cast: type) -> dict:
            return {int(k): cast(v) for k, v in (state_dict.get(key) or {}).items()}

        self.delta_first, self.delta_last = ints("delta_first", float), ints("delta_last", float)
        self.scores, self.votes = ints("scores", float), ints("votes", int)
        self.vote_shares, self.score_means = ints("vote_shares", float), ints("score_means", float)
        self._initial.load(state_dict.get("initial") or {})
        t_star, total = state_dict.get("t_star"), state_dict.get("total_rounds")
        if t_star is not None and total is not None:
            verbose, self.verbose = self.verbose, 0
            self._decide(int(t_star), int(total))
            self.verbose = verbose
        self._restored = True
