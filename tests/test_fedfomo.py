"""FedFomo (Zhang et al., 2021): epsilon-greedy neighbours, validation-loss weights, affinity rows."""

import warnings

import numpy as np
import pytest
import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms.fedfomo import (
    AFFINITY,
    FedFomo,
    epsilon_at,
    epsilon_greedy,
    fomo_combine,
    fomo_weights,
)
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K, M = 5, 2


class Probe(FedFomo):
    """Records each update: its client, round, received senders, weights, affinity row before and
    after, validation batches, and the model the client starts training from."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.updates, self.starts = [], {}

    def update(self, ctx, messages, val):
        before = ctx.store.read(ctx.node, AFFINITY).clone()
        combined = super().update(ctx, messages, val)
        self.updates.append(dict(round=ctx.round_idx, node=ctx.node, senders=[m.sender for m in messages],
                                 models=[{n: t.clone() for n, t in m.weights.items()} for m in messages],
                                 weights=ctx.scratch["fedfomo/weights"], before=before,
                                 after=ctx.read(AFFINITY).clone(),  # staged until the node publishes
                                 val=torch.cat([b[0] for b in val]), train=ctx.scratch["fedfomo/train"][0][0]))
        return combined

    def evaluate(self, ctx, stage):
        if stage == "aggregated":
            own, _ = ctx.store.published(ctx.node)
            self.starts[(ctx.round_idx, ctx.node)] = (ctx.worker_weights(), {n: t.clone() for n, t in own.items()})
        return super().evaluate(ctx, stage)


@pytest.fixture(scope="module")
def run():
    algo = Probe(num_neighbors=M)
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30,
                             max_train_samples=600, partition="iid")  # iid: some neighbours do help
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    trainer = FederatedTrainer(algorithm=algo, rounds=3, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, cpu_threads=1)
    trainer.fit(model, dm)
    return trainer, algo


class Scores(FedFomo):
    """Records each client's accuracy at both stages of its task."""

    def evaluate(self, ctx, stage):
        acc = float(super().evaluate(ctx, stage))
        self.scores[(stage, ctx.round_idx, ctx.node)] = acc
        return acc


def test_the_after_aggregation_headline_scores_each_client_before_it_trains():
    """headline="aggregated" (the original's local_eval after initialize_clients): acc/headline is the mean of
    the clients' aggregated models' accuracies, not of their trained ones; labelled."""
    algo = Scores(num_neighbors=M, headline="aggregated")
    algo.scores = {}
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=30,
                             max_train_samples=300, partition="iid")
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    trainer = FederatedTrainer(algorithm=algo, rounds=2, local_epochs=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, cpu_threads=1)
    trainer.fit(model, dm)
    for r, row in enumerate(trainer.history):
        aggregated = np.mean([algo.scores[("aggregated", r, k)] for k in range(K)])
        trained = np.mean([algo.scores[("trained", r, k)] for k in range(K)])
        assert row["acc/headline"] == pytest.approx(aggregated, abs=1e-9) == row["acc/aggregated_mean"]
        assert row["acc/personal_mean"] == pytest.approx(trained, abs=1e-9)
    assert any(row["acc/headline"] != row["acc/personal_mean"] for row in trainer.history)
    assert algo.label() == "fedfomo (scored after aggregation)" and FedFomo().label() == "fedfomo"


