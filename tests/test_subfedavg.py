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
