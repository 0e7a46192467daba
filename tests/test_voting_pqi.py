"""DA-DPFL's sparse-to-sparser callbacks: pruning-time voting (Eq. 4-6) and PQI pruning (Alg. 2)."""

from __future__ import annotations

import io
import logging
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import plain_trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule
from torch import nn

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.callbacks.pqi import PQIPruning
from lightning_dfl.callbacks.voting import PruningTimeVoting
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DADPFL
from lightning_dfl.federation.store import ClientFields, DenseClientStore, StateField
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.masks import ModelMask, sparsity


def _bool(rows):
    return torch.tensor(rows, dtype=torch.bool)


def _fed_trainer(callbacks, net=None, max_rounds=20, num_clients=4):
    """The duck-typed federated trainer: a client store holds the fields the callbacks declare for
    ``net`` (``trainer.client_state(k)``); per-round logged rows collect in ``trainer.logged``."""
    trainer = SimpleNamespace(is_federated=True, current_round=0, max_rounds=max_rounds, num_clients=num_clients,
                              callbacks=callbacks, logged={})
    trainer.log_metrics = lambda metrics: trainer.logged.setdefault(trainer.current_round, {}).update(metrics)
    fields = [spec for c in callbacks if hasattr(c, "client_state_fields") for spec in c.client_state_fields(trainer, net)]
    assert all(isinstance(spec, StateField) for spec in fields)
    trainer.store = DenseClientStore({}, [], num_clients, fields=fields)
    trainer.client_state = lambda k: ClientFields(trainer.store, k)
    return trainer


def _field(trainer, name):
    """Every client's value of a scalar store field, as Python numbers."""
    return {k: trainer.client_state(k)[name].item() for k in range(trainer.num_clients)}


def _is_plain(value):
    """A tensor, or plain containers of plain numbers (what ``torch.load(weights_only=True)`` reads back)."""
    if isinstance(value, torch.Tensor) or value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) is dict:
        return all(type(k) in (int, str) and _is_plain(v) for k, v in value.items())
    return type(value) is list and all(_is_plain(v) for v in value)