def test_weights_by_hand_and_the_guarded_zero_distance():
    # own loss 2; a better model at distance 0.5, a worse one at 2, and one equal to theta_i (0/0)
    assert fomo_weights(2.0, [1.0, 3.0, 2.0], [0.5, 2.0, 0.0]) == [2.0, -0.5, 0.0]
    assert fomo_weights(2.0, [1.0], [0.0]) == [0.0]  # x / 0 is guarded too
    own = {"w": torch.zeros(2), "n": torch.tensor(3)}
    models = [{"w": torch.tensor([2.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}, {"w": torch.tensor([-1.0, -1.0])}]
    out = fomo_combine(own, models, [1.0, 3.0, -2.0])  # w+ / sum w+ = 1/4, 3/4, 0
    assert out["w"].tolist() == [0.5, 3.0] and out["n"].item() == 3  # non-floating entries stay
    assert fomo_combine(own, models, [-1.0, 0.0, -2.0]) is None  # no positive weight: theta is unchanged


def test_the_neighbour_at_the_quadratic_optimum_gets_the_largest_weight():
    optimum = torch.tensor([3.0, 4.0])

    def loss(theta):
        return float((theta - optimum).pow(2).sum())

    own = torch.zeros(2)
    # neighbours all at distance 5 from theta_i (on a common sphere the ratio ranks them by loss decrease;
    # a point between theta_i and the optimum would score higher still: the slope is steepest at theta_i)
    neighbours = [torch.tensor(p) for p in ([5.0, 0.0], [0.0, 5.0], [3.0, 4.0], [-3.0, 4.0], [4.0, -3.0])]
    weights = fomo_weights(loss(own), [loss(n) for n in neighbours], [float((n - own).norm()) for n in neighbours])
    assert int(np.argmax(weights)) == 2 and weights[2] == pytest.approx(5.0)  # (25 - 0) / 5
    assert weights[3] < 0 and weights[4] < 0  # farther from the optimum than theta_i: negative


def test_epsilon_schedule_and_greedy_choice():
    assert [epsilon_at(t) for t in (0, 1, 2)] == pytest.approx([0.3, 0.25, 0.2])
    assert epsilon_at(6) == 0.0 and epsilon_at(40) == 0.0
    affinity = [0.0, 5.0, -1.0, 3.0, 2.0]
    for seed in range(5):  # exploitation: the top M by affinity
        assert epsilon_greedy(affinity, [1, 2, 3, 4], 2, 0.0, np.random.default_rng(seed)) == [1, 3]
    explored = {tuple(epsilon_greedy(affinity, [1, 2, 3, 4], 2, 1.0, np.random.default_rng(s))) for s in range(20)}
    assert len(explored) > 3 and all(len(set(c)) == 2 for c in explored)  # random, distinct
    ties = {tuple(epsilon_greedy([0.0] * 5, [1, 2, 3, 4], 2, 0.0, np.random.default_rng(s))) for s in range(20)}
    assert len(ties) > 1  # equal affinities are ordered at random


def test_affinity_rows_weights_and_what_each_client_starts_from(run):
    trainer, algo = run
    assert len(algo.updates) == 3 * K
    for u in algo.updates:
        assert len(u["senders"]) == M and u["node"] not in u["senders"]
        delta = u["after"] - u["before"]
        expected = torch.zeros(K, dtype=delta.dtype)
        for j, w in u["weights"].items():
            expected[j] = w
        assert torch.allclose(delta, expected)  # P_ij += w_ij for the M received models, nothing else
        if u["round"] == 0:  # every model is the common initial one: distance 0, weight 0, nothing changes
            assert all(w == 0.0 for w in u["weights"].values())
        worker, own = algo.starts[(u["round"], u["node"])]
        if all(w <= 0 for w in u["weights"].values()):  # none lowers the validation loss: theta_i is kept
            assert all(torch.equal(worker[n], own[n]) for n in worker)
        else:  # theta_i + sum_j w_j+ / sum w+ (theta_j - theta_i) over the received start-of-round models
            expected = fomo_combine(own, u["models"], [u["weights"][j] for j in u["senders"]])
            assert all(torch.allclose(worker[n], expected[n], atol=1e-6) for n in worker)
            assert any(not torch.equal(worker[n], own[n]) for n in worker)
    positive = [u for u in algo.updates if any(w > 0 for w in u["weights"].values())]
    assert positive and len(positive) < len(algo.updates)  # both branches ran
    # each client downloads exactly M dense models a round
    model_bytes = trainer.store.active_values(0) * 4
    assert all(h["comm/total_bytes"] == K * M * model_bytes for h in trainer.history)


def test_validation_split_is_fixed_and_held_out(run):
    trainer, algo = run
    for k in range(K):
        mine = [u for u in algo.updates if u["node"] == k]
        assert all(torch.equal(u["val"], mine[0]["val"]) for u in mine)  # the same samples every round
        n = trainer.datamodule.client_train_size(k)
        assert len(mine[0]["val"]) == round(0.2 * n) and len(mine[0]["val"]) + len(mine[0]["train"]) == n
        val = mine[0]["val"].flatten(1)
        train = mine[0]["train"].flatten(1)
        assert not (torch.cdist(val, train) == 0).any()  # held out: no validation image is trained on
    assert trainer.history[0]["samples/train"] == sum(
        trainer.datamodule.client_train_size(k) - round(0.2 * trainer.datamodule.client_train_size(k))
        for k in range(K))


@pytest.mark.parametrize("kwargs, match", [
    ({"num_neighbors": 0}, "num_neighbors .M. must be an integer >= 1, got 0"),
    ({"epsilon": 1.5}, "epsilon must be a number in \\[0, 1\\], got 1.5"),
    ({"epsilon_decay": -0.1}, "epsilon_decay must be a number >= 0, got -0.1"),
    ({"val_fraction": 1.0}, "val_fraction must be a number in \\(0, 1\\), got 1.0"),
    ({"affinity_update": "sum"}, "unknown affinity_update 'sum'; allowed: raw, normalized"),
    ({"headline": "final"}, "unknown headline 'final'; allowed: personal, aggregated"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedFomo(**kwargs)
    with pytest.raises(ValueError, match="num_neighbors .M. must be < the number of clients .K.: got M=5, K=5"):
        FedFomo(num_neighbors=5).validate(5)
