"""FedAvg-FT and D-PSGD-FT (DisPFL App. B.4; baselines-notes section 1): the shared model fine-tuned
on each client before its evaluation, training unchanged, fine-tuning FLOPs on their own."""

import warnings

import pytest
import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DPSGD, FedAvg
from lightning_dfl.federation.algorithms.finetune import DPSGDFT, FedAvgFT
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 5


def _run(algorithm, rounds=2, partition="dirichlet", **trainer_kw):
    dm = FederatedDataModule(dataset="digits", num_clients=K, partition=partition, classes_per_client=2,
                             batch_size=32, test_samples_per_client=30)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    trainer_kw.setdefault("local_epochs", 1)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu",
                               enable_progress_bar=False, **trainer_kw)
    trainer.fit(model, dm)
    return trainer


class SeeFineTuneLR(FedAvgFT):
    """FedAvg-FT that records the learning rate of every fine-tuning pass (round index -1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lrs = []

    def local_train(self, ctx):
        if ctx.round_idx == -1:
            self._lrs.append(ctx.optimizer.param_groups[0]["lr"])
        return super().local_train(ctx)


def test_fedavg_ft_zero_epochs_is_fedavg_and_finetuning_changes_only_the_evaluation():
    plain = _run(FedAvg(clients_per_round=3))
    zero = _run(FedAvgFT(clients_per_round=3, finetune_epochs=0))
    tuned_algo = SeeFineTuneLR(clients_per_round=3)
    tuned = _run(tuned_algo)
    for p, z, t in zip(plain.history, zero.history, tuned.history):
        # no fine-tuning: every client is scored by the global model w itself, exactly
        assert z["acc/finetune_mean"] == p["acc/consensus_mean"] == z["acc/headline"]
        assert z["acc/finetune_std"] == p["acc/consensus_std"] and z["flops/finetune_total"] == 0.0
        # training and what is sent are FedAvg's, with or without fine-tuning; FT FLOPs stay out of train FLOPs
        for key in ("acc/consensus_mean", "flops/train_total", "comm/busiest_bytes", "comm/total_bytes"):
            assert t[key] == p[key] == z[key]
        assert t["acc/trained_mean"] == p["acc/personal_mean"]  # the sampled clients' models, renamed
        assert t["acc/headline"] == t["acc/personal_mean"] == t["acc/finetune_mean"] != t["acc/consensus_mean"]
    for n in plain.store.names:
        assert torch.equal(tuned.store.weights[n], plain.store.weights[n])
        assert torch.equal(zero.store.weights[n], plain.store.weights[n])
    # one full local round (E = 1 here) on every client's whole training set: 3 x forward FLOPs per sample
    samples = sum(plain.datamodule.client_train_size(k) for k in range(K))
    expected = samples * 3 * tuned.module.forward_flops()
    assert tuned.history[-1]["flops/finetune_total"] == pytest.approx(expected, rel=1e-9)
    assert tuned.history[-1]["flops/finetune_per_client"] == pytest.approx(expected / K, rel=1e-9)
    # the authors' client.train(w, -1): lr_0 x 0.998^-1 for every client, every evaluated round
    assert tuned_algo._lrs == [pytest.approx(0.05 / 0.998, rel=1e-12)] * (2 * K)


def test_dpsgd_ft_tunes_the_consensus_of_all_clients_and_leaves_gossip_unchanged():
    plain = _run(DPSGD(num_neighbors=2))
    zero = _run(DPSGDFT(num_neighbors=2, finetune_epochs=0), rounds=1)
    assert zero.history[0]["acc/finetune_mean"] == plain.history[0]["acc/consensus_mean"]  # x-bar, untouched
    tuned = _run(DPSGDFT(num_neighbors=2, finetune_epochs=2), eval_every=2)  # fine-tunes after round 1 only
    p, t = plain.history[-1], tuned.history[-1]
    assert t["acc/trained_mean"] == p["acc/personal_mean"] and t["flops/train_total"] == p["flops/train_total"]
    assert t["acc/consensus_mean"] == p["acc/consensus_mean"] != t["acc/finetune_mean"]
    for n in plain.store.names:
        assert torch.equal(tuned.store.weights[n], plain.store.weights[n])
    samples = sum(plain.datamodule.client_train_size(k) for k in range(K))
    assert t["flops/finetune_total"] == pytest.approx(2 * samples * 3 * tuned.module.forward_flops(), rel=1e-9)


@pytest.mark.parametrize("algorithm", [FedAvgFT(clients_per_round=3), DPSGDFT(num_neighbors=2)],
                         ids=["fedavg_ft", "dpsgd_ft"])
def test_on_pathological_two_classes_finetuning_is_far_above_the_shared_model(algorithm):
    last = _run(algorithm, partition="pathological").history[-1]
    assert last["acc/finetune_mean"] > 0.8
    # seed 0: FedAvg-FT 0.82 vs the global model's 0.37, D-PSGD-FT 0.82 vs 0.47
    assert last["acc/finetune_mean"] > last["acc/consensus_mean"] + 0.3


def test_finetuning_follows_the_evaluation_schedule():
    history = _run(FedAvgFT(clients_per_round=2, finetune_epochs=0), rounds=3, eval_every=2).history
    assert ["acc/finetune_mean" in m for m in history] == [False, True, True]  # round 1 (every 2nd) and the last
    assert ["acc/headline" in m for m in history] == [False, True, True]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_finetune_epochs_is_validated(bad):
    message = r"finetune_epochs \(None: the trainer's local epochs\) must be an integer >= 0"
    with pytest.raises(ValueError, match=message):
        FedAvgFT(finetune_epochs=bad)
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        DPSGDFT(finetune_epochs=bad)
    with pytest.raises(ValueError, match="clients_per_round must be >= 1, got 0"):
        FedAvgFT(clients_per_round=0)


def test_the_personal_spread_describes_the_fine_tuned_models():
    """``acc/personal_min|p10|max|count`` are the fine-tuned models' (every client's), as ``acc/personal_mean``
    is; the trained clients' spread moves to ``acc/trained_*`` (the max was once below the mean)."""
    trainer = _run(FedAvgFT(clients_per_round=3))
    for row in trainer.history:
        for stat in ("mean", "std", "min", "p10", "max", "count"):
            assert row[f"acc/personal_{stat}"] == row[f"acc/finetune_{stat}"], stat
        assert row["acc/personal_count"] == K and row["acc/trained_count"] == 3
        assert row["acc/personal_min"] <= row["acc/personal_p10"] <= row["acc/personal_mean"] <= row["acc/personal_max"]
        assert row["acc/trained_min"] <= row["acc/trained_mean"] <= row["acc/trained_max"]
