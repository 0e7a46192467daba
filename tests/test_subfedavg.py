"""Sub-FedAvg (unstructured): personal masks by iterative magnitude pruning, averaging over holders."""

import math
import warnings

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, Message
from lightning_dfl.federation.algorithms.subfedavg import (
    SubFedAvg,
    hamming,
    holder_mean,
    magnitude_prune,
    prune_counts,
)
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 5


class Densities(FederatedCallback):
    def __init__(self):
        self.rounds = []

    def on_federated_round_end(self, trainer, pl_module):
        self.rounds.append([sum(int(m.sum()) for m in trainer.store.mask(k).values()) for k in range(K)])


class Probe(SubFedAvg):
    """Records what each client starts from: its worker after aggregation, its mask and the server's model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.starts = []

    def evaluate(self, ctx, stage):
        if stage == "aggregated":
            server, _ = ctx.store.published(ctx.num_clients)
            self.starts.append((ctx.worker_weights(), {n: m.clone() for n, m in ctx.store.mask(ctx.node).items()},
                                {n: t.clone() for n, t in server.items()}))
        return super().evaluate(ctx, stage)


class Reports(SubFedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reports = []

    def local_train(self, ctx):
        loss = super().local_train(ctx)
        self.reports.append(dict(ctx.report))
        return loss


def _fit(algorithm, rounds, callbacks=()):
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30,
                             max_train_samples=600)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=2, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=list(callbacks), cpu_threads=1)
    trainer.fit(model, dm)
    return trainer


def test_density_never_increases_and_stops_exactly_at_the_target():
    record = Densities()
    algo = Probe(clients_per_round=K, prune_fraction=0.3, target_density=0.5, acc_thresh=0.0)
    trainer = _fit(algo, rounds=3, callbacks=[record])
    size = trainer.store.masked_size()
    target = math.ceil(0.5 * size)
    counts = [[size] * K] + record.rounds
    for before, after in zip(counts, counts[1:]):
        assert all(a <= b for a, b in zip(after, before))  # never increases
    assert all(0.65 < c / size < 0.75 for c in counts[1])  # round 0: p = 0.3 of each layer
    assert counts[2] == [target] * K and counts[3] == [target] * K  # round 1 capped onto the target, then stops
    assert [h["subfedavg/pruned_clients"] for h in trainer.history] == [K, K, 0]
    # every client starts from w * m_i: the server's model under its personal mask (unmasked tensors: w)
    for worker, mask, server in algo.starts:
        for n in worker:
            expected = server[n] * mask[n] if n in mask else server[n]
            assert torch.equal(worker[n], expected.to(worker[n].dtype))
    assert 0 < trainer.history[-1]["acc/subnetwork_mean"] <= 1
    assert trainer.history[-1]["subfedavg/density_mean"] == pytest.approx(target / size)


@pytest.mark.parametrize("kwargs", [{"dist_thresh": 1.0}, {"acc_thresh": 1.0}])
def test_mask_unchanged_below_the_distance_threshold_or_when_the_check_fails(kwargs):
    record = Densities()
    algo = Reports(clients_per_round=3, prune_fraction=0.3, target_density=0.5, **kwargs)
    trainer = _fit(algo, rounds=1, callbacks=[record])
    assert len(algo.reports) == 3 and all(r["subfedavg/hamming"] > 1e-4 for r in algo.reports)  # m1 != m2
    if "acc_thresh" in kwargs:  # pruned, checked, reverted
        assert [r["subfedavg/accepted"] for r in algo.reports] == [0.0] * 3
    else:  # distance <= threshold: no pruning was tried
        assert not any("subfedavg/accepted" in r for r in algo.reports)
    assert record.rounds == [[trainer.store.masked_size()] * K]  # all ones, everywhere
    assert trainer.history[0]["subfedavg/pruned_clients"] == 0
    # a rejected pruning restores the trained weights: the published models are dense
    for k in range(K):
        weights, mask = trainer.store.published(k)
        assert all(bool(m.all()) for m in mask.values())


def test_hamming_and_magnitude_pruning_by_hand():
    m1 = {"a": torch.tensor([1, 1, 0, 0], dtype=torch.bool), "b": torch.tensor([1, 1], dtype=torch.bool)}
    m2 = {"a": torch.tensor([1, 0, 0, 0], dtype=torch.bool), "b": torch.tensor([1, 1], dtype=torch.bool)}
    assert hamming(m1, m2) == pytest.approx((0.25 + 0.0) / 2)  # mean over layers (dist_masks)
    weights = {"a": torch.tensor([0.5, -0.1, 9.0, 0.3]), "b": torch.tensor([-2.0, 1.0])}
    mask = {"a": torch.tensor([1, 1, 0, 1], dtype=torch.bool), "b": torch.tensor([1, 1], dtype=torch.bool)}
    pruned = magnitude_prune(weights, mask, {"a": 2, "b": 1})  # smallest active |w|: -0.1, 0.3; then 1.0
    assert pruned["a"].tolist() == [True, False, False, False] and pruned["b"].tolist() == [True, False]
    layers = {"a": torch.ones(10, dtype=torch.bool), "b": torch.ones(30, dtype=torch.bool)}
    assert prune_counts(layers, 0.1, target_active=20) == {"a": 1, "b": 3}  # p of each layer's alive weights
    assert prune_counts(layers, 0.1, target_active=38) == {"a": 1, "b": 1}  # capped: exactly 40 - 38


def test_server_averages_each_weight_over_its_holders():
    server = {"w": torch.tensor([9.0, 9.0, 9.0]), "b": torch.tensor([0.0])}
    a = Message(0, {"w": torch.tensor([2.0, 4.0, 0.0]), "b": torch.tensor([1.0])},
                {"w": torch.tensor([True, True, False])}, 0, 0)
    b = Message(1, {"w": torch.tensor([0.0, 6.0, 0.0]), "b": torch.tensor([3.0])},
                {"w": torch.tensor([False, True, False])}, 0, 0)
    out = holder_mean([a, b], server)
    assert out["w"].tolist() == [2.0, 5.0, 9.0]  # x_a / 1, (4 + 6) / 2, nobody holds it: the server's 9
    assert out["b"].tolist() == [2.0]  # unmasked: plain mean


@pytest.mark.parametrize("kwargs, match", [
    ({"prune_fraction": 0.0}, "prune_fraction .p. must be a number in \\(0, 1\\), got 0.0"),
    ({"target_density": 1.5}, "target_density must be a number in \\(0, 1\\], got 1.5"),
    ({"dist_thresh": -1}, "dist_thresh must be a number in \\[0, 1\\], got -1"),
    ({"acc_thresh": 50}, "acc_thresh must be an accuracy in \\[0, 1\\], got 50"),
    ({"clients_per_round": 0}, "clients_per_round must be an integer >= 1, got 0"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SubFedAvg(**kwargs)


def test_the_headline_is_the_subnetwork_accuracy_on_every_client():
    """baselines-notes 9: Sub-FedAvg is evaluated as w * m_i on every client's test set; that is its
    headline (it averaged only the clients sampled this round), so it compares with the other methods."""
    trainer = _fit(SubFedAvg(clients_per_round=2), rounds=2)
    for m in trainer.history:
        assert m["acc/headline"] == m["acc/subnetwork_mean"]
    assert trainer.history[-1]["acc/best"] == max(m["acc/subnetwork_mean"] for m in trainer.history)


def test_the_summary_density_is_the_mean_over_all_clients_not_the_last_rounds_sample():
    """The summary's "density (mean over all clients)": every client's final mask, as ``subfedavg/density_mean``;
    the last round's ``density/mean`` covers only its sampled clients (and their masks before pruning)."""
    algo = SubFedAvg(clients_per_round=2, prune_fraction=0.3, target_density=0.5, acc_thresh=0.0)
    trainer = _fit(algo, rounds=3)
    store, size = trainer.store, trainer.store.masked_size()
    by_hand = sum(sum(int(m.sum()) for m in store.mask(k).values()) / size for k in range(K)) / K
    last = trainer.history[-1]
    assert trainer.summary.final_density == pytest.approx(by_hand, rel=1e-12)
    assert trainer.summary.final_density == pytest.approx(last["subfedavg/density_mean"], rel=1e-12)
    assert trainer.summary.final_density != pytest.approx(last["density/mean"])  # today's sample, not everyone