def _weights_only_round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# -- voting in a federation -------------------------------------------------------------------
class TinyMasked(nn.Module):
    """One Linear layer whose weight carries a ModelMask, as lightning-dfl's worker module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.mask = ModelMask(self, {"fc.weight": torch.ones(2, 4, dtype=torch.bool)}).attach()


W0 = torch.tensor([[0.5, 1.0, 1.5, 2.0], [-0.5, -1.0, -1.5, -2.0]])  # the shared dense init
B0 = torch.tensor([0.25, -0.25])
# Every client starts from (W0, B0) under its own mask (clients 0 and 2 share theirs).
MASKS = {0: _bool([[1, 1, 0, 0], [1, 0, 0, 0]]), 1: _bool([[0, 0, 1, 1], [0, 1, 1, 0]]),
         2: _bool([[1, 1, 0, 0], [1, 0, 0, 0]]), 3: _bool([[1, 0, 1, 0], [0, 0, 0, 1]])}
INIT = {k: (W0 * MASKS[k], B0.clone()) for k in range(4)}
ACTIVE = {0: (0, 1), 1: (0, 2), 2: (0, 0), 3: (1, 3)}  # one active weight entry per client
# Per client and round: perturbations (bias[0], bias[1], active weight) of w^t - w^0, dyadic so
# that every Delta = d1^2 + d2^2 + d3^2 is exact in floating point.
STEPS = {
    0: [(2, 0, 0), (2, 1, 0), (2, 1, 0.25), (2, 1, 0.5)],  # Delta 4, 5, 5.0625, 5.25
    1: [(1, 0, 0), (1, 0.5, 0), (1, 0.5, 0), (1, 0.5, 0.125)],  # Delta 1, 1.25, 1.25, 1.265625
    2: [(4, 0, 0), (4, 1, 0), (4, 1, 1), (4, 1, 1)],  # Delta 16, 17, 18, 18
    3: [(2, 0, 0), (2, 2, 0), (2, 2, 1), (2, 2, 1)],  # Delta 4, 8, 9, 9
}
# Eq. 4 scores |Delta^t - Delta^(t-1)| / Delta^1 from round index 1 on; votes at delta_pr = 0.03:
SCORES = {1: [0.25, 0.25, 1 / 16, 1.0],  # votes 0 0 0 0 -> share 0
          2: [1 / 64, 0.0, 1 / 16, 0.25],  # votes 1 1 0 0 -> share 0.5 >= delta_v: t* = 3
          3: [3 / 64, 1 / 64, 0.0, 0.0]}  # votes 0 1 1 1 -> share 0.75


@torch.no_grad()
def _set(net, weight, bias):
    net.fc.weight.copy_(weight)
    net.fc.bias.copy_(bias)


def _run_round(voter, trainer, net, published, round_idx):
    """One round as the federated trainer runs it, with hand-made training on one worker module."""
    trainer.current_round = round_idx
    voter.on_federated_round_start(trainer, net)
    for k in range(4):
        net.mask.load_({"fc.weight": MASKS[k]}, apply=False)
        _set(net, *published[k])
        voter.on_client_before_aggregation(trainer, net, k)
        w0, b0 = INIT[k]
        d1, d2, d3 = STEPS[k][round_idx] if round_idx < len(STEPS[k]) else STEPS[k][-1]
        weight, bias = w0.clone(), b0 + torch.tensor([float(d1), float(d2)])
        weight[ACTIVE[k]] += d3
        _set(net, weight, bias)
        voter.on_client_train_end(trainer, net, k)
        published[k] = (weight, bias)
    voter.on_federated_round_end(trainer, net)


def test_voting_scores_votes_t_star_and_pruning_rounds():
    voter = PruningTimeVoting(delta_pr=0.03, delta_v=0.5, b=0.0, c=1.3)
    net = TinyMasked()
    trainer = _fed_trainer([voter], net, max_rounds=20)
    published = {k: (w.clone(), b.clone()) for k, (w, b) in INIT.items()}

    _run_round(voter, trainer, net, published, 0)
    assert trainer.logged[0] == {"voting/share": 0.0}  # first round: no score, every vote 0
    assert _field(trainer, "voting/delta_first") == {0: 4.0, 1: 1.0, 2: 16.0, 3: 4.0}
    assert _field(trainer, "voting/vote") == {k: 0 for k in range(4)} and voter.latest_scores(trainer) == {}
    assert voter.t_star is None and not any(voter.is_pruning_round(r) for r in range(20))

    _run_round(voter, trainer, net, published, 1)
    assert [voter.latest_scores(trainer)[k] for k in range(4)] == pytest.approx(SCORES[1], abs=1e-12)
    assert trainer.logged[1] == pytest.approx({"voting/share": 0.0, "voting/score_mean": 1.5625 / 4})
    assert voter.t_star is None

    _run_round(voter, trainer, net, published, 2)
    assert [voter.latest_scores(trainer)[k] for k in range(4)] == pytest.approx(SCORES[2], abs=1e-12)
    assert _field(trainer, "voting/vote") == {0: 1, 1: 1, 2: 0, 3: 0}
    # share 0.5 == delta_v decides (the errata's ">="); round index 2 is paper round t* = 3.
    assert trainer.logged[2] == pytest.approx({"voting/share": 0.5, "voting/score_mean": 0.328125 / 4,
                                               "voting/t_star": 3.0})
    # Eq. 6 by hand, t* = 3, b = 0, c = 1.3, T = 20 (paper numbering):
    # t_1 = max(3 + 0, 3 + 1) = 4; I_2 = ceil(3 / 1.3) = ceil(2.31) = 3 -> 7;
    # I_3 = ceil(3 / 1.69) = ceil(1.78) = 2 -> 9; I_4 = ceil(3 / 2.197) = ceil(1.37) = 2 -> 11;
    # I_5 = ceil(3 / 2.856) = ceil(1.05) = 2 -> 13; I_6 = ceil(3 / 3.71) = 1 -> 14, 15, ..., 19 (< T).
    paper = [4, 7, 9, 11, 13, 14, 15, 16, 17, 18, 19]
    assert voter.t_star == 3 and list(voter.schedule) == paper
    assert voter.pruning_round_indices == tuple(t - 1 for t in paper)
    assert [r for r in range(20) if voter.is_pruning_round(r)] == [3, 6, 8, 10, 12, 13, 14, 15, 16, 17, 18]
    assert not voter.is_pruning_round(2)  # never the round that decided t*

    _run_round(voter, trainer, net, published, 3)
    assert [voter.latest_scores(trainer)[k] for k in range(4)] == pytest.approx(SCORES[3], abs=1e-12)
    assert trainer.logged[3]["voting/share"] == 0.75 and trainer.logged[3]["voting/t_star"] == 3.0  # decided once
    assert voter.vote_shares == {0: 0.0, 1: 0.0, 2: 0.5, 3: 0.75}
    # one shared reference; per client the mask of w^0 as packed bits (8 masked entries: one byte)
    for k in range(4):
        bits = trainer.client_state(k)["voting/initial_mask"]
        assert np.array_equal(bits.numpy(), np.packbits(MASKS[k].numpy().reshape(-1)))
        initial = voter.initial_model(trainer, k)
        assert torch.equal(initial["fc.weight"], INIT[k][0]) and torch.equal(initial["fc.bias"], INIT[k][1])


def test_voting_state_dict_and_store_restore_initial_models_and_schedule():
    voter = PruningTimeVoting()
    net = TinyMasked()
    trainer = _fed_trainer([voter], net)
    published = {k: (w.clone(), b.clone()) for k, (w, b) in INIT.items()}
    for r in range(3):
        _run_round(voter, trainer, net, published, r)
    assert _is_plain(voter.state_dict())
    saved = _weights_only_round_trip({"voting": voter.state_dict(), "store": trainer.store.state_dict()})
    restored, other = PruningTimeVoting(), TinyMasked()
    again = _fed_trainer([restored], other)
    again.store.load_state_dict(saved["store"])
    restored.load_state_dict(saved["voting"])
    assert restored.t_star == 3 and restored.pruning_round_indices == voter.pruning_round_indices
    assert restored.vote_shares == voter.vote_shares

    # round 3 continues identically on a fresh worker: w^0 came back from the state and the store
    _run_round(voter, trainer, net, dict(published), 3)
    _run_round(restored, again, other, dict(published), 3)
    for name in ("voting/delta_first", "voting/delta_last", "voting/score", "voting/vote"):
        assert _field(again, name) == _field(trainer, name)
    assert restored.vote_shares == voter.vote_shares and restored.score_means == voter.score_means


def test_voting_refuses_a_client_that_does_not_start_from_the_shared_model():
    voter = PruningTimeVoting()
    net = TinyMasked()
    trainer = _fed_trainer([voter], net)
    net.mask.load_({"fc.weight": MASKS[0]}, apply=False)
    _set(net, *INIT[0])
    voter.on_client_before_aggregation(trainer, net, 0)
    net.mask.load_({"fc.weight": MASKS[2]}, apply=False)
    _set(net, 2 * W0 * MASKS[2], B0)  # another initialization
    with pytest.raises(RuntimeError, match=r"client 2's initial model is not the shared initial model under its "
                                           r"mask: 'fc.weight' differs from the reference on active entries"):
        voter.on_client_before_aggregation(trainer, net, 2)
    _set(net, W0, B0)  # dense under a sparse mask
    with pytest.raises(RuntimeError, match="'fc.weight' is nonzero \\(or NaN\\) outside its mask"):
        voter.on_client_before_aggregation(trainer, net, 2)
    assert not trainer.client_state(2)["voting/has_initial"]


def test_voting_keeps_a_plain_voters_full_initial_model_when_it_needs_one():
    voter = PruningTimeVoting()
    net = TinyMasked()
    net.mask.load_({"fc.weight": MASKS[0]}, apply=False)
    _set(net, W0, B0)  # nonzero outside its mask: no masked reference, a full copy
    trainer = SimpleNamespace(is_federated=False, max_epochs=3)
    voter.on_fit_start(trainer, net)
    state = _weights_only_round_trip(voter.state_dict())
    assert _is_plain(state) and torch.equal(state["plain"]["initial"]["fc.weight"], W0)
    restored = PruningTimeVoting()
    restored.load_state_dict(state)
    restored.on_fit_start(trainer, TinyMasked())  # restored: keeps the loaded w^0
    assert torch.equal(restored.initial_model(trainer, 0)["fc.weight"], W0)


def test_voting_needs_the_initial_model_first():
    voter = PruningTimeVoting()
    net = TinyMasked()
    with pytest.raises(RuntimeError, match="no initial model of client 5"):
        voter.on_client_train_end(_fed_trainer([voter], net, num_clients=6), net, 5)
    with pytest.raises(MisconfigurationException, match="max_rounds"):
        voter.setup(SimpleNamespace(is_federated=True, max_rounds=None), TinyMasked(), "fit")


# -- PQI in a federation ----------------------------------------------------------------------
class TwoLayers(nn.Module):
    """fc1.weight (2x6) and fc2.weight (4x2): 20 masked entries, as given."""

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 2), nn.Linear(2, 4)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.tensor(fc1).view(2, 6))
            self.fc2.weight.copy_(torch.tensor(fc2).view(4, 2))
        self.mask = ModelMask(self, {"fc1.weight": self.fc1.weight != 0, "fc2.weight": self.fc2.weight != 0}).attach()


# Client below s*: 8 of 12 and 4 of 8 active, 8 zeros of 20 (sparsity 0.4).
# fc1 active |w| = s^2 for s = 1, 1.25, ..., 2.5, 6. With p = 0.5, q = 1 (so r/d = 1 - I):
#   I = 1 - (mean s)^2 / mean s^2 = 1 - (18.25/8)^2 / (59.1875/8) = 0.2966 -> c = floor(8 * 0.2966) = 2
# fc2 active |w| = 1, 4, 9, 100: I = 1 - (16/4)^2 / (114/4) = 0.4386 -> c = floor(4 * 0.4386) = 1
FC1 = [36.0, 0, -2.25, 1.5625, 0, 6.25, -1.0, 0, 4.0, -5.0625, 0, 3.0625]  # smallest: flat 6, then 3
FC2 = [0, 9.0, -100.0, 0, 0, 1.0, -4.0, 0]  # smallest: flat 5
# Client already at s* = 0.8: 4 active of 20.
FC1_SPARSE = [36.0, 0, 0, 0, 0, 0, -1.0, 0, 0, 0, 0, 0]
FC2_SPARSE = [0, 9.0, 0, 0, 0, 1.0, 0, 0]


def test_hand_computed_counts_by_formula():
    i1 = 1 - (18.25 / 8) ** 2 / (59.1875 / 8)
    i2 = 1 - (16 / 4) ** 2 / (114 / 4)
    assert math.floor(8 * min(i1, 0.9)) == 2 and math.floor(4 * min(i2, 0.9)) == 1


def _pqi_round(pqi, trainer, nets, round_idx):
    trainer.current_round = round_idx
    pqi.on_federated_round_start(trainer, nets[0])
    for k, net in enumerate(nets):
        pqi.on_client_train_end(trainer, net, k)
    pqi.on_federated_round_end(trainer, nets[0])


def test_pqi_prunes_the_hand_computed_smallest_weights_in_pruning_rounds_only():
    voter = SimpleNamespace(is_pruning_round=lambda r: r in (3, 5))  # duck-typed voting callback
    pqi = PQIPruning(target_sparsity=0.8)
    nets = [TwoLayers(FC1, FC2), TwoLayers(FC1_SPARSE, FC2_SPARSE)]
    trainer = _fed_trainer([voter, pqi], nets[0], num_clients=2)
    pqi.setup(trainer, nets[0], "fit")
    before = {n: p.detach().clone() for n, p in nets[0].named_parameters()}

    _pqi_round(pqi, trainer, nets, 2)  # not a pruning round
    assert all(torch.equal(p, before[n]) for n, p in nets[0].named_parameters())
    assert trainer.logged[2] == pytest.approx({"pqi/pruned_clients": 0.0, "pqi/pruned_weights": 0.0,
                                               "sparsity/mean": 0.6, "sparsity/std": 0.2})

    _pqi_round(pqi, trainer, nets, 3)
    pruned = {"fc1.weight": [6, 3], "fc2.weight": [5]}
    for name, flat in pruned.items():
        mask = nets[0].mask.masks[name].reshape(-1)
        weight = dict(nets[0].named_parameters())[name].detach().reshape(-1)
        expected_mask = before[name].reshape(-1) != 0
        expected_mask[flat] = False
        assert torch.equal(mask, expected_mask)
        assert torch.equal(weight, torch.where(expected_mask, before[name].reshape(-1), 0.0))
    assert nets[0].mask.sparsity() == pytest.approx(11 / 20)
    # client 1 is already at s* = 0.8: untouched
    assert nets[1].mask.sparsity() == pytest.approx(0.8)
    assert [(e.round_idx, e.client, e.pruned, e.counts) for e in pqi.history] == [
        (3, 0, 3, {"fc1.weight": 2, "fc2.weight": 1})]
    assert trainer.logged[3] == pytest.approx({"pqi/pruned_clients": 1.0, "pqi/pruned_weights": 3.0,
                                               "sparsity/mean": (0.55 + 0.8) / 2, "sparsity/std": 0.125})
    assert _field(trainer, "pqi/sparsity") == pytest.approx({0: 0.55, 1: 0.8})
    state = pqi.state_dict()
    assert _is_plain(state) and state["plain"] == {}  # no per-client state in the callback
    assert _weights_only_round_trip(state)["history"] == [
        {"round_idx": 3, "client": 0, "pruned": 3, "sparsity_before": 0.4, "sparsity_after": 0.55,
         "counts": {"fc1.weight": 2, "fc2.weight": 1}}]


def test_pqi_lands_exactly_on_target_and_stops_there():
    pqi = PQIPruning(target_sparsity=0.5, schedule=[1, 2])
    trainer = _fed_trainer([pqi], num_clients=1)
    net = TwoLayers(FC1, FC2)
    pqi.setup(trainer, net, "fit")
    _pqi_round(pqi, trainer, [net], 1)
    # budget floor(20 * 0.5) - 8 = 2 < 3: counts (2, 1) scaled by 2/3 -> (1.33, 0.67) -> floors (1, 0),
    # the remaining unit to the larger fraction (fc2): (1, 1), the smallest of each layer.
    assert pqi.history[-1].counts == {"fc1.weight": 1, "fc2.weight": 1}
    assert net.mask.sparsity() == 0.5
    assert not net.mask.masks["fc1.weight"].reshape(-1)[6] and not net.mask.masks["fc2.weight"].reshape(-1)[5]
    state = net.mask.state()
    _pqi_round(pqi, trainer, [net], 2)  # at s*: Alg. 2 does not run
    assert len(pqi.history) == 1 and trainer.logged[2]["pqi/pruned_clients"] == 0.0
    assert all(torch.equal(net.mask.masks[n], state[n]) for n in state)


def test_pqi_never_overshoots_over_many_events():
    torch.manual_seed(0)
    net = nn.Module()
    net.a, net.b = nn.Linear(30, 20), nn.Linear(20, 7)
    net.mask = ModelMask(net, {"a.weight": torch.rand(20, 30) < 0.6, "b.weight": torch.ones(7, 20, dtype=torch.bool)})
    net.mask.attach()
    pqi = PQIPruning(target_sparsity=0.73, schedule=lambda r: True)
    trainer = _fed_trainer([pqi], num_clients=1)
    pqi.setup(trainer, net, "fit")
    sparsities = []
    for r in range(30):
        with torch.no_grad():  # "training" between events: fresh Gaussian active weights
            for name, param in net.mask.params.items():
                param.copy_(torch.randn(param.shape) * net.mask.masks[name])
        _pqi_round(pqi, trainer, [net], r)
        sparsities.append(net.mask.sparsity())
    total = net.mask.num_masked()
    assert all(b >= a for a, b in zip(sparsities, sparsities[1:]))  # sparse to sparser
    assert total - net.mask.num_active() == math.floor(total * 0.73)  # lands on s* (to one weight)
    assert max(sparsities) <= 0.73  # never past it
    assert 3 < len(pqi.history) < 30  # incremental, then stops
    for name, mask in net.mask.masks.items():
        assert torch.count_nonzero(net.mask.params[name].detach()[~mask]) == 0


def test_verbose_lines(caplog):
    pqi = PQIPruning(target_sparsity=0.8, schedule=[0], verbose=2)
    trainer = _fed_trainer([pqi], num_clients=1)
    net = TwoLayers(FC1, FC2)
    pqi.setup(trainer, net, "fit")
    voter = PruningTimeVoting(verbose=1)
    published = {k: (w.clone(), b.clone()) for k, (w, b) in INIT.items()}
    tiny = TinyMasked()
    voter_trainer = _fed_trainer([voter], tiny, max_rounds=12)
    with caplog.at_level(logging.INFO):
        _pqi_round(pqi, trainer, [net], 0)
        for r in range(4):
            _run_round(voter, voter_trainer, tiny, published, r)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "PQI round 0 client 0: pruned 3 weights, sparsity 0.4000 -> 0.5500 (target 0.8)"
    assert lines[1].startswith("PQI   fc1.weight: pruned 2") and lines[2].startswith("PQI   fc2.weight: pruned 1")
    assert lines[3:] == ["Voting: t* = 3 (round index 2); pruning at round indices [3, 6, 8, 10]"]


def test_pqi_setup_finds_the_voter_or_says_why_not():
    net = TwoLayers(FC1, FC2)
    pqi = PQIPruning()
    with pytest.raises(MisconfigurationException, match="there is none"):
        pqi.setup(_fed_trainer([pqi]), net, "fit")
    voter = PruningTimeVoting()
    with pytest.raises(MisconfigurationException, match="PruningTimeVoting must come before PQIPruning"):
        pqi.setup(_fed_trainer([pqi, voter], net), net, "fit")
    with pytest.raises(MisconfigurationException, match="found 2 callbacks"):
        pqi.setup(SimpleNamespace(is_federated=True, callbacks=[voter, PruningTimeVoting(), pqi]), net, "fit")
    pqi.setup(_fed_trainer([voter, pqi], net), net, "fit")
    assert not pqi.should_prune(0)  # t* not decided yet
    with pytest.raises(MisconfigurationException, match="needs the module's own ModelMask"):
        PQIPruning(schedule=[1]).setup(_fed_trainer([]), nn.Linear(3, 3), "fit")
    bad = PQIPruning(schedule=lambda r: "yes")
    with pytest.raises(ValueError, match="returned 'yes' at round 4"):
        bad.should_prune(4)


# -- both callbacks in a federation: their per-client records live in the client store ---------
class Witness(FederatedCallback):
    """Records, per client, its model at its first task (w^0) and, per task, the Delta of the model it
    publishes (an independent Eq. 4; runs after voting and PQI, so only tasks PQI pruned nothing in compare)."""

    def __init__(self):
        self.initial, self.deltas = {}, {}

    def on_client_before_aggregation(self, trainer, pl_module, client_id):
        if client_id not in self.initial:
            self.initial[client_id] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_client_train_end(self, trainer, pl_module, client_id):
        pqi = next(c for c in trainer.callbacks if isinstance(c, PQIPruning))
        pruned = any((e.round_idx, e.client) == (trainer.current_round, client_id) for e in pqi.history)
        total = None
        for name, p in pl_module.named_parameters():
            part = (p.detach().double() - self.initial[client_id][name].double()).square().sum()
            total = part if total is None else total + part
        self.deltas.setdefault(client_id, []).append(None if pruned else float(total))


def test_federation_keeps_the_records_in_the_store_and_none_in_the_callbacks():
    warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")
    dm = FederatedDataModule(dataset="digits", num_clients=6, batch_size=32, test_samples_per_client=40)
    model = SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05)
    algo = DADPFL(num_neighbors=2, max_wait=2, delta_pr=1000.0, target_sparsity=0.7)  # votes stable at once
    witness = Witness()
    trainer = FederatedTrainer(algorithm=algo, rounds=5, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=[witness])
    trainer.fit(model, dm)
    voter, pqi = trainer.callbacks[:2]
    assert isinstance(voter, PruningTimeVoting) and isinstance(pqi, PQIPruning) and pqi.history
    assert voter.t_star == 2 and voter.pruning_round_indices == (2,)  # round index 4 prunes nothing

    masked = sum(m.numel() for m in model.mask.masks.values())
    assert trainer.store.fields["voting/initial_mask"][""].shape == (6, math.ceil(masked / 8))
    for k in range(6):
        record, deltas = trainer.client_state(k), witness.deltas[k]
        assert len(deltas) == 5 and deltas[0] is not None and deltas[-1] is not None
        assert record["voting/delta_first"].item() == deltas[0]  # float64 Delta, bit for bit
        assert record["voting/delta_last"].item() == deltas[-1]
        if deltas[-2] is not None:
            assert record["voting/score"].item() == abs(deltas[-1] - deltas[-2]) / deltas[0]
        assert record["voting/vote"].item() == 1
        assert record["voting/has_initial"].item()
        assert record["pqi/sparsity"].item() == sparsity(trainer.store.published(k)[1])
        initial = voter.initial_model(trainer, k)  # the shared reference under the client's packed mask
        assert initial.keys() == witness.initial[k].keys()
        assert all(torch.equal(initial[n], witness.initial[k][n]) for n in initial)

    # no per-client state in the callbacks: their state_dicts are global and plain
    for name in ("delta_first", "delta_last", "scores", "votes", "client_sparsity"):
        assert not hasattr(voter, name) and not hasattr(pqi, name)
    assert voter._round_votes == [] and voter._round_scores == [] and pqi._round_sparsity == []
    for callback in (voter, pqi):
        state = callback.state_dict()
        assert _is_plain(state)
        _weights_only_round_trip(state)
    assert voter.state_dict()["plain"] == {"record": {}, "initial": None} and pqi.state_dict()["plain"] == {}
    assert set(voter.state_dict()["vote_shares"]) == set(range(5))


# -- both callbacks in a plain Trainer on a foreign module --------------------------------------
class DigitsMLP(LightningModule):
    """A LightningModule that knows nothing of lightning-dfl."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)