# -- the reference code's behaviours as options (MMorafah/Sub-FedAvg main_u.py, src/client/client_u.py) -------------
class Layers(FederatedCallback):
    """Every client's alive count per layer after each round."""

    def __init__(self):
        self.rounds = []

    def on_federated_round_end(self, trainer, pl_module):
        self.rounds.append([{n: int(m.sum()) for n, m in trainer.store.mask(k).items()} for k in range(K)])


class Candidates(SubFedAvg):
    """Records each candidate mask: the samples trained so far, the weights and mask it is taken from, the mask."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.taken = []

    def _candidate(self, ctx):
        out = super()._candidate(ctx)
        mask = ctx.module.mask
        self.taken.append((ctx.node, ctx.train_batches.samples, {n: p.detach().clone() for n, p in mask.params.items()},
                           {n: m.clone() for n, m in mask.masks.items()}, out))
        return out


def test_prune_counts_with_the_codes_landing_step_by_hand():
    """client_u.py:85-93: the landing step fires when the pruned share plus p passes the target share (line 86),
    prunes the share of the alive weights that lands (line 89), at most the cap of each layer (lines 91-92)."""
    layers = {"a": torch.ones(20, dtype=torch.bool), "b": torch.tensor([True] * 60 + [False] * 20)}  # 80 of 100
    # 5 to land, 5 < p * size = 10: the landing step; 5 > 0.05 * 80 = 4: capped, round(0.05 * 20), round(0.05 * 60)
    assert prune_counts(layers, 0.1, target_active=75, cap=0.05) == {"a": 1, "b": 3}
    assert prune_counts(layers, 0.1, target_active=75, cap=0.1) == {"a": 1, "b": 4}  # 5 <= 8: lands, 1.25 / 3.75
    assert prune_counts(layers, 0.1, target_active=75) == {"a": 1, "b": 4}  # ours: p's 2 + 6 would pass: lands
    # 9 to land, 9 < 10: the code lands at once, pruning 9 / 80 = 11.25 % > p (2.25 / 6.75); ours prunes p, 2 + 6
    assert prune_counts(layers, 0.1, target_active=71, cap=1.0) == {"a": 2, "b": 7}
    assert prune_counts(layers, 0.1, target_active=71) == {"a": 2, "b": 6}
    # 20 to land, 20 >= 10: no landing step, plain p of each layer, with a cap or without
    assert prune_counts(layers, 0.1, target_active=60, cap=0.05) == prune_counts(layers, 0.1, 60) == {"a": 2, "b": 6}


def test_landing_cap_prunes_at_most_the_cap_of_each_layer_per_step():
    """p = 0.3 to density 0.5: round 0 prunes 30 % of each layer; from then on the landing step (0.2 left < 0.3)
    prunes round(0.05 * alive) of each layer per round (ours lands at once: the first test)."""
    record = Layers()
    algo = SubFedAvg(clients_per_round=K, prune_fraction=0.3, target_density=0.5, acc_thresh=0.0, dist_thresh=0.0,
                     landing_cap=0.05)
    trainer = _fit(algo, rounds=3, callbacks=[record])
    start = {n: m.numel() for n, m in trainer.store.mask(0).items()}
    counts = [[start] * K] + record.rounds
    for r, share in enumerate([0.3, 0.05, 0.05]):
        for before, after in zip(counts[r], counts[r + 1]):
            assert after == {n: a - math.floor(share * a + 0.5) for n, a in before.items()}, (r, before, after)
    assert [h["subfedavg/pruned_clients"] for h in trainer.history] == [K, K, K]
    assert SubFedAvg(landing_cap=0.05).label() == "subfedavg (landing step capped at 0.05)"


def test_second_mask_epoch_takes_m2_after_that_epoch():
    """client_u.py:70-71: m2 from the weights after epoch 2 of E = 3 (ours: after epoch 3); the client applies it."""
    kwargs = dict(clients_per_round=K, prune_fraction=0.3, target_density=0.5, acc_thresh=0.0, dist_thresh=0.0)
    algo = Candidates(second_mask_epoch=2, **kwargs)
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30,
                             max_train_samples=600)
    trainer = FederatedTrainer(algorithm=algo, rounds=1, local_epochs=3, logger=False, accelerator="cpu",
                               enable_progress_bar=False, cpu_threads=1)
    trainer.fit(SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05), dm)
    assert sorted(node for node, *_ in algo.taken) == sorted(2 * list(range(K)))  # m1 and m2, no other
    for k in range(K):
        (_, n1, _, _, m1), (_, n2, weights, mask, m2) = [t for t in algo.taken if t[0] == k]
        assert n2 == 2 * n1  # after the first and the second pass over the client's data
        counts = {n: math.floor(0.3 * int(m.sum()) + 0.5) for n, m in mask.items()}  # p of each layer
        assert all(torch.equal(m2[n], magnitude_prune(weights, mask, counts)[n]) for n in mask)
        assert all(torch.equal(trainer.store.mask(k)[n], m2[n]) for n in m2)  # the mask it keeps
    ours = Candidates(**kwargs)  # the same run with m2 after epoch 3: another mask
    trainer = FederatedTrainer(algorithm=ours, rounds=1, local_epochs=3, logger=False, accelerator="cpu",
                               enable_progress_bar=False, cpu_threads=1)
    trainer.fit(SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05), dm)
    assert [t[1] for t in ours.taken if t[0] == 0][1] == 3 * [t[1] for t in algo.taken if t[0] == 0][0]
    assert any(not torch.equal(a[4][n], b[4][n]) for a, b in zip(algo.taken[1::2], ours.taken[1::2]) for n in a[4])
    assert SubFedAvg(second_mask_epoch=2).label() == "subfedavg (second mask after epoch 2)"


@pytest.mark.parametrize("target", [0.5, 0.8])
def test_second_mask_epoch_past_E_keeps_the_mask_unless_the_step_lands(target):
    """E = 2 < 5: m2 is the mask the client started with (client_u.py:41), Hamming(m1, m2) > 0 but applying it
    changes nothing; the landing step alone (p = 0.3 passes density 0.8) prunes the final net (line 93)."""
    record = Densities()
    algo = Reports(clients_per_round=K, prune_fraction=0.3, target_density=target, acc_thresh=0.0, second_mask_epoch=5)
    trainer = _fit(algo, rounds=1, callbacks=[record])
    size = trainer.store.masked_size()
    layers = {n: torch.ones_like(m, dtype=torch.bool) for n, m in trainer.store.mask(0).items()}  # all ones before
    counts = prune_counts(layers, 0.3, math.ceil(target * size))  # what m1 pruned of each layer; m2 nothing
    expected = sum(counts[n] / m.numel() for n, m in layers.items()) / len(layers)
    assert [r["subfedavg/hamming"] for r in algo.reports] == pytest.approx([expected] * K, abs=1e-6)
    if target == 0.5:
        assert record.rounds == [[size] * K] and not any("subfedavg/accepted" in r for r in algo.reports)
        assert trainer.history[0]["subfedavg/pruned_clients"] == 0
    else:
        assert record.rounds == [[math.ceil(0.8 * size)] * K] and trainer.history[0]["subfedavg/pruned_clients"] == K


class Initial(FederatedCallback):
    """Every client's published model before the first round."""

    def __init__(self):
        self.models = None

    def on_federated_round_start(self, trainer, pl_module):
        if self.models is None:
            self.models = [{n: t.clone() for n, t in trainer.store.published(k)[0].items()} for k in range(K)]


def test_own_model_headline_scores_each_clients_last_trained_model():
    """main_u.py:322-334: each client's own net on its test set: its model after its last task (trained, pruning kept
    or reverted), the initial model if it was never sampled (main_u.py:168-172); the headline with the option."""
    initial = Initial()
    algo = SubFedAvg(clients_per_round=2, prune_fraction=0.3, target_density=0.5, acc_thresh=0.0, headline="own_model")
    trainer = _fit(algo, rounds=3, callbacks=[initial])
    store, history = trainer.store, trainer.history
    ctx = trainer.federation.evaluation_context(2, True)
    by_hand, never = [], []
    for k in range(K):
        weights, mask = store.published(k)
        if all(torch.equal(weights[n], initial.models[k][n]) for n in weights):
            never.append(k)
        ctx.load(weights, mask, apply=False)
        by_hand.append(ctx.test(k))
    assert never and len(never) < K  # some clients were never sampled: they score the initial model
    last = history[-1]
    assert last["acc/own_model_mean"] == pytest.approx(sum(by_hand) / K, abs=1e-12)
    assert all(m["acc/headline"] == m["acc/own_model_mean"] for m in history)
    assert last["acc/best"] == max(m["acc/own_model_mean"] for m in history)
    assert "acc/subnetwork_mean" in last and last["acc/subnetwork_mean"] != last["acc/own_model_mean"]
    assert trainer.summary.headline_metric == "acc/own_model_mean"
    assert SubFedAvg(headline="own_model").label() == "subfedavg (scored on own model)"