def test_plain_trainer_votes_then_prunes_sparser_never_past_target(digits_loader):
    torch.manual_seed(0)
    model = DigitsMLP()
    voting = PruningTimeVoting(delta_pr=0.3)
    pqi = PQIPruning(target_sparsity=0.3)
    trainer = plain_trainer([voting, pqi], max_epochs=12)
    trainer.fit(model, digits_loader)

    assert voting.t_star is not None and voting.total_rounds == 12
    epochs = [e.round_idx for e in pqi.history]
    assert epochs and set(epochs) <= set(voting.pruning_round_indices)
    assert min(epochs) >= voting.t_star  # the first pruning epoch comes after the deciding one
    assert pqi.owns_mask
    masks = pqi.state_dict()["masks"]
    total = sum(m.numel() for m in masks.values())
    zeros = sum(int((~m).sum()) for m in masks.values())
    assert zeros == math.floor(0.3 * total)  # sparser than the dense start, landed on s*, not past it
    assert all(e.sparsity_after <= 0.3 for e in pqi.history)
    params = dict(model.named_parameters())
    for name, mask in masks.items():  # momentum and weight decay revive no pruned weight
        assert torch.count_nonzero(params[name].detach()[~mask]) == 0
    assert trainer.callback_metrics["voting/t_star"] == voting.t_star
    assert trainer.callback_metrics["sparsity/mean"] == pytest.approx(zeros / total)
    x, y = digits_loader.dataset.tensors
    assert (model(x).argmax(1) == y).float().mean() > 0.8
    # the one voter's record is the callbacks' own, in their (weights-only) state
    voting_state = _weights_only_round_trip(voting.state_dict())
    pqi_state = _weights_only_round_trip(pqi.state_dict())
    assert _is_plain(voting_state) and _is_plain(pqi_state)
    record = voting_state["plain"]["record"]
    assert record["voting/vote"].item() == 1 and math.isfinite(record["voting/delta_first"].item())
    assert voting.latest_scores(trainer) == {0: record["voting/score"].item()}
    assert pqi_state["plain"]["pqi/sparsity"].item() == 1.0 - (total - zeros) / total  # ModelMask.sparsity

    # a restored callback rebuilds its own mask from the checkpoint state, not from the weights
    restored = PQIPruning(0.3, schedule=[])
    restored.load_state_dict(pqi.state_dict())
    other = DigitsMLP()
    restored.setup(SimpleNamespace(callbacks=[restored]), other, "fit")
    restored.on_fit_start(SimpleNamespace(), other)  # the mask is set up once the module is built
    assert [e.round_idx for e in restored.history] == epochs
    for name, param in other.named_parameters():
        if name in masks:
            assert torch.equal(restored.state_dict()["masks"][name], masks[name])
            assert torch.count_nonzero(param.detach()[~masks[name]]) == 0
    restored.teardown(None, other, "fit")