def test_own_model_of_the_clients_trained_this_round_is_their_trained_accuracy():
    """All clients sampled each round: each own model is the one the task just scored (``acc/personal_mean``)."""
    trainer = _fit(SubFedAvg(clients_per_round=K, headline="own_model"), rounds=2)
    for m in trainer.history:
        assert m["acc/own_model_mean"] == pytest.approx(m["acc/personal_mean"], abs=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    ({"headline": "personal"}, "unknown headline 'personal'; allowed: subnetwork, own_model"),
    ({"second_mask_epoch": 0}, "second_mask_epoch \\(None: after the last epoch\\) must be an integer >= 1, got 0"),
    ({"second_mask_epoch": 2.5}, "second_mask_epoch \\(None: after the last epoch\\) must be an integer >= 1, got 2.5"),
    ({"landing_cap": 0.0}, "landing_cap must be None \\(land exactly on the target\\) or a share in \\(0, 1\\], got 0.0"),
    ({"landing_cap": 5}, "landing_cap must be None \\(land exactly on the target\\) or a share in \\(0, 1\\], got 5"),
    ({"landing_cap": "5%"}, "landing_cap must be None .* got '5%'"),
])
def test_bad_option_values_are_named_with_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SubFedAvg(**kwargs)


def test_the_codes_options_together_are_labelled():
    algo = SubFedAvg(headline="own_model", second_mask_epoch=5, landing_cap=0.05)
    assert algo.label() == ("subfedavg (scored on own model, second mask after epoch 5, landing step capped at 0.05)")
    assert SubFedAvg().label() == "subfedavg"