def test_plain_trainer_refuses_unbounded_training(digits_loader):
    with pytest.raises(MisconfigurationException, match="finite number of epochs"):
        plain_trainer([PruningTimeVoting()], max_epochs=-1, max_steps=3).fit(DigitsMLP(), digits_loader)


# -- constructors ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, shown", [
    ({"delta_pr": 0.0}, "0.0"), ({"delta_pr": "0.03"}, "'0.03'"), ({"delta_v": 0}, "0"),
    ({"delta_v": 1.5}, "1.5"), ({"b": -1}, "-1"), ({"c": 0.0}, "0.0"), ({"c": float("inf")}, "inf"),
    ({"verbose": 3}, "3"),
])
def test_voting_constructor_errors_name_the_value(kwargs, shown):
    (key,) = kwargs
    with pytest.raises(MisconfigurationException, match=rf"`{key}`.*{shown}"):
        PruningTimeVoting(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"target_sparsity": 1.0}, r"`target_sparsity`.*1\.0"), ({"target_sparsity": -0.1}, r"`target_sparsity`.*-0\.1"),
    ({"p": 0.0}, r"`p`.*0\.0"), ({"q": 0.5, "p": 0.25}, r"`q`.*0\.5"), ({"p": 1.0, "q": 1.0}, r"p=1\.0, q=1\.0"),
    ({"eta_c": -1.0}, r"`eta_c`.*-1\.0"), ({"gamma": float("nan")}, r"`gamma`.*nan"),
    ({"beta": 1.1}, r"`beta`.*1\.1"), ({"schedule": [1, -2]}, r"`schedule`.*\[1, -2\]"),
    ({"schedule": "every"}, r"`schedule`.*'every'"), ({"verbose": True}, r"`verbose`.*True"),
])
def test_pqi_constructor_errors_name_the_value(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        PQIPruning(**kwargs)


def test_pqi_defaults_are_saps():
    pqi = PQIPruning()
    assert (pqi.target_sparsity, pqi.p, pqi.q, pqi.eta_c, pqi.gamma, pqi.beta) == (0.8, 0.5, 1.0, 0.0, 1.0, 0.9)
